"""Time per training step and peak memory of the long-context LM against the context ``N``.

``python -m flt.bench.long --out DIR`` builds the ``longlm`` small preset's model
(2 layers, width 64, 2 heads, byte vocabulary) with each mechanism at each ``N`` and times
full training steps on one window of ``N`` random bytes: forward, cross-entropy, backward
and an AdamW update, float32, ``torch.set_num_threads(threads)``. Every ``(mechanism, N)``
runs in its own interpreter (``--worker``), so one configuration's memory never counts
against another's: one warm-up step, then steps until ``repeats`` or ``budget_s``; the
median wall time is reported with the spread of the repeats. Peak memory is the resident
high-water mark of one more step above the resident size before it, with glibc's ``mmap``
threshold fixed at 128 KiB and freed heap returned first (as in :mod:`flt.bench.measure`),
so it follows the live tensors of the step.

Mechanisms (:data:`MECHANISMS`): FLT with the task's options (banded estimator,
``near_field=16``), Performer and Toeplitz-FFT with FLT's number of features, exact
softmax with FLT's relative term ``f`` (``relative_bias="spectrum"`` with the same local
spectrum, materialised as ``[B, H, N, N]`` and passed to SDPA), and exact softmax with T5
buckets (the cheapest exact relative bias). A mechanism stops growing ``N`` once a step
takes more than ``max_step_s``. Results: ``long.json``, ``long.md`` (table and crossover
``N``) and ``long.png`` (ms/step and peak MiB against ``N``, log-log, the crossover marked).

``--decode`` measures generation instead (:func:`decode_speed`), in this process: at each
``--lengths`` prompt, the prompt's prefill in seconds and the decoding speed in new tokens
per second from each layer's state (constant-size for FLT and Performer, a KV cache for
exact softmax), with the bytes the state holds. Results: ``decode.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from flt._io import atomic_savefig, atomic_write_text
from flt.bench import write_json

if TYPE_CHECKING:  # torch is imported after the worker's memory limit is set
    from flt.models import CausalLM

#: name -> (attention, options replacing the task's defaults for it, or None for the defaults)
MECHANISMS = {
    "flt": ("flt", None),
    "performer": ("performer", None),
    "toeplitz": ("toeplitz", None),
    "softmax+spectrum": ("softmax", {"relative_bias": "spectrum", "spectrum": "local", "num_frequencies": 16, "amplitude": 1.0}),
    "softmax+t5": ("softmax", {"relative_bias": "t5"}),
}
LENGTHS = (1024, 2048, 4096, 8192)
#: The entry the exact ones are compared with (FLT), and the exact one the plot marks (the
#: cheapest exact relative bias).
HEADLINE = ("flt", "softmax+t5")


def exact_entries() -> list[str]:
    """The entries of :data:`MECHANISMS` whose mechanism is exact (every step forms all
    ``N^2`` pairs; :data:`flt.layers.registry.COSTS`), in their order."""
    from flt.layers.registry import COSTS

    return [name for name, (attention, _) in MECHANISMS.items() if COSTS[attention].exact]


def build(name: str, n: int) -> CausalLM:
    from flt.models import replace_fields
    from flt.tasks.longlm import LongLMTask

    attention, options = MECHANISMS[name]
    cfg = LongLMTask.presets["small"](attention).model
    cfg = replace_fields(cfg, max_len=n, vocab_size=256, **({} if options is None else {"attention_options": dict(options)}))
    return cast("CausalLM", LongLMTask.build_model(cfg))


def worker(cfg: dict) -> dict:
    import resource

    limit = int(cfg["max_mem_gb"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # fail with an error, not the OOM killer
    import torch
    import torch.nn.functional as F

    from flt.bench.measure import _fix_mmap_threshold, _reset_peak, _status_mb

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    model = build(cfg["mechanism"], cfg["n"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (cfg["batch"], cfg["n"] + 1))

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()  # warm-up (also allocates AdamW's state)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < cfg["repeats"] and (len(times) < 2 or time.perf_counter() - start < cfg["budget_s"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    mmap_fixed = _fix_mmap_threshold()
    reset = _reset_peak()
    before = _status_mb()["VmRSS"]
    step()
    peak = _status_mb()["VmHWM"] - before
    med = statistics.median(times)
    return {**cfg, "ms_per_step": 1000 * med, "spread": (max(times) - min(times)) / med, "repeats": len(times),
            "peak_mib": peak, "peak_method": "VmHWM-VmRSS" if reset and mmap_fixed else "unreliable"}


def decode_speed(mechanism: str, prompt_len: int = 4096, new_tokens: int = 32, threads: int = 1) -> dict:
    """Generation speed of the small model at a ``prompt_len``-byte prompt (untrained
    weights: speed does not depend on them), greedy, batch 1.

    Mechanisms that decode (:attr:`flt.models.CausalLM.supports_decoding`: FLT and
    Performer with a constant-size state, exact softmax with a KV cache) take the prompt in
    one forward pass (:meth:`flt.models.CausalLM.prefill`, ``prefill_s``), then generate
    ``new_tokens`` one at a time from the state (``decode_s``, ``tokens_per_s``);
    ``state_bytes`` is the memory the decoding state holds after them and ``state`` its
    kind. The others (Toeplitz) recompute the last ``max_len = prompt_len`` tokens for
    every new token (:meth:`flt.models.CausalLM.generate` with ``recurrent=False``).
    """
    import torch

    from flt.data.pysource import load_python_source
    from flt.models.lm import sample_next

    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens!r}")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build(mechanism, prompt_len).eval()
    prompt = load_python_source(max_bytes=prompt_len * 4).train[:prompt_len].long()[None]
    out: dict[str, Any] = {"mechanism": mechanism, "prompt": prompt_len, "new_tokens": new_tokens, "recurrent": model.supports_decoding}
    with torch.no_grad():
        if model.supports_decoding:
            t0 = time.perf_counter()
            logits, state = model.prefill(prompt)
            logits = logits[:, -1]
            out["prefill_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                logits, state = model.step(sample_next(logits, 0, None, None), state)
            out["decode_s"] = time.perf_counter() - t0
            layers = state.layers or []  # a list after prefill
            out["state"] = sorted({type(layer).__name__ for layer in layers})
            out["state_bytes"] = state_bytes(layers)
        else:
            t0 = time.perf_counter()
            model.generate(prompt, new_tokens, temperature=0, recurrent=False)
            out["decode_s"] = time.perf_counter() - t0
    out["tokens_per_s"] = new_tokens / out["decode_s"]
    return out


def state_bytes(state: object) -> int:
    """Bytes of the distinct tensor storages reachable from a decoding state (dataclasses,
    lists and tuples of them): the memory it holds, spare capacity of a KV cache included."""
    import dataclasses

    import torch

    seen: dict[int, int] = {}

    def walk(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)

    walk(state)
    return sum(seen.values())


def crossover(rows: list[dict], fast: str, exact: str, key: str = "ms_per_step") -> float | None:
    """The ``N`` (log-log interpolation between measured lengths) above which ``fast`` is
    cheaper than ``exact``; the smallest length if it already is there, None if never."""
    a = {r["n"]: r[key] for r in rows if r["mechanism"] == fast}
    b = {r["n"]: r[key] for r in rows if r["mechanism"] == exact}
    ns = sorted(set(a) & set(b))
    if not ns:
        return None
    if a[ns[0]] <= b[ns[0]]:
        return float(ns[0])
    for lo, hi in itertools.pairwise(ns):
        if a[hi] <= b[hi]:
            r_lo, r_hi = math.log(a[lo] / b[lo]), math.log(a[hi] / b[hi])
            t = r_lo / (r_lo - r_hi)
            return float(math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo))))
    return None


def report(rows: list[dict], header: str) -> str:
    mechs = [m for m in MECHANISMS if any(r["mechanism"] == m for r in rows)]
    ns = sorted({r["n"] for r in rows})
    get = {(r["mechanism"], r["n"]): r for r in rows}
    lines = [header, "", "| mechanism | " + " | ".join(f"N={n} ms/step | N={n} MiB" for n in ns) + " |",
             "|---|" + "---|---|" * len(ns)]
    for m in mechs:
        cells = []
        for n in ns:
            r = get.get((m, n))
            cells += ["not run", "-"] if r is None else [f"{r['ms_per_step']:.0f} (spread {r['spread']:.0%})", f"{r['peak_mib']:.0f}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    fast = HEADLINE[0]
    for exact in exact_entries():
        if exact not in mechs or fast not in mechs:
            continue
        for key, what in (("ms_per_step", "time"), ("peak_mib", "peak memory")):
            x = crossover(rows, fast, exact, key)
            common = sorted({r["n"] for r in rows if r["mechanism"] == exact} & {r["n"] for r in rows if r["mechanism"] == fast})
            where = ("never (in the measured range)" if x is None
                     else f"{x:.0f} or less (already at the smallest N both measured)" if x == common[0] else f"{x:.0f}")
            lines.append(f"- FLT's {what} below {exact}'s from N = {where}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ms_per_step", "ms per training step"), (axes[1], "peak_mib", "peak memory of a step (MiB)")):
        for m in MECHANISMS:
            pts = sorted((r["n"], r[key]) for r in rows if r["mechanism"] == m)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=m)
        x = crossover(rows, *HEADLINE, key)
        if x is not None:
            ax.axvline(x, color="grey", linestyle=":", label=f"FLT = exact softmax+T5 at N = {x:.0f}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context N (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def _load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none): the report states
    it, since other jobs slow every configuration."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flt.bench.long", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="long-bench", help="output directory (default: long-bench)")
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS), help=f"comma-separated, of {list(MECHANISMS)}")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated contexts N")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=20.0, help="time budget of the timed steps per configuration")
    parser.add_argument("--max-step-s", type=float, default=60.0, help="stop growing N for a mechanism past this step time")
    parser.add_argument("--decode", action="store_true",
                        help="measure generation at a --lengths prompt instead: prefill seconds and decoding tokens/s")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated with --decode")
    parser.add_argument("--max-mem-gb", type=float, default=8.0, help="address-space limit of each worker (GiB)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    mechs = [m.strip() for m in args.mechanisms.split(",") if m.strip()]
    unknown = [m for m in mechs if m not in MECHANISMS]
    if unknown:
        parser.error(f"--mechanisms: unknown {unknown}; known: {list(MECHANISMS)}")
    try:
        lengths = sorted(int(n) for n in args.lengths.split(","))
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    os.makedirs(args.out, exist_ok=True)
    if args.decode:
        results = []
        for m in mechs:
            for n in lengths:
                r = decode_speed(m, n, args.new_tokens, args.threads)
                results.append(r)
                print(json.dumps(r), flush=True)
                write_json(os.path.join(args.out, "decode.json"), results)
        return 0
    rows, failures = [], []
    load_before = _load_average()
    for m in mechs:
        for n in lengths:
            cfg = {"mechanism": m, "n": n, "threads": args.threads, "batch": args.batch, "repeats": args.repeats,
                   "budget_s": args.budget_s, "max_mem_gb": args.max_mem_gb}
            proc = subprocess.run([sys.executable, "-m", "flt.bench.long", "--worker", json.dumps(cfg)],
                                  capture_output=True, text=True)
            if proc.returncode:
                why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
                failures.append(f"{m} at N = {n}: {why}")
                print(f"{m} N={n}: failed ({why})", flush=True)
                break
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{m} N={n}: {row['ms_per_step']:.0f} ms/step (spread {row['spread']:.0%}), peak {row['peak_mib']:.0f} MiB", flush=True)
            write_json(os.path.join(args.out, "long.json"), rows)
            if row["ms_per_step"] > 1000 * args.max_step_s:
                break
    load = "load average (1 min) " + (f"{load_before:.1f} before, {_load_average():.1f} after"
                                      if load_before is not None else "unknown")
    header = (f"longlm small model, batch {args.batch}, {args.threads} thread(s), float32, training step "
              f"(forward, loss, backward, AdamW); {load}; `python -m flt.bench.long {' '.join(argv or sys.argv[1:])}`")
    text = report(rows, header) + "".join(f"- failed: {f}\n" for f in failures)
    atomic_write_text(os.path.join(args.out, "long.md"), text)
    plot(rows, os.path.join(args.out, "long.png"),
         f"longlm small model (2 layers, width 64), batch {args.batch}, CPU, {args.threads} thread(s); {load}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
