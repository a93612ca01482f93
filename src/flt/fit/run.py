"""One fit or a sweep, written to a run directory: ``summary.json``, ``prediction.npy`` and
the figures (docs/fit.md)."""

from __future__ import annotations

import io
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import numpy as np
import torch

from flt._io import atomic_write, atomic_write_json
from flt.fit.config import FitConfig, row_indices
from flt.fit.core import FitResult, Problem, fit_problem, image_problem, signal_problem
from flt.fit.encodings import check_encoding


def load_problem(config: FitConfig) -> Problem:
    """The image of ``config`` as a problem: rows (``signal``) or the whole image (``image``)."""
    from flt.fit.images import load_image

    if config.task == "signal":
        image = load_image(config.image, mode="gray", size=config.size)
        return signal_problem(image, row_indices(config.rows, image.shape[0]))
    return image_problem(load_image(config.image, mode=config.mode, size=config.size))


def check_out_dir(out_dir: str) -> None:
    """Refuse a directory that already holds a run: results are never overwritten."""
    if os.path.exists(os.path.join(out_dir, "summary.json")):
        raise ValueError(f"{out_dir} already holds a run; delete it or choose another --out-dir")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out-dir {out_dir} exists and is not a directory")


def _write_json(path: str, data: dict) -> None:
    atomic_write_json(path, data, indent=2, sort_keys=True)


def _write_npy(path: str, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    atomic_write(path, lambda f: f.write(buffer.getvalue()), binary=True)


def _grid(prediction: torch.Tensor, problem: Problem) -> np.ndarray:
    """``[S, N, C]`` -> signals ``[S, N]`` or an image ``[H, W]`` / ``[H, W, C]``."""
    arr = prediction.numpy()
    if len(problem.shape) == 1:
        return arr[..., 0]
    img = arr[0].reshape(*problem.shape, arr.shape[-1])
    return img[..., 0] if img.shape[-1] == 1 else img


def _environment() -> dict:
    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}


def _config_dict(config: FitConfig, problem: Problem) -> dict:
    out = asdict(config)
    out["output"] = config.resolved_output
    out["shape"] = list(problem.shape)
    if config.task == "signal":
        out["rows"] = [int(label.split()[-1]) for label in problem.labels]
    return out


def _result_dict(result: FitResult) -> dict:
    return {"final": result.final, "per_signal": result.per_signal, "diagnostics": result.diagnostics,
            "parameters": result.parameters, "dim": result.dim}


def _title(config: FitConfig, result: FitResult) -> str:
    options = "".join(f":{k}={v}" for k, v in sorted(config.posenc_options.items()))
    return (f"{config.image} {config.task}, {config.posenc}{options} (D = {result.dim}), {config.model}: "
            f"train {result.final['psnr_train']:.2f} dB, test {result.final['psnr_test']:.2f} dB")


def run_fit(config: FitConfig, out_dir: str | None = None, *, device: str = "cpu", progress: bool = False,
            plots: bool = True, say: Callable[[str], object] = print) -> dict:
    """Fit ``config``; with ``out_dir``, write ``summary.json`` (configuration, ``final``
    PSNRs, per-signal PSNRs, diagnostics, history), ``prediction.npy`` and the figures
    (``reconstruction.png``, ``psnr.png``). Returns the summary."""
    check_encoding(config.posenc, config.posenc_options)
    if out_dir is not None:
        check_out_dir(out_dir)
    problem = load_problem(config)
    start = time.perf_counter()
    result = fit_problem(problem, config, device=device, progress=progress, desc=f"{config.task} {config.posenc}")
    summary = {"config": _config_dict(config, problem), **_result_dict(result), "history": result.history,
               "time_s": time.perf_counter() - start, "device": str(device), **_environment()}
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        _write_npy(os.path.join(out_dir, "prediction.npy"), _grid(result.prediction, problem))
        _write_json(os.path.join(out_dir, "summary.json"), summary)
        if plots:
            _plot_fit(problem, result, out_dir, _title(config, result))
    f = result.final
    say(f"{config.task} {config.posenc}: train {f['psnr_train']:.2f} dB, test {f['psnr_test']:.2f} dB "
        f"(held-out odd samples {f['psnr_odd']:.2f} dB), mean of {len(problem.labels)} signal(s); "
        f"{summary['time_s']:.1f} s" + (f"; run directory {out_dir}" if out_dir else ""))
    return summary


def _plot_fit(problem: Problem, result: FitResult, out_dir: str, title: str) -> None:
    from flt.fit.plots import plot_history, plot_image, plot_signals

    if len(problem.shape) == 1:
        plot_signals(problem.coords[:, 0].numpy(), problem.targets[..., 0].numpy(), _grid(result.prediction, problem),
                     problem.train.numpy(), problem.labels, os.path.join(out_dir, "reconstruction.png"), title=title)
    else:
        target = _grid(problem.targets, problem)
        plot_image(target, _grid(result.prediction, problem), os.path.join(out_dir, "reconstruction.png"), title=title)
    plot_history(result.history, os.path.join(out_dir, "psnr.png"), title=title)


def parse_sweep(text: str) -> tuple[str, list]:
    """``KEY=V1,V2,...`` or ``KEY=[V1, V2, ...]`` -> ``(key, [values])`` (values as JSON)."""
    from flt.options import parse_value

    key, sep, rest = text.partition("=")
    key = key.strip()
    if not sep or not key or not rest.strip():
        raise ValueError(f"--sweep expects KEY=V1,V2,..., got {text!r}")
    parsed = parse_value(rest)
    values = parsed if isinstance(parsed, list) else [parse_value(v) for v in rest.split(",")]
    if not values:
        raise ValueError(f"--sweep {text!r} has no values")
    if len(set(map(json.dumps, values))) != len(values):
        raise ValueError(f"--sweep {text!r} lists a value twice")
    return key, values


def sweep_configs(config: FitConfig, key: str, values: list) -> list[FitConfig]:
    """One config per value: ``dim`` sets the number of features, any other key an option of
    the encoding (checked against its constructor, so a misspelt key is named)."""
    if key == "dim":
        return [replace(config, dim=v) for v in values]
    if key in config.posenc_options:
        raise ValueError(f"--sweep {key} and --posenc-opt {key} both set {key!r}; give it once")
    configs = [replace(config, posenc_options={**config.posenc_options, key: v}) for v in values]
    for c in configs:
        check_encoding(c.posenc, c.posenc_options, flag="--sweep")
    return configs


def run_sweep(config: FitConfig, key: str, values: list, out_dir: str | None = None, *, device: str = "cpu",
              progress: bool = False, plots: bool = True, say: Callable[[str], object] = print) -> dict:
    """One fit per value of ``key``; ``summary.json`` holds every point (``sweep.points``)
    and, as ``final``, the point with the best test PSNR; ``prediction.npy`` stacks the
    predictions of every value; ``sweep.png`` draws the
    trade-off (:func:`flt.fit.plots.plot_tradeoff`) and ``sweep_reconstructions.png`` the
    reconstructions side by side (the first signal)."""
    configs = sweep_configs(config, key, values)
    if out_dir is not None:
        check_out_dir(out_dir)
    problem = load_problem(config)
    start = time.perf_counter()
    points, preds = [], []
    for i, (value, c) in enumerate(zip(values, configs, strict=True)):
        result = fit_problem(problem, c, device=device, progress=progress, desc=f"{key}={value} ({i + 1}/{len(values)})")
        points.append({"value": value, **_result_dict(result)})
        preds.append(_grid(result.prediction, problem))
        f, d = result.final, result.diagnostics
        say(f"{key} = {value}: train {f['psnr_train']:.2f} dB, test {f['psnr_test']:.2f} dB; stable rank "
            f"{d['stable_rank_train']:.1f} (train), {d['stable_rank_dense']:.1f} (dense); distance preservation "
            f"{d['distance_preservation']:.4f}; product {d['product']:.3f}")
    best = max(points, key=lambda p: p["final"]["psnr_test"])
    summary = {"config": _config_dict(config, problem), "sweep": {"key": key, "values": values, "points": points},
               "final": {**best["final"], key: best["value"]}, "time_s": time.perf_counter() - start,
               "device": str(device), **_environment()}
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        _write_npy(os.path.join(out_dir, "prediction.npy"), np.stack(preds))
        _write_json(os.path.join(out_dir, "summary.json"), summary)
        if plots:
            from flt.fit.plots import plot_sweep_reconstructions, plot_tradeoff

            options = "".join(f":{k}={v}" for k, v in sorted(config.posenc_options.items()))
            plot_tradeoff(key, points, os.path.join(out_dir, "sweep.png"),
                          title=f"{config.image} {config.task}, {config.posenc}{options}, {config.model}: PSNR against {key}")
            target = _grid(problem.targets, problem)
            first = [p[0] if len(problem.shape) == 1 else p for p in preds]
            plot_sweep_reconstructions(key, points, target[0] if len(problem.shape) == 1 else target, first,
                                       os.path.join(out_dir, "sweep_reconstructions.png"),
                                       coords=problem.coords[:, 0].numpy(), train=problem.train.numpy())
    say(f"best {key} = {best['value']}: test {best['final']['psnr_test']:.2f} dB; {summary['time_s']:.1f} s"
        + (f"; run directory {out_dir}" if out_dir else ""))
    return summary
