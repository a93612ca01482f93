"""What every launcher of :mod:`flt.ops.triton` shares: whether triton is there and which
devices its kernels run on, how many segments a sequence is cut into and how their key
states combine, and which tile fits the GPU's shared memory.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

import torch

#: Default chunk length of the kernels (tokens per step of a program; a power of two >= 16).
TRITON_CHUNK = 64


def triton_available() -> tuple[bool, str]:
    """``(True, "")`` when the triton package can be imported, else ``(False, how to get it)``."""
    if importlib.util.find_spec("triton") is None:
        from flt._extras import install_hint

        return False, f"the triton package is not installed ({install_hint('triton')})"
    return True, ""


def _kernels():
    ok, reason = triton_available()
    if not ok:
        raise ModuleNotFoundError(f"backend='triton' needs Triton: {reason}", name="triton")
    from flt.ops.triton import kernels

    return kernels


def interpreted() -> bool:
    """Whether the kernels were built for triton's CPU interpreter (``TRITON_INTERPRET=1``
    was set when :mod:`flt.ops.triton.kernels` was first imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels().favor_attention_kernel, InterpretedFunction)


def check_device(device: torch.device, backend: str = "triton") -> None:
    """Refuse devices the kernels cannot run on (``ValueError``, naming ``backend``, the
    layers' option that chose them): CUDA always works; CPU tensors only under triton's
    interpreter (slow; for tests)."""
    device = torch.device(device)
    if device.type == "cuda":
        _kernels()
        return
    if device.type == "cpu" and interpreted():
        return
    raise ValueError(
        f"backend={backend!r} runs Triton kernels on CUDA tensors; these are on {device.type}. Use backend='torch' "
        "here, or, to test the kernels on CPU, set TRITON_INTERPRET=1 in the environment before flt imports "
        "them (triton's interpreter: slow)."
    )


def segment_count(programs: int, n: int, chunk: int, device: torch.device) -> int:
    """How many segments to cut the sequence into: enough programs for two per
    multiprocessor of the GPU (``programs`` per segment), at most one per 4 chunks."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(math.ceil(target / programs), n // (4 * chunk)))


#: The tile that fitted, per kernel configuration and list of candidates (:func:`launch_fitted`).
_FITTED: dict[tuple, tuple[int, int, int | None]] = {}


def tile_candidates(chunk: int, bv: int, bm: int, device: torch.device) -> list[tuple[int, int, int | None]]:
    """Tiles ``(tokens per step, value columns per program, pipeline stages)`` to try in
    order, largest first. A program keeps the ``[m, BV]`` state, the projection and
    ``[BC, m]`` feature tiles on chip: on an H200 (232,448 bytes of shared memory a block)
    the default tile failed for FLT's logit coupling at ``m = 256`` (720,896 bytes in
    float64) and, in float64, at ``m = 64`` too (the multiplicative coupling 263,168, the
    band 466,944). The smaller tiles give up reuse of loaded rows, not results. Off CUDA
    (the interpreter) only the given tile."""
    if device.type != "cuda":
        return [(chunk, bv, None)]
    small: list[tuple[int, int, int | None]] = [(16, min(bv, 32), 1), (16, min(bv, 16), 1)]
    tiles = ([(chunk, bv, 3)] if bm <= 64 else []) + small
    return list(dict.fromkeys(tiles))  # without repeats (bv <= 16 makes the two small ones one)


def launch_fitted(key: tuple, candidates: list[tuple[int, int, int | None]], attempt: Callable[[int, int, int | None], None],
                  hint: str = "") -> None:
    """Run ``attempt(chunk, bv, stages)`` with the first candidate tile that fits the GPU's
    shared memory (remembered per ``key`` and candidate list); a tile that does not fit
    fails before any work (triton's ``OutOfResources`` at launch, before the kernel runs;
    an attempt's earlier launches write only its own segment states), so trying the next
    one is safe. ``hint``: what else the caller can change, for the error."""
    from triton.runtime.errors import OutOfResources

    remembered = _FITTED.get((key, tuple(candidates)))
    tiles = [remembered] if remembered is not None else candidates
    failures = []
    for tile in tiles:
        try:
            attempt(*tile)
        except OutOfResources as err:
            failures.append(f"{tile}: {err}")
            continue
        _FITTED[(key, tuple(candidates))] = tile
        return
    raise ValueError(f"no tile of the Triton kernel fits this GPU's shared memory; tried (tokens, value columns, stages) "
                     f"{'; '.join(failures)}. Use fewer features (num_features){hint}, float32 instead of float64, or backend='torch'.")


#: The level of an empty state (:data:`flt.ops.triton.kernels._NO_KEY`).
NO_KEY = -1.0e30


def combine_segments(states: torch.Tensor, levels: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The state each segment starts from, from the segments' own key states ``[..., S, m, Dv+1]``
    relative to their levels ``[..., S]``: the keys of the earlier segments (causal) or of all
    segments, relative to the largest level among them; every factor ``exp(l - L) <= 1``."""
    if not causal:
        top = levels.amax(dim=-1, keepdim=True)
        total = (states * torch.exp(levels - top)[..., None, None]).sum(dim=-3, keepdim=True)
        return total.expand_as(states), top.expand_as(levels)
    S = levels.shape[-1]
    before = torch.ones(S, S, dtype=torch.bool, device=levels.device).tril(-1)  # segment s' < s
    seen = levels.unsqueeze(-2).masked_fill(~before, -float("inf"))  # [..., S, S']
    start = seen.amax(dim=-1)  # level of the keys before segment s (-inf: none)
    start = torch.where(torch.isinf(start), torch.full_like(start, NO_KEY), start)
    weights = torch.exp(seen - start.unsqueeze(-1))  # 0 where s' >= s
    carried = torch.einsum("...st,...tmd->...smd", weights, states)
    return carried, start

