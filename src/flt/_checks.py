"""Argument validation shared by every public entry point.

Each helper raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape,
non-finite values, bad option) with a message that names the argument and says what
was expected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch


def shown(value: object, width: int = 80) -> str:
    """``repr(value)`` on one line, cut to about ``width`` characters: what an error message
    quotes of a value it refuses (a tensor's or an array's repr spans lines)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def check_tensor(name: str, x: object, *, ndim: int | Sequence[int] | None = None, layout: str = "") -> None:
    """Require a floating-point tensor, optionally of a given rank."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in allowed:
            want = " or ".join(str(n) for n in allowed)
            shape_hint = f" {layout}" if layout else ""
            raise ValueError(f"{name} must have rank {want}{shape_hint}, got shape {tuple(x.shape)}")


def compiling() -> bool:
    """True while ``torch.compile`` traces the caller: data-dependent checks then become
    in-graph assertions instead of host synchronisations (which would break the graph)."""
    return torch.compiler.is_compiling()


def _checked(x: torch.Tensor, tag: str) -> bool:
    """Whether ``x`` (this very tensor, unmodified since) already passed check ``tag``."""
    marks = getattr(x, "_flt_checked", None)
    if not marks or tag not in marks:
        return False
    try:
        return marks[tag] == x._version
    except RuntimeError:  # inference tensors have no version counter
        return False


def _remember(x: torch.Tensor, tag: str) -> None:
    try:
        version = x._version
    except RuntimeError:
        return
    marks = getattr(x, "_flt_checked", None)
    if marks is None:
        marks = {}
        try:
            x._flt_checked = marks  # type: ignore[attr-defined]  # a private mark on the tensor object
        except AttributeError:  # tensor subclasses without a __dict__
            return
    marks[tag] = version


def check_values(name: str, x: torch.Tensor, ok: Callable[[torch.Tensor], torch.Tensor], message: str, *, tag: str, error: type[Exception] = ValueError) -> None:
    """Require ``ok(x)`` (a bool tensor) to hold everywhere; raise ``error(message)``.

    A data-dependent check costs a host synchronisation, so it runs once per tensor: a
    tensor that passed (the same object, not modified in place since) is not checked
    again, which is what a model passing one ``pos`` to all its layers needs. Under
    ``torch.compile`` the check is an in-graph assertion (``torch._assert_async``:
    a ``RuntimeError`` with the same message), so it adds no graph break.
    """
    if compiling():
        torch._assert_async(ok(x).all(), message)
        return
    if _checked(x, tag):
        return
    if not bool(ok(x).all()):
        raise error(message)
    _remember(x, tag)


def check_finite(name: str, x: torch.Tensor) -> None:
    """Reject NaN and infinite entries (positions, masks); see :func:`check_values`."""
    if compiling():
        torch._assert_async(torch.isfinite(x).all(), f"{name} contains non-finite values (NaN or inf)")
        return
    if _checked(x, "finite"):
        return
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} non-finite value(s) (NaN or inf)")
    _remember(x, "finite")


def check_dim(name: str, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Require ``x.shape[dim] == expected``."""
    if x.shape[dim] != expected:
        raise ValueError(
            f"{name} has {what} = {x.shape[dim]} (dim {dim} of shape {tuple(x.shape)}), expected {expected}"
        )


def check_broadcast(name: str, x: torch.Tensor, target: Sequence[int], layout: str) -> None:
    """Require ``x`` to broadcast to ``target``."""
    try:
        torch.broadcast_shapes(tuple(x.shape), tuple(target))
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} does not broadcast to {layout} = {tuple(target)}"
        ) from None
    if torch.broadcast_shapes(tuple(x.shape), tuple(target)) != tuple(target):
        raise ValueError(f"{name} of shape {tuple(x.shape)} would enlarge {layout} = {tuple(target)}")


def check_choice(name: str, value: object, choices: Iterable) -> None:
    """Require ``value`` to be one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {shown(value)}")


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {shown(value)}")


def check_nonnegative_int(name: str, value: object, meaning: str = "") -> None:
    """``value`` is an int ``>= 0`` (not a bool); ``meaning`` goes in the message, in brackets."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a nonnegative int{f' ({meaning})' if meaning else ''}, got {shown(value)}")


def check_positive_float(name: str, value: object) -> float:
    """Require a finite real number ``> 0`` and return it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {shown(value)}")
    return float(value)


def check_nonnegative_float(name: str, value: object) -> float:
    """Require a finite real number ``>= 0`` and return it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {shown(value)}")
    return float(value)


def check_bool(name: str, value: object) -> None:
    """Require a bool (not an int or a string that reads as one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def integer_positions(name: str, pos: torch.Tensor) -> torch.Tensor:
    """Return integer-valued positions as ``torch.long``.

    Accepts an integer tensor or a floating tensor whose entries are all whole numbers;
    anything else (bool, fractional or non-finite values) raises.
    """
    if not isinstance(pos, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(pos).__name__}")
    if pos.dtype == torch.bool or pos.is_complex():
        raise TypeError(f"{name} must have an integer or floating-point dtype, got {pos.dtype}")
    if pos.is_floating_point():
        check_finite(name, pos)
        check_values(name, pos, lambda p: p == p.round(), f"{name} must hold integer-valued positions, got fractional values", tag="integer")
    return pos.long()


def check_positions(name: str, pos: torch.Tensor, *, batch: int, length: int, pos_dim: int | None) -> torch.Tensor:
    """Validate positions ``[B, N, P]`` or ``[N, P]`` and return them as ``[B or 1, N, P]``."""
    check_tensor(name, pos, ndim=(2, 3), layout="[B, N, P] or [N, P]")
    if pos.ndim == 2:
        pos = pos.unsqueeze(0)
    if pos.shape[0] not in (1, batch):
        raise ValueError(f"{name} has batch size {pos.shape[0]}, expected 1 or {batch} (shape {tuple(pos.shape)})")
    if pos.shape[1] != length:
        raise ValueError(f"{name} has {pos.shape[1]} positions but the input has N = {length} tokens")
    if pos_dim is not None and pos.shape[2] != pos_dim:
        raise ValueError(f"{name} has position dimension P = {pos.shape[2]}, expected P = {pos_dim}")
    check_finite(name, pos)
    return pos


def check_state_tensors(kind: str, state: object, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
    """Require the decoding state ``state`` (a ``kind``) to hold, for each name of
    ``shapes``, a tensor of that shape on ``device``: a state from another layer, another
    batch or another device is refused by name instead of failing in a broadcast."""
    for name, shape in shapes.items():
        t = getattr(state, name, None)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state.{name} must be a tensor (state must be the {kind} of the previous step), got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape) or t.device != device:
            raise ValueError(f"state is not a {kind} of this layer for this batch: its {name} has shape {tuple(t.shape)} "
                             f"on {t.device}, this step needs {tuple(shape)} on {device} (a state of another layer or batch?)")


def check_state_position(kind: str, state: object) -> int:
    """``state.position``, required to be an int ``>= 0`` (the tokens a ``kind`` has seen)."""
    position = getattr(state, "position", None)
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise TypeError(f"state must be the {kind} of the previous step (or None), got {type(state).__name__}"
                        + (f" with position {shown(position)}" if hasattr(state, "position") else ""))
    return position
