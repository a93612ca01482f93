"""The near sets of :class:`flt.layers.flt.FLTAttention`: pairs whose weights are exact.

A near set holds, for every query, the keys whose weights the layer computes exactly
(``exp(x_q.x_k + f + f_near)`` for the logit coupling, ``(f + f_near) exp(x_q.x_k)`` for the
multiplicative one); all other pairs get the random-feature estimate (docs/math.md 5.1).
``f_near`` is the near set's own term, exact only, so a strong local bias costs no variance;
``term="zero"`` gives the near set none (``f_near = 0``: it only makes ``f`` exact on its pairs).

* :class:`Band` ``(w)``: the keys with ``|i - j| <= w`` in token order (sequences), by
  :func:`flt.ops.band.band_attention`; a causal band decodes token by token in constant
  memory (:meth:`Band.step`, the ring buffer of :mod:`flt.layers.band_decode`).
* :class:`Neighbors` ``(k)``: each query's ``k`` nearest keys in position space (sets of
  atoms, patches), by :func:`flt.ops.neighbors.neighbor_attention`.

Each is a small frozen value, its width (``Band.width``, ``Neighbors.k``; ``size`` names
either) and its ``term``, whose methods take the core it belongs to, its host, for the
core's features and terms: what a near set asks of its host is :class:`NearHost`
(:class:`flt.layers.flt.FLTCore` is one), and what a host asks of a near set is
:class:`NearSet`. The rules about which couplings, features and settings a near set takes
are in :mod:`flt.layers.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from einops import rearrange

from flt._checks import check_positive_int, check_state_position, check_state_tensors, shown
from flt._dtype import compute_dtype
from flt.layers.band_decode import BandDecodeState, empty_state, fold_into_far
from flt.layers.base import Prepared, batch_shared, regular_step
from flt.layers.features import FeatureMap
from flt.ops.band import band_attention, band_attention_reference
from flt.ops.neighbors import (
    near_offsets,
    nearest_keys,
    neighbor_attention,
    neighbor_attention_reference,
)
from flt.relative.base import RelativeTerm

if TYPE_CHECKING:
    from flt.layers.parts import Term


#: The near set's term that is no term: ``f_near = 0`` (``near_relative="zero"``).
ZERO_TERM = "zero"


class ZeroTerm(RelativeTerm):
    """``f_near = 0`` at every offset, with no parameters: the term of a near set that only
    makes the far term ``f`` exact on its pairs (:data:`ZERO_TERM`)."""

    #: What :mod:`flt.layers.rules` reads, as it reads a :class:`flt.layers.parts.Term`'s.
    name = ZERO_TERM

    def __init__(self, heads: int, *, pos_dim: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_positive_int("heads", heads)
        self.heads, self.pos_dim = heads, pos_dim
        self.dtype = dtype or torch.get_default_dtype()

    def of_offsets(self, delta: torch.Tensor) -> torch.Tensor:
        return delta.new_zeros((*delta.shape[:-1], self.heads))

    def extra_repr(self) -> str:
        return f"heads={self.heads}, pos_dim={self.pos_dim}"


class NearHost(Protocol):
    """What a near set asks of the core it belongs to (:class:`flt.layers.flt.FLTCore`):
    its settings, its scaled queries and keys, its features and its exact mask."""

    @property
    def causal(self) -> bool: ...

    @property
    def coupling(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def chunk_size(self) -> int | None: ...

    @property
    def feature_map(self) -> FeatureMap: ...

    def scaled_qk(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x_q, x_k [B, H, N, D]``: queries and keys scaled (and rotated) for the kernel."""
        ...

    def far_features(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``a(r), c(r) [B|1, H, N, 2R]``: the far term's features."""
        ...

    def near_set_features(self, p: Prepared) -> tuple[torch.Tensor, ...]:
        """``x_q, x_k``, the FAVOR+ features of ``[x_q, a]``, ``[x_k, c]`` and their shifts."""
        ...

    def near_mask(self, delta: torch.Tensor) -> torch.Tensor:
        """The exact ``f + f_near`` at offsets ``delta [..., P] -> [..., H]``."""
        ...

    def attend(self, p: Prepared, *, reference: bool = False) -> torch.Tensor:
        """The core's forward on prepared inputs, ``[B, H, N, Dv]``."""
        ...

    def check_decoding(self, what: str) -> None:
        """Refuse ``prefill``/``step`` (``what``) on a core that is not causal."""
        ...


class NearSet:
    """What both near sets share: the term ``f_near`` and how it is built.

    ``term``: ``None`` (default) a second spectrum of the far term's family with its
    options, starting at 0; ``"zero"`` (:data:`ZERO_TERM`): no term of its own, ``f_near =
    0`` for good, so the near set only makes ``f`` exact on its pairs (a learned ``f_near``
    can turn a multiplicative mask ``f + f_near`` negative at the near set's outer edge,
    where rows of weights then cancel: docs/results.md, "Why the catalysis near set trains
    worse"); a name in :data:`flt.relative.RELATIVE` that is a function of the offset, e.g.
    ``"clipped"`` (a learned table with one entry per offset of the band; ``max_distance``
    defaults to the band's width); a :class:`flt.layers.parts.Term` (name and options); or
    a :class:`flt.relative.RelativeTerm` module. Only its exact values are used, so it
    needs no features.
    """

    term: Any
    #: The near set decodes token by token (:meth:`step`, :meth:`prefill`; the band does).
    decodes = False
    #: The flat option (presets, the command line, :class:`flt.layers.rules.Facts`) that
    #: gives this near set its :attr:`size`.
    size_option: ClassVar[str]

    @property
    def size(self) -> int:
        """The near set's width: the band's ``w``, the neighbours' ``k``."""
        raise NotImplementedError

    def attend(self, core: NearHost, p: Prepared, *, reference: bool = False) -> torch.Tensor:
        """``[B, H, N, Dv]``: exact weights on the near set, the estimate beyond it."""
        raise NotImplementedError

    def pairs(self, core: NearHost, p: Prepared, cdt: torch.dtype) -> torch.Tensor:
        """Which pairs the near set holds, ``[B|1, 1, N, N]`` booleans."""
        raise NotImplementedError

    def step_offset(self, core: NearHost, state: Any) -> int:
        """How many tokens ``state`` has seen (0 for None), for a near set that :attr:`decodes`."""
        raise ValueError(f"{type(self).__name__} does not decode token by token")

    def step(self, core: NearHost, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any,
             pos: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """One token, for a near set that :attr:`decodes`: ``(out [B, H, 1, Dv], state)``."""
        raise ValueError(f"{type(self).__name__} does not decode token by token")

    def prefill(self, core: NearHost, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """A prompt and the state :meth:`step` continues from, for a near set that :attr:`decodes`."""
        raise ValueError(f"{type(self).__name__} does not decode token by token")

    def _normalise_term(self) -> None:
        """A term given by name becomes a :class:`flt.layers.parts.Term` (equal parts compare equal)."""
        from flt.layers.parts import Term

        if isinstance(self.term, str):
            object.__setattr__(self, "term", Term(self.term))
        elif not (self.term is None or isinstance(self.term, (Term, RelativeTerm))):
            raise TypeError(f"{type(self).__name__}: term must be None, a name in flt.relative.RELATIVE, a Term or a "
                            f"RelativeTerm module, got {shown(self.term)} ({type(self.term).__name__})")

    def build_term(self, relative: Term | RelativeTerm, *, heads: int, pos_dim: int, causal: bool, start: float,
                   device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> RelativeTerm:
        """The module ``f_near`` for a layer whose far term is ``relative`` (a
        :class:`flt.layers.parts.Term` or a module); a spectrum starts at amplitude ``start``."""
        from flt.layers.parts import Term
        from flt.relative.spectra import SPECTRA

        term = self.term
        if isinstance(term, RelativeTerm):
            module = term
        elif isinstance(term, Term) and term.name == ZERO_TERM:
            if term.options:
                raise ValueError(f"near_relative={ZERO_TERM!r} (f_near = 0) takes no options, got {sorted(term.options)}")
            module = ZeroTerm(heads, pos_dim=pos_dim, device=device, dtype=dtype)
        else:
            if term is None:
                if not isinstance(relative, Term):
                    raise ValueError("a near set's default term is a copy of the far term's family, which needs the far term "
                                     "as a Term (name and options); with a module as relative, give the near set its term")
                # Only its exact f is used, never a sample of it, so no seed: a discrete family's
                # starting frequencies (its parameters) then come from torch's global generator.
                options = {k: v for k, v in relative.options.items() if k != "seed"}
                term = Term(relative.name, **{**options, "amplitude": start})
            defaults: dict = {}
            if term.name == "clipped":
                defaults["max_distance"] = max(self.size, 1) if isinstance(self, Band) else 1
            if term.name in SPECTRA:  # a spectrum of another family or other options: starts at `start`
                defaults["num_frequencies"] = relative.options.get("num_frequencies", 32) if isinstance(relative, Term) else relative.num_frequencies
                defaults["amplitude"] = start
            module = term.with_defaults(**defaults).build(heads=heads, pos_dim=pos_dim, causal=causal, device=device, dtype=dtype)
        module.has_random_features = False  # flt.layers.draws leaves it alone
        return module


@dataclass(frozen=True)
class Band(NearSet):
    """The token band ``|i - j| <= width`` (logit coupling only; sequences, not sets).

    Cost ``O(N T (D + Dv))`` with blocks of ``T = max(w, 16)`` tokens on top of the linear
    part (causal: the far field is the chunked scan of plain FLT, keys delayed by ``w + 1``
    tokens); see :func:`flt.ops.band.band_attention`.
    """

    width: int
    term: Any = None
    decodes = True
    size_option: ClassVar[str] = "near_field"

    def __post_init__(self) -> None:
        check_positive_int("width", self.width)
        self._normalise_term()

    @property
    def size(self) -> int:
        return self.width

    def attend(self, core: NearHost, p: Prepared, *, reference: bool = False) -> torch.Tensor:
        """``[B, H, N, Dv]``: exact weights on the band, the FAVOR+ estimate beyond it."""
        if core.backend in ("triton", "triton-split") and not reference:
            return self._attend_triton(core, p)
        xq, xk, qf, kf, q_shift, k_shift = core.near_set_features(p)
        bias = self.bias(core, batch_shared(p.pos).to(xq.dtype))  # [B|1, H, N, 2w + 1]
        key_mask = None if p.pad is None else ~p.pad
        if reference:
            return band_attention_reference(xq, xk, p.v, qf, kf, q_shift, k_shift, bias, width=self.width,
                                            causal=core.causal, key_mask=key_mask)
        return band_attention(xq, xk, p.v, qf, kf, q_shift, k_shift, bias, width=self.width, causal=core.causal,
                              key_mask=key_mask, chunk_size=core.chunk_size)

    def _attend_triton(self, core: NearHost, p: Prepared) -> torch.Tensor:
        """The band by :func:`flt.ops.triton.band.band_attention` (``backend="triton"``) or
        :func:`flt.ops.triton.band.band_attention_split` (``"triton-split"``), far-field
        features made in the kernels."""
        from flt.ops.triton.band import band_attention, band_attention_split

        band_kernel = band_attention_split if core.backend == "triton-split" else band_attention

        xq, xk = core.scaled_qk(p.q, p.k, p.pos)
        a, c = core.far_features(p.pos)
        bias = self.bias(core, batch_shared(p.pos).to(compute_dtype(xq, a)))
        key_mask = None if p.pad is None else ~p.pad
        projection = core.feature_map.projection
        assert projection is not None, "the Triton path is chosen for FAVOR+ features, which have a projection"
        return band_kernel(xq, xk, p.v, projection, bias, width=self.width, extra_q=a, extra_k=c,
                           causal=core.causal, key_mask=key_mask)

    def bias(self, core: NearHost, pos: torch.Tensor) -> torch.Tensor:
        """Exact ``f + f_near`` of query ``i`` and key ``i + o``, ``o = -w .. w``:
        ``pos [B, N, P] -> [B, H, N, 2w + 1]`` (offsets outside the sequence hold junk the
        band op ignores)."""
        w = self.width
        step = regular_step(pos)
        if step is not None:
            # Token indices: every query sees the same offsets, so f is evaluated on 2w + 1
            # offsets instead of N (2w + 1), and the bias is a broadcast view over the rows.
            delta = (torch.arange(w, -w - 1, -1, device=pos.device, dtype=pos.dtype) * step).view(1, 1, 2 * w + 1, 1)
        else:
            neighbours = F.pad(pos, (0, 0, w, w)).unfold(1, 2 * w + 1, 1)  # [B, N, P, 2w+1]
            delta = rearrange(pos.unsqueeze(-1) - neighbours, "b n p o -> b n o p")
        f = core.near_mask(delta)  # [B | 1, N | 1, 2w+1, H]
        return rearrange(f, "b n o h -> b h n o").expand(pos.shape[0], -1, pos.shape[1], -1)

    def pairs(self, core: NearHost, p: Prepared, cdt: torch.dtype) -> torch.Tensor:
        """Which pairs the band holds, ``[1, 1, N, N]`` booleans."""
        n = p.q.shape[2]
        idx = torch.arange(n, device=p.q.device)
        return ((idx.view(-1, 1) - idx.view(1, -1)).abs() <= self.width).view(1, 1, n, n)

    def step_offset(self, core: NearHost, state: Any) -> int:
        """The next token's default position: how many tokens ``state`` has seen (0 for
        None); the state must be the band's."""
        core.check_decoding("step")
        if state is not None and not isinstance(state, BandDecodeState):
            raise TypeError(f"state must be the BandDecodeState of the previous step (or None), got {type(state).__name__}")
        return 0 if state is None else check_state_position("BandDecodeState", state)

    def step(self, core: NearHost, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: BandDecodeState | None,
             pos: torch.Tensor) -> tuple[torch.Tensor, BandDecodeState]:
        """One token of a causal banded core: exact band from the ring buffer of the last
        ``w + 1`` tokens, far field from the linear state (:mod:`flt.layers.band_decode`).

        Args:
            q, k: ``[B, H, 1, D]``, v: ``[B, H, 1, Dv]``: the next token, projected.
            state: from the previous call or :meth:`prefill`, ``None`` to start.
            pos: ``[B|1, 1, P]``, the token's position.

        Returns:
            ``(out [B, H, 1, Dv], state)``; a sequence fed token by token gives the core's
            forward outputs (same draws, eval mode).
        """
        core.check_decoding("step")
        if state is not None and not isinstance(state, BandDecodeState):
            raise TypeError(f"state must be the BandDecodeState of the previous step (or None), got {type(state).__name__}")
        w = self.width
        p = Prepared(q, k, v, pos, None)
        xq, xk, qf, kf, q_shift, k_shift = core.near_set_features(p)  # [B, H, 1, *]
        B = xq.shape[0]
        cdt = xq.dtype
        v = p.v.to(cdt)
        pos = p.pos.to(cdt).expand(B, 1, p.pos.shape[-1])  # [B, 1, P]
        if state is None:
            state = empty_state(w, xk, v, kf, pos)
        else:
            H, S = xk.shape[1], w + 1
            check_state_position("BandDecodeState", state)
            xk_state = getattr(state, "xk", None)
            if isinstance(xk_state, torch.Tensor) and (xk_state.shape[:1] != (B,) or xk_state.dtype != cdt):
                raise ValueError(f"state holds batch {xk_state.shape[0]} in {xk_state.dtype}; this token has batch {B} in {cdt}")
            check_state_tensors("BandDecodeState", state, {
                "xk": (B, H, S, xk.shape[-1]), "v": (B, H, S, v.shape[-1]), "kf": (B, H, S, kf.shape[-1]), "kls": (B, H, S),
                "pos": (B, S, pos.shape[-1]), "kv": (B, H, kf.shape[-1], v.shape[-1]), "z": (B, H, kf.shape[-1]),
                "level": (B, H)}, xq.device)
        t = state.position
        slot = t % (w + 1)
        copies: dict[str, Any] = {name: value.clone() if isinstance(value, torch.Tensor) else value
                                  for name, value in vars(state).items()}
        state = BandDecodeState(**copies)
        if t > w:  # token t - w - 1 leaves the band now
            fold_into_far(state, slot)
        if state.pad is not None:
            state.pad[:, slot] = False  # decoded tokens are real
        state.xk[:, :, slot] = xk[:, :, 0]
        state.v[:, :, slot] = v[:, :, 0]
        state.kf[:, :, slot] = kf[:, :, 0]
        state.kls[:, :, slot] = k_shift[:, :, 0]
        state.pos[:, slot] = pos[:, 0]
        filled = min(t + 1, w + 1)  # slots 0 .. filled-1 hold tokens max(0, t - w) .. t
        delta = pos - state.pos[:, :filled]  # [B, K, P]: r_i - r_j
        bias = rearrange(core.near_mask(delta.unsqueeze(1)), "b one k h -> b h (one k)").to(cdt)  # [B, H, K]
        logits = (xq @ state.xk[:, :, :filled].transpose(-1, -2)).squeeze(-2) + bias  # [B, H, K]
        if state.pad is not None:  # the new token's own slot is real, so every row keeps a finite logit
            logits = logits.masked_fill(state.pad[:, None, :filled], float("-inf"))
        far_log = q_shift[:, :, 0] + state.level  # [B, H], -inf while the far field is empty
        top = torch.maximum(logits.amax(dim=-1), far_log)
        near_w = torch.exp(logits - top.unsqueeze(-1))
        far_scale = torch.exp(far_log - top)  # [B, H]
        qf0 = qf[:, :, 0]
        num = (near_w.unsqueeze(-1) * state.v[:, :, :filled]).sum(-2) + far_scale.unsqueeze(-1) * (qf0.unsqueeze(-2) @ state.kv).squeeze(-2)
        den = near_w.sum(-1) + far_scale * (qf0 * state.z).sum(-1)
        out = num / den.unsqueeze(-1)  # den >= exp(0) from the largest exact weight or the far part
        state.position = t + 1
        return out.unsqueeze(2), state

    def prefill(self, core: NearHost, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, BandDecodeState]:
        """The causal attention of a prompt, with the state :meth:`step` would hold after it.

        Returns:
            ``(out [B, H, N, Dv], state)``: ``out`` is the core's forward; the ring buffer
            holds tokens ``max(0, N - w - 1) .. N - 1`` (token ``t`` in slot ``t % (w + 1)``,
            padded ones marked in ``state.pad``) and the far field the real tokens among
            ``0 .. N - w - 2``, relative to their largest key log scale. The band counts
            token slots, so a left-padded prompt (padding first) decodes as the prompt alone;
            padding after a real token would shift the band.
        """
        core.check_decoding("prefill")
        w = self.width
        p = Prepared(q, k, v, pos, pad)
        y = core.attend(p)
        _, xk, _, kf, _, k_shift = core.near_set_features(p)  # [B, H, N, *]
        B, _, N, _ = xk.shape
        cdt = xk.dtype
        v = p.v.to(cdt)
        pos = p.pos.to(cdt).expand(B, N, p.pos.shape[-1])
        state = empty_state(w, xk, v, kf, pos)
        ring = torch.arange(max(0, N - w - 1), N, device=xk.device)
        slots = ring % (w + 1)
        state.xk[:, :, slots] = xk[:, :, ring]
        state.v[:, :, slots] = v[:, :, ring]
        state.kf[:, :, slots] = kf[:, :, ring]
        state.kls[:, :, slots] = k_shift[:, :, ring]
        state.pos[:, slots] = pos[:, ring]
        if p.pad is not None:
            state.pad = p.pad.new_zeros(B, w + 1)
            state.pad[:, slots] = p.pad[:, ring]
            state.v = state.v.masked_fill(state.pad[:, None, :, None], 0.0)  # weight 0 times a padded value stays 0
        far = N - w - 1  # tokens 0 .. far - 1 have left the band
        if far > 0:
            kls = k_shift[:, :, :far]
            if p.pad is not None:
                kls = kls.masked_fill(p.pad[:, None, :far], float("-inf"))
            state.level = kls.amax(dim=-1)  # [B, H], -inf for a row whose far tokens are all padding
            finite = torch.where(torch.isinf(state.level), torch.zeros_like(state.level), state.level)
            kf_far = kf[:, :, :far] * torch.exp(kls - finite.unsqueeze(-1)).unsqueeze(-1)
            state.kv = kf_far.transpose(-1, -2) @ v[:, :, :far]  # [B, H, m, Dv]
            state.z = kf_far.sum(dim=-2)
        state.position = N
        return y, state


@dataclass(frozen=True)
class Neighbors(NearSet):
    """Each query's ``k`` nearest keys in position space (itself included, padded keys
    excluded, ``min(k, N)`` for shorter sets): for sets of atoms or image patches, whose
    token order means nothing. Bidirectional; either coupling.

    The search uses cell lists from ``N = 1024`` points in up to 3 dimensions (``O(N k)`` for
    evenly spread points), else ``O(N^2 P)`` in chunks (once per batch when the positions are
    shared), the attention ``O(N k (D + m + Dv))`` on top of the linear part; see
    :mod:`flt.ops.neighbors` and docs/math.md section 5.1.1.
    """

    k: int
    term: Any = None
    size_option: ClassVar[str] = "near_neighbors"

    def __post_init__(self) -> None:
        check_positive_int("k", self.k)
        self._normalise_term()

    @property
    def size(self) -> int:
        return self.k

    def attend(self, core: NearHost, p: Prepared, *, reference: bool = False) -> torch.Tensor:
        """``[B, H, N, Dv]``: exact weights on the near keys, the estimate elsewhere."""
        key_mask = None if p.pad is None else ~p.pad
        op = neighbor_attention_reference if reference else neighbor_attention
        if core.coupling == "logit":
            xq, xk, qf, kf, q_shift, k_shift = core.near_set_features(p)
            pos = batch_shared(p.pos).to(xq.dtype)
            idx = self.keys(pos, key_mask)
            return op(xq, xk, p.v, qf, kf, q_shift, k_shift, idx, self.bias(core, pos, idx), key_mask=key_mask)
        # Multiplicative: the exact mask on the near set (times exp(x_q.x_k) for FAVOR+, the
        # features' own kernel for other maps), the Kronecker estimate elsewhere.
        xq, xk = core.scaled_qk(p.q, p.k, p.pos)
        a, c = core.far_features(p.pos)
        cdt = torch.promote_types(xq.dtype, a.dtype)
        xq, xk = xq.to(cdt), xk.to(cdt)
        qf, q_shift = core.feature_map(xq)
        kf, k_shift = core.feature_map(xk)
        pos = batch_shared(p.pos).to(cdt)
        idx = self.keys(pos, key_mask)
        return op(xq, xk, p.v, qf, kf, q_shift, k_shift, idx, None, key_mask=key_mask, a=a, c=c,
                  near_mask=self.bias(core, pos, idx),
                  near_kernel="exp" if core.feature_map.kind == "favor+" else "features")

    def keys(self, pos: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """The near set: ``min(k, N)`` nearest keys of every query, ``[B|1, N, k]``
        (:func:`flt.ops.neighbors.nearest_keys`; sequences shorter than ``k`` are exact)."""
        return nearest_keys(pos, min(self.k, pos.shape[1]), key_mask=key_mask)

    def bias(self, core: NearHost, pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Exact ``f + f_near`` of query ``i`` and its near keys ``idx[i]``:
        ``pos [B|1, N, P], idx [B|1, N, k] -> [B|1, H, N, k]``."""
        return rearrange(core.near_mask(near_offsets(pos, idx)), "b n k h -> b h n k")

    def pairs(self, core: NearHost, p: Prepared, cdt: torch.dtype) -> torch.Tensor:
        """Which pairs the near set holds, ``[B|1, 1, N, N]`` booleans."""
        n = p.q.shape[2]
        idx = self.keys(batch_shared(p.pos).to(cdt), None if p.pad is None else ~p.pad)
        return torch.zeros(idx.shape[0], 1, n, n, dtype=torch.bool, device=p.q.device).scatter(-1, idx.unsqueeze(1), True)
