"""Tables, fitted scaling exponents, target ratios and the log-log plot of ``flt bench speed``.

Pure functions of the result dictionary :func:`flt.bench.speed.run` returns (and that
``speed.json`` stores), so a saved run can be re-rendered.

Unreliable timings (a busy machine; see :func:`flt.bench.speed.timing_flags`) are flagged,
never silently used: their cells say so, exponents are fitted without them (or omitted,
as is a time exponent below :data:`MIN_TIME_EXPONENT`), a target ratio built on one is
neither met nor missed, and a throughput above the matmul ceiling is not printed as a
fraction of it.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict
from typing import Any

from flt._io import atomic_savefig
from flt.bench.flops import floor_ratio, model_flops
from flt.bench.measure import timing_flags
from flt.bench.variants import SHAPES, VARIANTS

#: Targets of the project's issue 4 (CPU, 2 cores, float32, B=1, H=4, D=64, N=16384).
TARGETS = {
    "fwd_speedup": 30.0,  # FLT-logit fwd vs exact softmax with a materialised bias, at least
    "fwd_memory_ratio": 20.0,  # peak memory, same pair, at least
    "fwdbwd_speedup": 100.0,  # fwd+bwd, same pair, at least
    "vs_favor": 1.5,  # FLT-logit time / FAVOR+ time at equal m, at most
    "causal_overhead": 2.0,  # causal / bidirectional FLT-logit time, at most
    "memory_exponent": 1.1,  # fitted exponent of peak memory in N, every linear mechanism, at most
}

#: Targets of issue 12, against the float32 FLOP floor (:mod:`flt.bench.flops`) at N = target_n.
FLOOR_TARGETS = {
    "flt-logit/m256/R32+compile": 1.5,  # the logit coupling behind the compile switch, fwd and fwd+bwd
    "flt-logit/m256/R32+compile+bf16": 1.2,  # bf16 against the float32 floor
    "flt-mult/m64/R8": 2.0,  # the multiplicative (Kronecker) path
    "flt-mult/m64/R8+compile": 2.0,
    "flt-mult-hedgehog/m32/R256": 2.0,  # the catalysis estimator, held to the multiplicative path's target
}
CAUSAL_OVER_BIDIRECTIONAL = 1.3  # issue 12: causal FLT-logit time / bidirectional, at most

#: A fitted time exponent below this means more work took less time: the machine's load
#: changed between the sizes, and the exponent is omitted as unreliable.
MIN_TIME_EXPONENT = -0.1


def reliability(r: dict) -> tuple[bool, str]:
    """``(reliable, why not)`` of a successful result, from the spread of its repeats."""
    flags = timing_flags(r.get("wall_s") or [])
    return flags["reliable"], flags["unreliable"]


def series(results: list[dict]) -> dict[tuple, dict[int, dict]]:
    """``(variant, shape, causal, mode) -> {N: result}`` for the successful results."""
    out: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in results:
        c = r["config"]
        if r["status"] == "ok" and c["mode"] != "matmul":
            out[(c["variant"], c["shape"], c["causal"], c["mode"])][c["N"]] = r
    return dict(out)


def fit_exponent(points: dict[int, float], min_n: int) -> tuple[float, int] | None:
    """Least-squares slope of ``log y`` on ``log N`` over ``N >= min_n``: ``(slope, points)``."""
    xs = [(math.log(n), math.log(y)) for n, y in sorted(points.items()) if n >= min_n and y > 0]
    if len(xs) < 2:
        return None
    mx = sum(x for x, _ in xs) / len(xs)
    my = sum(y for _, y in xs) / len(xs)
    sxx = sum((x - mx) ** 2 for x, _ in xs)
    return sum((x - mx) * (y - my) for x, y in xs) / sxx, len(xs)


def fit_time_exponent(by_n: dict[int, dict], min_n: int) -> tuple[tuple[float, int] | None, str]:
    """Time exponent of one series from its reliable sizes only: ``(fit or None, note)``.

    ``note`` is empty for a clean fit, ``"without unreliable N=..."`` when sizes were left
    out, and starts with ``"unreliable"`` when the exponent is omitted (fewer than two
    reliable sizes, or a slope below :data:`MIN_TIME_EXPONENT`).
    """
    in_range = {n: r for n, r in by_n.items() if n >= min_n}
    if fit_exponent({n: r["median_s"] for n, r in in_range.items()}, min_n) is None:
        return None, ""
    bad = sorted(n for n, r in in_range.items() if not reliability(r)[0])
    fit = fit_exponent({n: r["median_s"] for n, r in in_range.items() if n not in bad}, min_n)
    sizes = ", ".join(map(str, bad))
    if fit is None:
        return None, f"unreliable: fewer than 2 sizes with reliable timings (unreliable N = {sizes})"
    if fit[0] < MIN_TIME_EXPONENT:
        return None, f"unreliable: fitted {fit[0]:.2f}, time falling as N grows (the load changed between sizes)"
    return fit, f"without unreliable N = {sizes}" if bad else ""


def exponents(results: list[dict], min_n: int) -> dict[tuple, dict]:
    """Fitted time and peak-memory exponents per series (``time_note``: see :func:`fit_time_exponent`)."""
    out = {}
    for key, by_n in series(results).items():
        time_fit, note = fit_time_exponent(by_n, min_n)
        out[key] = {
            "time": time_fit,
            "time_note": note,
            "memory": fit_exponent({n: r["peak_mb"] for n, r in by_n.items()}, min_n),
        }
    return out


def _get(results: list[dict[str, Any]], variant: str, shape: str, causal: bool, mode: str, N: int) -> dict[str, Any] | None:
    for r in results:
        c = r["config"]
        if (c["variant"], c["shape"], c["causal"], c["mode"], c["N"]) == (variant, shape, causal, mode, N):
            return r
    return None


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and r["status"] == "ok"


def targets(data: dict) -> list[dict]:
    """The issue's target ratios at the preset's ``target_n``, measured in this run.

    Each row: ``name, target, measured`` (median-based; ``measured_min`` from the fastest
    repeats, ``measured_cpu`` from process CPU time, which a busy machine inflates less),
    ``passed`` (None when not measurable, or when a time ratio rests on an unreliable
    timing, with the reason in ``note``). ``passed`` uses the medians of wall time.
    """
    results, preset = data["results"], data["preset"]
    flt, exact, favor = preset["headline"]
    shape = preset["shapes"][0]
    N = target_length(data)
    rows = []

    def ratio(name: str, target: float, num: dict[str, Any] | None, den: dict[str, Any] | None, larger_is_better: bool,
              field: str = "median_s", note: str = "") -> None:
        if not (_ok(num) and _ok(den)):
            missing = [r for r in (num, den) if not _ok(r)]
            why = "; ".join(f"{m['config']['variant']} {m['config']['mode']}: {m['status']} ({m['note']})" for m in missing if m) or "not in this run"
            rows.append({"name": name, "target": target, "measured": None, "passed": None, "note": why})
            return
        assert num is not None and den is not None  # both _ok
        value = num[field] / den[field]
        row = {"name": name, "target": target, "measured": value, "passed": value >= target if larger_is_better else value <= target, "note": note}
        shaky = [f"{r['config']['variant']}{' causal' if r['config']['causal'] else ''} {r['config']['mode']}: {reliability(r)[1]}"
                 for r in (num, den) if field == "median_s" and not reliability(r)[0]]
        if shaky:
            row.update(passed=None, note="; ".join(filter(None, [note, "unreliable timing: " + "; ".join(shaky)])))
        if field == "median_s":
            row["measured_min"] = num["min_s"] / den["min_s"]
            row["measured_cpu"] = statistics.median(num["cpu_s"]) / statistics.median(den["cpu_s"])
        rows.append(row)

    for mode, key in (("fwd", "fwd_speedup"), ("fwd+bwd", "fwdbwd_speedup")):
        ratio(f"{mode}: {exact} time / {flt} time (>=)", TARGETS[key], _get(results, exact, shape, False, mode, N), _get(results, flt, shape, False, mode, N), True)
        if rows[-1]["measured"] is None:
            # The named exact baseline did not run at this N: say what every other exact one gives.
            for other, spec in VARIANTS.items():
                if spec.exact and other != exact and spec.memory_order >= 2:
                    alt = _get(results, other, shape, False, mode, N)
                    if _ok(alt):
                        ratio(f"{mode}: {other} time / {flt} time (>=)", TARGETS[key], alt, _get(results, flt, shape, False, mode, N), True,
                              note=f"{exact} could not run at N = {N}; the cheapest materialised bias that did")
    ratio(f"fwd: {exact} peak memory / {flt} peak memory (>=)", TARGETS["fwd_memory_ratio"], _get(results, exact, shape, False, "fwd", N), _get(results, flt, shape, False, "fwd", N), True, field="peak_mb")
    for mode in ("fwd", "fwd+bwd"):
        ratio(f"{mode}: {flt} time / {favor} time (<=)", TARGETS["vs_favor"], _get(results, flt, shape, False, mode, N), _get(results, favor, shape, False, mode, N), False)
    for mode in ("fwd", "fwd+bwd"):
        ratio(f"{mode}: {flt} causal time / bidirectional time (<=)", TARGETS["causal_overhead"], _get(results, flt, shape, True, mode, N), _get(results, flt, shape, False, mode, N), False)
    fits = exponents(results, preset["fit_min_n"])
    for (variant, shp, causal, mode), fit in sorted(fits.items()):
        spec = VARIANTS[variant]
        if spec.kind == "op" or spec.memory_order >= 2 or spec.exact or shp != shape or fit["memory"] is None:
            continue
        slope, npts = fit["memory"]
        rows.append({
            "name": f"peak-memory exponent, {variant} {'causal' if causal else 'bidir'} {mode} (<=)", "target": TARGETS["memory_exponent"],
            "measured": slope, "passed": slope <= TARGETS["memory_exponent"], "note": f"fit over {npts} sizes, N >= {preset['fit_min_n']}",
        })
    return rows


def target_length(data: dict) -> int:
    """The preset's ``target_n``, or the largest N of the run when that was not measured."""
    Ns = {r["config"]["N"] for r in data["results"] if r["config"]["shape"] == data["preset"]["shapes"][0]}
    return data["preset"]["target_n"] if data["preset"]["target_n"] in Ns or not Ns else max(Ns)


def kronecker_model(data: dict) -> list[dict]:
    """Op-level Kronecker FLT against its cost model and this machine's matmul throughput.

    Model FLOPs (multiply-adds counted as 2): the key-side state and the query-side read
    each contract ``N x 2R x m x (Dv + 1)`` per batch and head (the extra column is the
    denominator), ``4 B H N 2R m (Dv+1)``; causal adds the in-chunk products
    ``2 B H N C (m + 2R + Dv + 1)`` with ``C`` the chunk size (128). The fraction is of the
    float32 matmul ceiling: the best throughput of the matmuls timed in the same process
    just before and just after the run, and of the runner's probes. A run whose repeats
    spread too widely, or that exceeds the ceiling, is unreliable and gets no fraction.
    """
    from flt.ops.linear import causal_chunk_size

    probes = [p for p in (data.get("matmul"), data.get("matmul_kronecker")) if p and p["status"] == "ok"]
    probe_best = max((p.get("gflops_best") or p["gflops"] for p in probes), default=None)
    rows = []
    for r in data["results"]:
        c = r["config"]
        spec = VARIANTS[c["variant"]]
        if spec.kind != "op" or r["status"] != "ok":
            continue
        s = SHAPES[c["shape"]]
        m, R = spec.kwargs["num_features"], spec.kwargs["num_frequencies"]
        flops = 4 * s.B * s.H * c["N"] * 2 * R * m * (s.D + 1)
        if c["causal"]:
            flops += 2 * s.B * s.H * c["N"] * causal_chunk_size(m, 2 * R, s.D) * (m + 2 * R + s.D + 1)
        achieved = flops / r["median_s"] / 1e9
        ceiling = max((g for g in (r.get("ceiling_gflops"), probe_best) if g), default=None)
        fraction = None if ceiling is None else achieved / ceiling
        ok, why = reliability(r)
        if ok and fraction is not None and fraction > 1:
            ok, why = False, f"above the matmul ceiling ({ceiling:.3g} GFLOP/s), which is impossible: the machine's load changed"
        rows.append({
            "m": m, "R": R, "N": c["N"], "causal": c["causal"], "mode": c["mode"], "median_s": r["median_s"],
            "model_gflop": flops / 1e9, "achieved_gflops": achieved, "ceiling_gflops": ceiling, "fraction_of_matmul": fraction,
            "reliable": ok, "unreliable": why,
        })
    return rows


def floor_rows(data: dict, N: int | None = None) -> list[dict]:
    """Every successful layer or op run (at ``N`` when given) against its FLOP floor.

    ``x_floor`` = median time / (model FLOPs / matmul throughput), the throughput being the
    best of the matmuls timed in the same process around the run (or the runner's probe
    for results saved before every run timed its own). ``None`` where the variant has no
    model, or the timing is unreliable. Also ``bytes_per_token`` (peak memory / (B N)),
    ``first_call_s`` (the compile time of a ``+compile`` variant) and ``accuracy`` (a
    ``+bf16`` variant's relative error against float64).
    """
    probe = data.get("matmul") or {}
    probe_best = probe.get("gflops_best") if probe.get("status") == "ok" else None
    rows = []
    for r in data["results"]:
        c = r["config"]
        if r["status"] != "ok" or c["mode"] == "matmul" or (N is not None and c["N"] != N):
            continue
        flops = model_flops(c["variant"], c["shape"], c["N"], c["mode"], c["causal"])
        ceiling = r.get("ceiling_gflops") or probe_best
        ok, why = reliability(r)
        ratio = floor_ratio(r["median_s"], flops, ceiling)
        # Below 1 a float32 run beat its own products at the float32 ceiling: the load changed.
        # An autocast (bf16) run is held to the float32 floor and may well beat it.
        if ok and ratio is not None and ratio < 1 and not VARIANTS[c["variant"]].autocast:
            ok, why = False, "faster than its floor at the measured matmul ceiling: the machine's load changed"
        s = SHAPES[c["shape"]]
        rows.append({
            "variant": c["variant"], "shape": c["shape"], "N": c["N"], "mode": c["mode"], "causal": c["causal"],
            "median_s": r["median_s"], "model_gflop": None if flops is None else flops / 1e9, "ceiling_gflops": ceiling,
            "x_floor": ratio if ok else None, "x_floor_raw": ratio, "reliable": ok, "unreliable": why,
            "bytes_per_token": r["peak_mb"] * 2**20 / (s.B * c["N"]),
            "first_call_s": r.get("first_call_s") if VARIANTS[c["variant"]].compile else None,
            "accuracy": r.get("accuracy"),
        })
    return rows


def floor_targets(data: dict) -> list[dict]:
    """Issue 12's targets at the preset's ``target_n``: x floor of the compiled logit coupling,
    its bf16 path and the multiplicative path (bidirectional), and causal / bidirectional time
    of every variant of the mechanism of the preset's headline (its first, FLT)."""
    N = target_length(data)
    shape = data["preset"]["shapes"][0]
    rows = []
    by_key = {(f["variant"], f["causal"], f["mode"]): f for f in floor_rows(data, N) if f["shape"] == shape}
    for variant, target in FLOOR_TARGETS.items():
        for mode in ("fwd", "fwd+bwd"):
            f = by_key.get((variant, False, mode))
            if f is None:
                continue
            measured = f["x_floor"]
            rows.append({"name": f"{mode}: {variant} x floor (<=)", "target": target, "measured": measured,
                         "passed": None if measured is None else measured <= target, "note": f["unreliable"]})
    headline = VARIANTS[data["preset"]["headline"][0]].mechanism
    for variant in sorted({k[0] for k in by_key if VARIANTS[k[0]].mechanism == headline}):
        for mode in ("fwd", "fwd+bwd"):
            causal, bidir = _get(data["results"], variant, shape, True, mode, N), _get(data["results"], variant, shape, False, mode, N)
            if not (_ok(causal) and _ok(bidir)):
                continue
            assert causal is not None and bidir is not None  # both _ok
            shaky = [reliability(r)[1] for r in (causal, bidir) if not reliability(r)[0]]
            value = causal["median_s"] / bidir["median_s"]
            rows.append({"name": f"{mode}: {variant} causal time / bidirectional time (<=)", "target": CAUSAL_OVER_BIDIRECTIONAL,
                         "measured": value, "passed": None if shaky else value <= CAUSAL_OVER_BIDIRECTIONAL, "note": "; ".join(shaky)})
    return rows


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"] + (": memory" if r["note"].startswith("memory") else ": time" if r["note"].startswith("time") else "")
    spread = (r["q3_s"] - r["q1_s"]) / r["median_s"] * 100
    flag = "" if reliability(r)[0] else " (unreliable)"
    return f"{_fmt_time(r['median_s'])} ±{spread:.0f}% / {r['peak_mb']:.0f} MB{flag}"


#: How the timed calls allocated memory (``flt bench speed --allocator``).
_ALLOCATOR_NOTES = {
    "keep": "Timed with freed memory kept for reuse (`flt.keep_freed_memory`, `--allocator keep`).",
    "default": "Timed with glibc's default allocator thresholds (`--allocator default`): large temporaries are mapped afresh each call.",
}


def markdown(data: dict, command: str = "") -> str:
    """The whole report as markdown: machine, targets, tables, exponents, Kronecker model, notes."""
    m, preset, results = data["machine"], data["preset"], data["results"]
    lines = ["# flt bench speed", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    load = lambda t: ", ".join(f"{x:.2f}" for x in t)  # noqa: E731
    lines += [
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, {m['threads']} threads, {m['mem_total_gb']} GB; {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}; commit {m['commit'][:12]}{' (dirty)' if m['dirty'] else ''}; {m['date']}. "
        f"Load average at start {load(m['loadavg_start'])}, at end {load(m.get('loadavg_end', []))}. "
        + _ALLOCATOR_NOTES.get(m.get("allocator", "default"), ""),
    ]
    mm = data["matmul"]
    if mm["status"] == "ok":
        lines.append(f"float32 matmul ({preset['matmul_n']}^3): {mm['gflops']:.1f} GFLOP/s median, {mm['gflops_best']:.1f} best.")
    mk = data.get("matmul_kronecker")
    if mk and mk["status"] == "ok":
        lines.append(f"Again before the Kronecker runs: {mk['gflops']:.1f} GFLOP/s median, {mk['gflops_best']:.1f} best.")
    peers = m.get("peers") or {}
    if peers:
        lines.append("Peers: " + "; ".join(f"{k} {v}" for k, v in peers.items()) + ".")
    lines += [
        "",
        "Layer level: `x [B, N, H*D] -> [B, N, H*D]` including the projections; float32; `fwd` under no_grad, "
        "`fwd+bwd` = forward and backward to the input and the parameters. Cells: median wall time ±IQR/median "
        "over repeats / peak RSS above the process's baseline (fresh process per cell). Every timed cell passed a "
        "float64 fast-path-vs-reference check first.",
        "",
    ]
    rows = targets(data)
    if rows:
        shape = SHAPES[preset["shapes"][0]]
        lines += [f"## Targets at N = {target_length(data)} (B={shape.B}, H={shape.H}, D={shape.D}; ratios from this run)", ""]
        lines += ["| target | required | measured (median wall) | fastest repeats | CPU time | met | note |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            meas = "—" if r["measured"] is None else f"{r['measured']:.3g}"
            extra = [f"{r[k]:.3g}" if r.get(k) is not None else "" for k in ("measured_min", "measured_cpu")]
            met = "n/a" if r["passed"] is None else ("yes" if r["passed"] else "**no**")
            lines.append(f"| {r['name']} | {r['target']:g} | {meas} | {' | '.join(extra)} | {met} | {r['note']} |")
        lines.append("")
    fits = exponents(results, preset["fit_min_n"])
    for shape_name in preset["shapes"]:
        s = SHAPES[shape_name]
        for mode in ("fwd", "fwd+bwd"):
            keys = [k for k in _series_keys(results) if k[1] == shape_name and k[3] == mode and VARIANTS[k[0]].kind != "op"]
            if not keys:
                continue
            Ns = sorted({r["config"]["N"] for r in results if r["config"]["shape"] == shape_name and r["config"]["mode"] == mode})
            lines += [f"## {mode}, shape {shape_name} (B={s.B}, H={s.H}, D={s.D})", ""]
            lines.append("| variant | causal | " + " | ".join(f"N={n}" for n in Ns) + " | time exp. | memory exp. |")
            lines.append("|---|---|" + "---|" * len(Ns) + "---|---|")
            for key in keys:
                variant, _, causal, _ = key
                cells = [_cell(_get(results, variant, shape_name, causal, mode, n)) for n in Ns]
                fit = fits.get(key, {"time": None, "memory": None, "time_note": ""})
                fmt = lambda f: "" if f is None else f"{f[0]:.2f}"  # noqa: E731
                time_exp = "unreliable" if fit["time_note"].startswith("unreliable") else fmt(fit["time"]) + ("*" if fit["time_note"] else "")
                lines.append(f"| {variant} | {'yes' if causal else 'no'} | " + " | ".join(cells) + f" | {time_exp} | {fmt(fit['memory'])} |")
            lines.append("")
    lines.append(f"Exponents: least-squares slope of log(median time) and log(peak memory) on log N over N >= {preset['fit_min_n']}. "
                 f"Time exponents use only sizes with reliable timings (*: some left out; 'unreliable': omitted, see below).")
    lines.append("")
    fl = [f for f in floor_rows(data, target_length(data)) if f["model_gflop"] is not None or f["accuracy"] or f["first_call_s"]]
    if fl:
        lines += [f"## Against the FLOP floor at N = {target_length(data)}", "",
                  "x floor = median time / (model FLOPs / float32 matmul FLOP/s measured in the same process, best of the "
                  "matmuls just before and after the run); the model counts matrix products only (`flt.bench.flops`). "
                  "Bytes per token: peak memory / (B N). First call: the compiling call of a `+compile` variant. "
                  "bf16 error: max |bf16 - float64| / max |float64| of the output (and input gradient) at this size.", ""]
        tr = floor_targets(data)
        if tr:
            lines += ["| target | required | measured | met | note |", "|---|---|---|---|---|"]
            for r in tr:
                meas = "—" if r["measured"] is None else f"{r['measured']:.3g}"
                met = "n/a" if r["passed"] is None else ("yes" if r["passed"] else "**no**")
                lines.append(f"| {r['name']} | {r['target']:g} | {meas} | {met} | {r['note']} |")
            lines.append("")
        lines += ["| variant | shape | mode | causal | time | model GFLOP | x floor | bytes/token | first call | bf16 error |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for f in fl:
            gflop = "" if f["model_gflop"] is None else f"{f['model_gflop']:.3g}"
            xf = f"{f['x_floor']:.2f}" if f["x_floor"] is not None else ("" if f["x_floor_raw"] is None else f"unreliable ({f['x_floor_raw']:.2f})")
            first = "" if f["first_call_s"] is None else _fmt_time(f["first_call_s"])
            acc = f["accuracy"] or {}
            err = "" if not acc else f"{acc['output_rel_error']:.2g}" + (f" / grad {acc['grad_rel_error']:.2g}" if "grad_rel_error" in acc else "")
            lines.append(f"| {f['variant']} | {f['shape']} | {f['mode']} | {'yes' if f['causal'] else 'no'} | {_fmt_time(f['median_s'])} | "
                         f"{gflop} | {xf} | {f['bytes_per_token']:.3g} | {first} | {err} |")
        lines.append("")
    kron = kronecker_model(data)
    if kron:
        lines += ["## Multiplicative (Kronecker) coupling against its cost model (op level, `flt_attention`)", ""]
        lines += [(kronecker_model.__doc__ or "").split("\n\n")[1].replace("\n    ", " ").strip(), ""]
        lines += ["| m | R | N | causal | time | model GFLOP | achieved GFLOP/s | fraction of matmul |", "|---|---|---|---|---|---|---|---|"]
        for k in kron:
            if not k["reliable"]:
                achieved, frac = "unreliable", "unreliable: " + k["unreliable"]
            else:
                achieved = f"{k['achieved_gflops']:.3g}"
                frac = "" if k["fraction_of_matmul"] is None else f"{k['fraction_of_matmul'] * 100:.2g}% of {k['ceiling_gflops']:.3g}"
            lines.append(f"| {k['m']} | {k['R']} | {k['N']} | {'yes' if k['causal'] else 'no'} | {_fmt_time(k['median_s'])} | {k['model_gflop']:.3g} | {achieved} | {frac} |")
        lines.append("")
    shaky = [r for r in results if r["status"] == "ok" and r["config"]["mode"] != "matmul" and not reliability(r)[0]]
    omitted = [(key, fit["time_note"]) for key, fit in sorted(fits.items()) if fit["time_note"]]
    if shaky or omitted:
        lines += ["## Unreliable timings", "", "Measured while the machine was too busy for the figures to mean much; rerun on a quiet machine.", ""]
        for r in shaky:
            c = r["config"]
            lines.append(f"- {c['variant']} {c['shape']} N={c['N']} {c['mode']} {'causal' if c['causal'] else 'bidirectional'}: {reliability(r)[1]}")
        for (variant, shp, causal, mode), note in omitted:
            lines.append(f"- time exponent of {variant} {shp} {mode} {'causal' if causal else 'bidirectional'}: {note}")
        lines.append("")
    notes = [r for r in results if r["status"] != "ok"]
    if notes:
        lines += ["## Not measured", ""]
        for r in notes:
            c = r["config"]
            lines.append(f"- {c['variant']} {c['shape']} N={c['N']} {c['mode']} {'causal' if c['causal'] else 'bidirectional'}: {r['status']}: {r['note']}")
        lines.append("")
    described = sorted({r["config"]["variant"] for r in results if r.get("variant_note")})
    if described:
        lines += ["## Variants", ""] + [f"- `{v}`: {VARIANTS[v].note}" for v in described if VARIANTS[v].note] + [""]
    return "\n".join(lines)


def _series_keys(results: list[dict[str, Any]]) -> list[tuple[str, str, bool, str]]:
    seen = []
    for r in results:
        c = r["config"]
        key = (c["variant"], c["shape"], c["causal"], c["mode"])
        if c["mode"] != "matmul" and key not in seen:
            seen.append(key)
    return seen


def plot(data: dict, path: str | os.PathLike) -> None:
    """Log-log time and peak memory against N, one line per series, fitted exponents in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preset = data["preset"]
    shape = preset["shapes"][0]
    fits = exponents(data["results"], preset["fit_min_n"])
    modes = ("fwd", "fwd+bwd")
    names = sorted({k[0] for k in series(data["results"])})
    colour = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}  # one colour per variant
    fig, axes = plt.subplots(2, len(modes), figsize=(7 * len(modes), 10), squeeze=False)
    for col, mode in enumerate(modes):
        for key, by_n in series(data["results"]).items():
            variant, shp, causal, md = key
            if shp != shape or md != mode or VARIANTS[variant].kind == "op":
                continue
            Ns = sorted(by_n)
            label = f"{variant}{' causal' if causal else ''}"
            style = "--" if causal else "-"
            shaky = [n for n in Ns if not reliability(by_n[n])[0]]
            for row, (field, what) in enumerate((("median_s", "time"), ("peak_mb", "memory"))):
                fit = fits[key][what]
                tag = f" ({fit[0]:.2f}{'*' if what == 'time' and fits[key]['time_note'] else ''})" if fit else ""
                if what == "time" and fits[key]["time_note"].startswith("unreliable"):
                    tag = " (unreliable)"
                axes[row][col].loglog(Ns, [by_n[n][field] for n in Ns], style, color=colour[variant], marker="o", ms=3, label=label + tag)
                if shaky and what == "time":  # unreliable timings: a cross over the point
                    axes[row][col].plot(shaky, [by_n[n][field] for n in shaky], "x", color="red", ms=8, zorder=4)
        s = SHAPES[shape]
        axes[0][col].set_title(f"{mode}: median time (B={s.B}, H={s.H}, D={s.D})")
        axes[1][col].set_title(f"{mode}: peak memory above baseline")
        axes[0][col].set_ylabel("median time per call (s)")
        axes[1][col].set_ylabel("peak memory (MB)")
        for row in (0, 1):
            axes[row][col].set_xlabel("sequence length N (tokens)")
            axes[row][col].grid(True, which="both", alpha=0.3)
            if axes[row][col].get_legend_handles_labels()[0]:  # a mode may have no series
                axes[row][col].legend(fontsize=6, title="fitted exponent in (); red x: unreliable timing", title_fontsize=6)
    fig.tight_layout()
    atomic_savefig(fig, os.fspath(path), dpi=110)
    plt.close(fig)
