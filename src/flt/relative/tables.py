"""Learned tables of relative biases over 1-D integer offsets (the logit coupling of
docs/math.md section 1): T5 buckets (Raffel et al. 2020) and clipped offsets (Shaw et al.
2018), as :class:`RelativeBiasTable` and the registered terms ``RELATIVE["t5"]`` and
``RELATIVE["clipped"]``.

Every bias has the layout ``[B, H, N, Nk]`` and is added to the attention logits
``q_i.k_j / sqrt(D)``. Offsets are ``key - query`` (``r_j - r_i``), T5's convention:
negative offsets are keys in the past.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from torch import nn

from flt._checks import (
    check_bool,
    check_choice,
    check_positive_float,
    check_positive_int,
    integer_positions,
)
from flt.relative.base import RelativeTerm


def t5_relative_buckets(
    offsets: torch.Tensor,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """T5 bucket index (``torch.long``, same shape) of integer offsets ``key - query``.

    With ``bidirectional=True`` half the buckets are for offsets ``<= 0`` (keys at or
    before the query) and half, shifted by ``num_buckets/2``, for offsets ``> 0``; with
    ``bidirectional=False`` all buckets serve distances into the past and every future
    offset shares bucket 0 with offset 0 (a causal mask removes them anyway).

    Within one half of ``n`` buckets, a distance ``d >= 0`` gets bucket ``d`` when
    ``d < n/2`` (exact), else ``n/2 + floor(log(d / (n/2)) / log(max_distance / (n/2)) * (n - n/2))``
    capped at ``n - 1`` (log-spaced up to ``max_distance``, one bucket beyond).

    The log expression is evaluated by comparing ``d`` with the integer thresholds where
    it changes value, computed once in Python float64, so the result is exact at the
    boundaries (e.g. ``d = 16, 32`` with the defaults), device-independent and needs no
    float64 on the device. Implementations that evaluate the log in float32 (T5 and
    x-transformers do) can differ exactly at such boundary distances.
    """
    n = integer_positions("offsets", offsets)
    check_positive_int("num_buckets", num_buckets)
    check_positive_int("max_distance", max_distance)
    check_bool("bidirectional", bidirectional)
    half = num_buckets
    if bidirectional:
        if num_buckets % 2 != 0:
            raise ValueError(f"num_buckets must be even when bidirectional, got {num_buckets}")
        half = num_buckets // 2
        bucket = (n > 0).long() * half
        dist = n.abs()
    else:
        bucket = torch.zeros_like(n)
        dist = (-n).clamp(min=0)
    exact = half // 2
    if exact < 1:
        raise ValueError(f"num_buckets = {num_buckets} leaves no exact buckets; use at least {4 if bidirectional else 2}")
    if max_distance <= exact:
        raise ValueError(f"max_distance = {max_distance} must exceed the {exact} exact buckets")
    thresholds = _log_bucket_thresholds(exact, half - exact, max_distance)
    large = exact + torch.bucketize(dist, torch.tensor(thresholds, dtype=torch.long, device=n.device), right=True)
    return bucket + torch.where(dist < exact, dist, large)


def _log_bucket_thresholds(exact: int, num_log: int, max_distance: int) -> list[int]:
    """Smallest integer distances reaching log bucket ``exact + k``, ``k = 1 .. num_log - 1``."""
    ratio = max_distance / exact
    out = []
    for k in range(1, num_log):
        t = exact * ratio ** (k / num_log)
        # Snap values that are integers up to rounding (e.g. 8 * 16^(1/4) = 16).
        if abs(t - round(t)) <= 1e-9 * t:
            t = round(t)
        out.append(math.ceil(t))
    return out


def clipped_relative_indices(offsets: torch.Tensor, *, max_distance: int, bidirectional: bool) -> torch.Tensor:
    """Table index of integer offsets ``key - query`` clipped to ``max_distance`` (Shaw et al.).

    Bidirectional: ``clip(offset, -M, M) + M`` in ``[0, 2M]``. Unidirectional:
    ``clip(offset, -M, 0) + M`` in ``[0, M]`` (future offsets share offset 0's entry).
    """
    n = integer_positions("offsets", offsets)
    check_positive_int("max_distance", max_distance)
    check_bool("bidirectional", bidirectional)
    upper = max_distance if bidirectional else 0
    return n.clamp(min=-max_distance, max=upper) + max_distance


#: Default output scale of :class:`RelativeBiasTable` (see its docstring): with it the T5
#: baseline of the LM smoke preset run for 600 steps reached 6.9 ppl instead of 12.2.
DEFAULT_TABLE_SCALE = 16.0


class RelativeBiasTable(RelativeTerm):
    """Learned per-head bias of 1-D integer offsets: ``[B, H, N, Nk]``.

    Modes:
        ``"t5"``: one entry per :func:`t5_relative_buckets` bucket (``num_buckets``
            entries, default 32).
        ``"clipped"``: one entry per offset in ``[-max_distance, max_distance]``
            (:func:`clipped_relative_indices`); ``num_buckets`` must be left unset.

    Parameterisation: ``bias[h] = scale[h] * table[:, h]``. The table starts at zero, so a
    fresh layer adds no bias (plain attention); ``scale`` (one per head) starts at
    ``table_scale``. The scale is there for the learning rate, not for expressiveness:
    under Adam(W) every entry of ``table`` moves by about ``lr`` per update whatever its
    gradient, so the bias moves by about ``scale * lr``; under plain SGD the table's
    gradient is ``scale`` times the bias's and the bias moves ``scale^2`` times as far.
    With ``table_scale = 1`` (the bare table of T5 and Shaw et al.) and ``lr = 3e-3`` a
    bias of 2 logits takes hundreds of updates, and the short presets' T5 baseline stayed
    nearly position-blind: on the LM smoke preset run for 600 steps, ``table_scale = 16``
    (the default, :data:`DEFAULT_TABLE_SCALE`) took it from 12.17 to 6.88 ppl (fixed
    scale) or 6.94 (learned from 16).
    ``learn_scale=True`` (default) makes ``scale`` a parameter too (its gradient is
    ``sum(grad_bias * table)``, zero until the table has moved); ``learn_scale=False``
    keeps it a fixed buffer, a pure reparameterisation of the same function class.

    State dicts saved before the scale existed (no ``scale`` entry) load with
    ``scale = 1``, the function they were trained as.

    Shapes: ``forward(pos_q [B, N, 1], pos_k [B, Nk, 1] = pos_q) -> [B, H, N, Nk]`` in the
    table's dtype. Positions are integer-valued (float or integer tensors; ``[N, 1]``
    is accepted and gives batch 1). :meth:`lookup` gives the bias of a tensor of offsets.
    As a :class:`flt.relative.RelativeTerm`: ``bias(pos_q, pos_k)`` is ``forward`` and
    ``of_offsets(delta)`` the bias at offsets ``delta = r_q - r_k`` (integer-valued).
    """

    pos_dims = (1,)

    def __init__(
        self,
        heads: int,
        *,
        mode: str = "t5",
        max_distance: int = 128,
        num_buckets: int | None = None,
        bidirectional: bool = True,
        table_scale: float = DEFAULT_TABLE_SCALE,
        learn_scale: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        check_positive_int("heads", heads)
        check_choice("mode", mode, ("t5", "clipped"))
        check_positive_int("max_distance", max_distance)
        check_bool("bidirectional", bidirectional)
        check_bool("learn_scale", learn_scale)
        table_scale = check_positive_float("table_scale", table_scale)
        if mode == "t5":
            num_buckets = 32 if num_buckets is None else num_buckets
            # Validates num_buckets / max_distance now rather than at the first forward.
            probe = torch.zeros(1, dtype=torch.long)
            t5_relative_buckets(probe, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
            size = num_buckets
        else:
            if num_buckets is not None:
                raise ValueError("num_buckets applies to mode='t5' only; leave it unset for mode='clipped'")
            size = 2 * max_distance + 1 if bidirectional else max_distance + 1
        self.heads, self.mode = heads, mode
        self.max_distance, self.num_buckets, self.bidirectional = max_distance, num_buckets, bidirectional
        self.table_scale, self.learn_scale = table_scale, learn_scale
        self.table = nn.Parameter(torch.zeros(size, heads, device=device, dtype=dtype))
        scale = torch.full((heads,), table_scale, device=device, dtype=dtype)
        if learn_scale:
            self.scale = nn.Parameter(scale)
        else:
            self.register_buffer("scale", scale)

    def indices(self, offsets: torch.Tensor) -> torch.Tensor:
        """Table row of each integer offset ``key - query`` (any shape, ``torch.long``)."""
        if self.mode == "t5":
            assert self.num_buckets is not None, "the constructor sets num_buckets in mode 't5'"
            return t5_relative_buckets(
                offsets, bidirectional=self.bidirectional, num_buckets=self.num_buckets, max_distance=self.max_distance
            )
        return clipped_relative_indices(offsets, max_distance=self.max_distance, bidirectional=self.bidirectional)

    def scaled_table(self) -> torch.Tensor:
        """``scale * table``: ``[rows, H]``, the bias of every row."""
        return self.table * self.scale

    def lookup(self, offsets: torch.Tensor) -> torch.Tensor:
        """Bias of integer offsets ``key - query`` (any shape ``S``): ``[*S, H]``."""
        return self.scaled_table()[self.indices(offsets)]

    def of_offsets(self, delta: torch.Tensor) -> torch.Tensor:
        """Bias at integer offsets ``delta = r_q - r_k`` ``[..., 1]``: ``[..., H]``."""
        return self.lookup(-integer_positions("delta", delta)[..., 0])

    def bias(self, pos_q: torch.Tensor, pos_k: torch.Tensor | None = None) -> torch.Tensor:
        return self(pos_q, pos_k)

    def pairwise(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        # From the positions (integer check on N values), not from the N x N offsets.
        return self(pos_q, pos_k)

    def forward(self, pos_q: torch.Tensor, pos_k: torch.Tensor | None = None) -> torch.Tensor:
        pos_k = pos_q if pos_k is None else pos_k
        q, k = (integer_positions(name, p) for name, p in (("pos_q", pos_q), ("pos_k", pos_k)))
        for name, p in (("pos_q", q), ("pos_k", k)):
            if p.ndim not in (2, 3) or p.shape[-1] != 1:
                raise ValueError(f"{name} must have shape [B, N, 1] or [N, 1] (1-D positions), got {tuple(p.shape)}")
        q = q if q.ndim == 3 else q.unsqueeze(0)
        k = k if k.ndim == 3 else k.unsqueeze(0)
        if q.shape[0] != k.shape[0] and 1 not in (q.shape[0], k.shape[0]):
            raise ValueError(f"pos_q and pos_k have batch sizes {q.shape[0]} and {k.shape[0]}; they must match or be 1")
        offsets = k[..., 0].unsqueeze(1) - q[..., 0].unsqueeze(2)  # [B, N, Nk], key - query
        # Scaling the [rows, H] table before the gather costs rows * H, not N * Nk * H.
        bias = self.lookup(offsets)  # [B, N, Nk, H]
        return rearrange(bias, "b i j h -> b h i j")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A state dict from before the scale existed describes bias = table: scale 1.
        if prefix + "table" in state_dict and prefix + "scale" not in state_dict:
            state_dict[prefix + "scale"] = torch.ones_like(self.scale)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        extra = f", num_buckets={self.num_buckets}" if self.mode == "t5" else ""
        return (
            f"heads={self.heads}, mode={self.mode!r}, max_distance={self.max_distance}{extra}, "
            f"bidirectional={self.bidirectional}, table_scale={self.table_scale}, learn_scale={self.learn_scale}"
        )


class T5Bias(RelativeBiasTable):
    """The T5-bucketed table as a registered relative term (``RELATIVE["t5"]``): one side
    of the offsets when ``causal``."""

    def __init__(
        self, heads: int, *, pos_dim: int = 1, causal: bool = False, max_distance: int = 128, num_buckets: int | None = None,
        table_scale: float = DEFAULT_TABLE_SCALE, learn_scale: bool = True, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ):
        if pos_dim != 1:
            raise ValueError(f"relative term 't5' is a table over 1-D integer offsets; got pos_dim = {pos_dim}")
        super().__init__(
            heads, mode="t5", max_distance=max_distance, num_buckets=num_buckets, bidirectional=not causal,
            table_scale=table_scale, learn_scale=learn_scale, device=device, dtype=dtype,
        )


class ClippedBias(RelativeBiasTable):
    """The clipped-offset table as a registered relative term (``RELATIVE["clipped"]``)."""

    def __init__(
        self, heads: int, *, pos_dim: int = 1, causal: bool = False, max_distance: int = 128,
        table_scale: float = DEFAULT_TABLE_SCALE, learn_scale: bool = True, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ):
        if pos_dim != 1:
            raise ValueError(f"relative term 'clipped' is a table over 1-D integer offsets; got pos_dim = {pos_dim}")
        super().__init__(
            heads, mode="clipped", max_distance=max_distance, bidirectional=not causal,
            table_scale=table_scale, learn_scale=learn_scale, device=device, dtype=dtype,
        )
