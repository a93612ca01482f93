"""SoftmaxAttention: exact O(N^2) attention, optionally with a relative positional bias.

The exact baselines FLT is judged against: plain softmax, a learned per-offset table
(clipped or T5-bucketed), ALiBi, RoPE, or the exact ``f`` of any FLT spectrum as the bias
(the exact counterpart of ``FLTAttention(coupling="logit")``) or as a multiplicative mask
(the counterpart of ``coupling="multiplicative"``).

Causal layers decode token by token from a KV cache (:class:`KVCache`: the RoPE-rotated
keys, the values and the positions of every token seen), the exact baseline of the linear
layers' constant-size decoding: token ``t`` costs one row of attention, ``O(t)`` time and
the cache ``O(t)`` memory. :meth:`SoftmaxAttention.prefill` fills the cache from a whole
prompt in one forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from einops import rearrange

from flt._checks import check_choice, check_state_tensors
from flt._dtype import compute_dtype
from flt.layers import flat
from flt.layers.base import AttentionBase, CoreBase, OfCore, batch_shared, size, spectrum_values
from flt.layers.rules import BUILT_IN, Facts, check_rules
from flt.ops.reference import rpe_attention_reference
from flt.ops.softmax import BACKENDS, softmax_attention
from flt.posenc.rope import apply_rope
from flt.relative.base import RelativeTerm
from flt.relative.spectra import SPECTRA, Spectrum

#: The ``relative_bias`` values exact softmax takes (``None``: no relative term).
RELATIVE_BIASES = (None, *BUILT_IN)


@dataclass
class KVCache:
    """Decoding state of a causal :class:`SoftmaxAttention`: every token seen so far.

    ``k [B, H, C, D]`` (rotated by RoPE when the layer has it), ``v [B, H, C, Dv]`` and
    ``pos [B, C, P]`` hold ``length`` tokens in a buffer of capacity ``C >= length``
    (entries past ``length`` are unused); :attr:`keys`, :attr:`values` and
    :attr:`positions` are the filled part.
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    length: int
    # How many entries of this buffer any cache sharing it has written (one list per buffer).
    tip: list = field(default_factory=list, repr=False)

    @property
    def keys(self) -> torch.Tensor:
        return self.k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.v[:, :, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        return self.pos[:, : self.length]

    @staticmethod
    def start(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> KVCache:
        """A cache holding ``k [B, H, N, D]``, ``v [B, H, N, Dv]`` at ``pos [B|1, N, P]``."""
        n = k.shape[2]
        return KVCache(k, v, pos.expand(k.shape[0], n, pos.shape[-1]), n, [n])

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> KVCache:
        """The cache with one more token (``k [B, H, 1, D]``, ``v [B, H, 1, Dv]``, ``pos
        [B|1, 1, P]``); this one stays valid.

        Without autograd the token is written into spare capacity (grown by a quarter when
        full), so appending costs amortised ``O(1)`` copies; when another cache on the same
        buffer has already written past ``length`` (decoding branched from this state), the
        filled part is copied first. With autograd the buffers are concatenated, since an
        in-place write would invalidate tensors saved for the backward pass.
        """
        n, B = self.length, self.k.shape[0]
        if k.shape[0] != B or k.dtype != self.k.dtype:
            raise ValueError(f"the cache holds batch {B} in {self.k.dtype}; this token has batch {k.shape[0]} in {k.dtype}")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= self.k.shape[2]:
            raise ValueError(f"the cache's length {n!r} does not fit its buffer of {self.k.shape[2]} tokens")
        check_state_tensors("KVCache", self, {"k": (B, k.shape[1], self.k.shape[2], k.shape[3]),
                                              "v": (B, v.shape[1], self.k.shape[2], v.shape[3]),
                                              "pos": (B, self.k.shape[2], pos.shape[-1])}, k.device)
        pos = pos.to(self.pos.dtype).expand(B, 1, pos.shape[-1])
        if torch.is_grad_enabled() and any(t.requires_grad for t in (self.k, self.v, k, v)):
            return KVCache.start(torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2), torch.cat([self.positions, pos], 1))
        kb, vb, pb, tip = self.k, self.v, self.pos, self.tip
        if tip != [n] or n == kb.shape[2]:
            cap = n + max(n // 4, 16) if n == kb.shape[2] else kb.shape[2]  # geometric growth: amortised O(1)
            kb, vb, pb = _resized(self.keys, cap, 2), _resized(self.values, cap, 2), _resized(self.positions, cap, 1)
            tip = [n]
        kb[:, :, n] = k[:, :, 0]
        vb[:, :, n] = v[:, :, 0]
        pb[:, n] = pos[:, 0]
        tip[0] = n + 1
        return KVCache(kb, vb, pb, n + 1, tip)


def _toeplitz_spectrum(term: RelativeTerm, pos: torch.Tensor) -> torch.Tensor | None:
    """A spectrum's ``f`` at consecutive token indices (``pos [1, N, 1]`` equal to ``p_0 +
    0, 1, ..., N - 1``) as ``[1, H, N, N]``: it takes only the ``2N - 1`` values of the
    offsets ``-(N - 1) .. N - 1``, evaluated once and gathered, the same numbers as the
    pairwise form at a cost of ``O(N H C)`` instead of ``O(N^2 H C)`` (which dominated a
    training step at a thousand tokens). None for other terms and positions."""
    if not isinstance(term, Spectrum) or pos.shape[0] != 1 or pos.shape[-1] != 1 or pos.requires_grad:
        return None
    p, n = pos[0, :, 0], pos.shape[1]
    steps = torch.arange(n, device=p.device, dtype=p.dtype)
    if n < 2 or not torch.equal(p - p[0], steps):
        return None
    offsets = torch.arange(-(n - 1), n, device=p.device, dtype=p.dtype).unsqueeze(-1)  # [2N - 1, 1]
    values = term.of_offsets(offsets)  # [2N - 1, H]
    index = steps.long().unsqueeze(1) - steps.long().unsqueeze(0) + (n - 1)  # i - j, shifted to 0 .. 2N - 2
    return rearrange(values[index], "i j h -> 1 h i j")


def _resized(t: torch.Tensor, capacity: int, dim: int) -> torch.Tensor:
    """A new buffer of ``capacity`` entries along ``dim`` starting with ``t``."""
    shape = list(t.shape)
    shape[dim] = capacity
    out = t.new_empty(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


class SoftmaxCore(CoreBase):
    """The mechanism of :class:`SoftmaxAttention` without its projections: the relative
    term (``relative``), RoPE and the backend, computing on queries, keys and values ``[B,
    H, N, D]``; causal cores decode from a :class:`KVCache`. The arguments are the layer's,
    with ``head_dim`` for ``dim``."""

    #: Causal instances decode from a KV cache (set per instance in ``__init__``).
    supports_decoding = True

    def __init__(self, heads: int, head_dim: int, *, pos_dim: int = 1, causal: bool = False,
                 relative_bias: str | RelativeTerm | None = None, relative_options: dict | None = None, coupling: str = "logit",
                 rope: bool = False, rope_base: float = 10000.0, backend: str = "sdpa", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(heads, head_dim, pos_dim=pos_dim, causal=causal)
        from flt.relative import RELATIVE, build_relative

        if not isinstance(relative_bias, RelativeTerm):
            check_choice("relative_bias", relative_bias, (None, "spectrum", *RELATIVE))
        check_choice("backend", backend, BACKENDS)
        check_choice("coupling", coupling, ("logit", "multiplicative"))
        if relative_options is not None and not isinstance(relative_options, dict):
            raise TypeError(f"relative_options must be a dict of the term's options, got {type(relative_options).__name__}")
        if relative_options and isinstance(relative_bias, RelativeTerm):
            raise ValueError("relative_options are the options of a term built by name; a RelativeTerm module comes built")
        options = dict(relative_options or {})
        name = relative_bias
        if relative_bias == "spectrum":
            name = options.pop("spectrum", "gaussian_mixture")
            check_choice("spectrum", name, SPECTRA)
        is_spectrum = name in SPECTRA if isinstance(name, str) else isinstance(relative_bias, Spectrum)
        check_rules(Facts(coupling=coupling, relative=relative_bias, spectrum_term=is_spectrum, pos_dim=pos_dim,
                          rope=rope, head_dim=head_dim))
        self.coupling, self.backend = coupling, backend
        self.rope, self.rope_base = bool(rope), rope_base
        term = None
        if isinstance(relative_bias, RelativeTerm):
            term, relative_bias = relative_bias, type(relative_bias).__name__
        elif is_spectrum:
            assert isinstance(name, str)  # a spectrum given built took the branch above
            options.setdefault("amplitude", 0.0 if coupling == "logit" else 1.0)
            term = build_relative(name, heads=heads, pos_dim=pos_dim, causal=causal, device=device, dtype=dtype, **options)
            term.has_random_features = False  # only its exact mask is used: nothing to redraw
            relative_bias = "spectrum"
        elif relative_bias is not None:
            term = build_relative(relative_bias, heads=heads, pos_dim=pos_dim, causal=causal, device=device, dtype=dtype, **options)
        self.relative_bias, self.relative = relative_bias, term
        self.supports_decoding = self.causal

    @property
    def spectrum(self) -> Spectrum | None:
        """The relative term when it is a spectrum (``relative_bias="spectrum"``), else None."""
        return self.relative if isinstance(self.relative, Spectrum) else None

    @property
    def table(self) -> RelativeTerm | None:
        """The relative term when it is a T5 or clipped table, else None."""
        return self.relative if self.relative_bias in ("t5", "clipped") else None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # Before the relative-term registry the term sat under its kind's name.
        for old in ("table.", "spectrum."):
            for key in [k for k in state_dict if k.startswith(prefix + old)]:
                state_dict.setdefault(prefix + "relative." + key[len(prefix + old):], state_dict.pop(key))
        if prefix + "log_slopes" in state_dict:
            state_dict.setdefault(prefix + "relative.log_slopes", state_dict.pop(prefix + "log_slopes"))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def positional_term(self, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The bias (or, multiplicative coupling, the mask) ``[B|1, H, N, N]`` of positions:
        :meth:`flt.relative.RelativeTerm.bias` of the layer's term.

        When every sequence of the batch has the same positions (token indices, patch
        grids) and they need no gradient, the ``N x N`` term is computed once, not ``B`` times.
        """
        if self.relative is None:
            return None
        pos = batch_shared(pos)  # checked by the layer: the term's unchecked pairwise form
        term = _toeplitz_spectrum(self.relative, pos)
        if term is None:
            term = self.relative.pairwise(pos, pos)
        # A spectrum's f stays in float32 or better (it may be a multiplicative mask).
        return term if isinstance(self.relative, Spectrum) else term.to(dtype)

    def _rotated_qk(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope:
            return apply_rope(q, pos, base=self.rope_base), apply_rope(k, pos, base=self.rope_base)
        return q, k

    def _weights_times_values(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, term: torch.Tensor | None, pad: torch.Tensor | None, causal: bool,
                              backend: str) -> torch.Tensor:
        """``[B, H, N, Dv]``: the layer's attention of ``q [B, H, N, D]`` on ``k, v [B, H, Nk, *]``
        with the positional term ``[B|1, H, N, Nk]`` (bias or multiplicative mask)."""
        if self.coupling == "multiplicative":
            cdt = compute_dtype(q)
            if pad is None:
                mask = term
            else:
                assert term is not None, "the multiplicative coupling multiplies by its spectrum's mask"
                mask = term * (~pad).to(cdt)[:, None, None, :]
            return rpe_attention_reference(q.to(cdt), k.to(cdt), v.to(cdt), mask=mask, causal=causal, scale=1 / math.sqrt(self.head_dim))
        return softmax_attention(q, k, v, bias=term, causal=causal, key_padding_mask=pad, backend=backend)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor | None,
                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, H, N, Dv], keys)``: the attention by ``backend`` and the keys as rotated
        by RoPE (what a KV cache keeps)."""
        q, k = self._rotated_qk(q, k, pos)
        if backend == "flex" and self.coupling == "logit" and self.relative is not None:
            # The term as a score_mod: FlexAttention never sees an [N, N] bias.
            mod = self.relative.score_mod(batch_shared(pos))
            out = softmax_attention(q, k, v, causal=self.causal, key_padding_mask=pad, score_mod=mod, backend="flex")
        else:
            term = self.positional_term(pos, q.dtype)
            out = self._weights_times_values(q, k, v, term, pad, self.causal, backend)
        return out, k

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        return self._attend(q, k, v, pos, pad, self.backend)[0]

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                  pad: torch.Tensor | None = None) -> torch.Tensor:
        """The same computation by the plain O(N^2) reference backend."""
        return self._attend(q, k, v, pos, pad, "reference")[0]

    exact = reference

    def check_prefill(self, pad: torch.Tensor | None) -> None:
        self.check_decoding("prefill")
        if pad is not None:
            raise ValueError("softmax prefill() takes no key_padding_mask: its KV cache keeps no padding mask for the "
                             "steps after the prompt; prefill prompts of equal length without padding")

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
        """The causal attention of a prompt and its KV cache (``causal=True`` only, no
        ``pad``: the cache keeps no padding mask for the steps after the prompt):
        ``(out [B, H, N, Dv], cache)``; :meth:`step` from ``cache`` continues the sequence
        as if it had been fed token by token."""
        self.check_prefill(pad)
        out, k = self._attend(q, k, v, pos, None, self.backend)
        return out, KVCache.start(k, v, pos)

    def step_offset(self, state: Any) -> int:
        self.check_decoding("step")
        if state is not None and not isinstance(state, KVCache):
            raise TypeError(f"state must be the KVCache of the previous step (or None), got {type(state).__name__}")
        return 0 if state is None else state.length

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: KVCache | None,
             pos: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
        """One token from the KV cache (``causal=True`` only): ``q, k [B, H, 1, D]``, ``v [B,
        H, 1, Dv]``, ``pos [B|1, 1, P]`` -> ``(out [B, H, 1, Dv], cache)``. The token attends
        to every cached key and itself with the core's relative term ``relative.bias(pos_q,
        pos_k)`` (and RoPE), ``O(length)`` per token; token by token equals the forward."""
        self.step_offset(state)
        q, k = self._rotated_qk(q, k, pos)
        cache = KVCache.start(k, v, pos) if state is None else state.append(k, v, pos)
        term = None
        if self.relative is not None:
            term = self.relative.bias(pos, cache.positions)  # [B|1, H, 1, length]
            term = term if isinstance(self.relative, Spectrum) else term.to(q.dtype)
        backend = "reference" if self.backend == "reference" else "sdpa"
        return self._weights_times_values(q, cache.keys, cache.values, term, None, False, backend), cache


class SoftmaxAttention(AttentionBase):
    """Exact multi-head softmax attention with an optional relative positional encoding.

    Args:
        dim, heads, pos_dim, causal: as every attention layer.
        relative_bias: the relative term: ``None``; a name in :data:`flt.relative.RELATIVE`
            (``"t5"`` / ``"clipped"``: a learned table over 1-D integer offsets; ``"alibi"``:
            ``-slope_h |r_i - r_j| / unit``, Euclidean for ``P > 1``; a spectrum's name, or
            ``"spectrum"`` with the family in ``relative_options["spectrum"]``: the exact mask
            ``f`` of that spectrum, learned, any ``P``; any other registered term) built with
            ``relative_options``; or a :class:`flt.relative.RelativeTerm` module. The term is
            ``layer.relative``; its ``bias(pos_q, pos_k)`` is what the layer adds.
        relative_options: the options of the term built by name (e.g. ``{"max_distance": 64,
            "table_scale": 1.0, "learn_scale": False}`` for a table, ``{"unit": 0.5,
            "learnable": True}`` for ALiBi; a spectrum's ``amplitude`` defaults to 0 for
            logit, 1 for multiplicative).
        coupling: with a spectrum: ``"logit"`` adds ``f`` to the logits,
            ``"multiplicative"`` multiplies the weights by ``f`` (computed by the reference
            backend, since it is not a softmax).
        rope, rope_base: rotate queries and keys by RoPE at ``pos`` (1-D or axial).
        backend: ``"sdpa"`` (default), ``"flex"`` (FlexAttention, the relative term as a
            ``score_mod`` (:meth:`flt.relative.RelativeTerm.score_mod`), so no ``[N, N]`` bias
            is formed; raises where it cannot run, e.g. backward on CPU) or ``"reference"``. :meth:`step` attends one query with
            SDPA, or with the reference backend when ``backend="reference"``.

    :meth:`from_options` takes the flat options of presets and the command line
    (``relative_bias="t5", max_distance=64``; :func:`flt.layers.flat.softmax` lists them): the tables'
    ``max_distance``, ``num_buckets``, ``table_scale`` (default 16: it multiplies the bias's
    effective learning rate, :class:`flt.posenc.RelativeBiasTable`) and
    ``learn_table_scale``; ALiBi's ``alibi_unit`` (the distance counted as one step, e.g.
    ``2 / n`` for the ``n x n`` patch centres on ``[-1, 1]^2``) and ``alibi_learnable``
    (log slopes learned from :func:`flt.posenc.alibi_slopes`; fixed by default, as in the
    paper); and the spectrum's ``spectrum``, ``num_frequencies`` (unused by the exact mask,
    kept so the spectrum matches an FLT layer's) and ``**spectrum_options``.

    Causal layers decode (``supports_decoding`` is True for them): :meth:`prefill` takes a
    prompt in one pass and returns its :class:`KVCache`, :meth:`step` one token at a time.
    ``exact`` is ``reference``. The mechanism is ``layer.core``, a :class:`SoftmaxCore`.
    """

    registry_name = "softmax"
    #: Its flat options and how they become its parts (:mod:`flt.layers.flat`).
    flat_builder = staticmethod(flat.softmax)
    core_class = SoftmaxCore
    core: SoftmaxCore
    size_options: ClassVar[tuple[str, ...]] = ("num_frequencies", "max_distance", "num_buckets", "hidden")

    @classmethod
    def takes_spectrum_options(cls, options: dict) -> bool:
        """Only with ``relative_bias="spectrum"`` (:mod:`flt.layers.rules` refuses a
        spectrum's options with another relative term)."""
        return super().takes_spectrum_options(options) and cls.option(options, "relative_bias") == "spectrum"

    @classmethod
    def parameter_values(cls, options: dict, *, dim: int, heads: int, pos_dim: int = 1) -> int:
        """The projections and the relative term's: a spectrum's frequencies and parameters
        ``4 H R P`` and a neural spectrum's MLP, a T5 table's ``H num_buckets``, a clipped
        table's ``H (2 max_distance + 1)`` (each counted whichever ``relative_bias`` is chosen)."""
        r, buckets = size(cls.option(options, "num_frequencies")), size(cls.option(options, "num_buckets"))
        distance = size(cls.option(options, "max_distance"))
        return (super().parameter_values(options, dim=dim, heads=heads, pos_dim=pos_dim) + 4 * heads * r * max(pos_dim, 1)
                + spectrum_values(cls, options, heads=heads, pos_dim=pos_dim) + heads * buckets + heads * (2 * distance + 1))

    #: Causal instances decode from a KV cache (set per instance in ``__init__``).
    supports_decoding = True
    relative = OfCore[RelativeTerm | None]("The relative term (``layer.core.relative``), or None.")
    spectrum = OfCore[Spectrum | None]('The relative term when it is a spectrum (``relative_bias="spectrum"``), else None.')
    table = OfCore[RelativeTerm | None]("The relative term when it is a T5 or clipped table, else None.")
