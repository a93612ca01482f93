"""Shared machinery of the kernelized (linear) attention cores and layers: Performer, FLT, Toeplitz.

:class:`KernelCore` holds the learned parts and computes on queries, keys and values; a
:class:`KernelAttention` layer is its projections plus such a core. A kernel core scales queries and keys (optionally L2-normalised with a learned
temperature, optionally rotated by RoPE), maps them to nonnegative features and runs
:func:`flt.ops.linear_attention` or the Kronecker :func:`flt.ops.flt_attention`.
Subclasses decide the features through :meth:`KernelCore.features`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from flt._checks import check_choice, check_positive_int, check_state_position, shown
from flt.layers.base import AttentionBase, CoreBase, OfCore, Prepared, QKScaling, size
from flt.layers.draws import redraw
from flt.layers.features import FeatureMap
from flt.layers.parts import FavorPlus, Features, Settings, check_kernel_parts
from flt.layers.rules import Facts, check_rules
from flt.ops.linear import (
    DEFAULT_CHUNK_SIZE,
    RecurrentState,
    flt_attention,
    full_precision,
    linear_attention,
    recurrent_step,
)
from flt.ops.reference import (
    flt_attention_reference,
    linear_attention_reference,
    rpe_attention_reference,
)
from flt.posenc.rope import apply_rope

#: How a kernel layer computes its forward pass: ``"torch"`` (the PyTorch ops of
#: :mod:`flt.ops.linear`, any device) or ``"triton"`` (the kernels of :mod:`flt.ops.triton`:
#: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; FAVOR+ features only). On an
#: H200 at m = 256 the kernels' forward was 10-18x slower than ``"torch"`` (fwd+bwd 7-8x) (docs/performance.md): on
#: a GPU, ``torch.compile`` of the ``"torch"`` path is the fast one. ``"triton-split"``: the
#: feature-split kernel (:mod:`flt.ops.triton.split`; Performer and FLT's logit coupling,
#: with a band too, :func:`flt.ops.triton.band.band_attention_split`, and the multiplicative
#: coupling composed from its sums, :func:`flt.ops.triton.split.favor_attention_split_kronecker`),
#: written to be the fast one and not yet timed.
KERNEL_BACKENDS = ("torch", "triton", "triton-split")


@dataclass
class DecodeState:
    """Constant-size state of a causal linear layer decoding token by token."""

    inner: RecurrentState | None = None
    position: int = 0


@dataclass
class KernelFeatures:
    """Features of one forward call: ``a, c`` are None for plain linear attention."""

    q: torch.Tensor  # [B, H, N, m]
    k: torch.Tensor  # [B, H, N, m]
    key_log_scale: torch.Tensor | None  # [B, H, N]
    a: torch.Tensor | None = None  # [B|1, H, N, 2R]
    c: torch.Tensor | None = None


def mask_padded_keys(feats: KernelFeatures, pad: torch.Tensor | None) -> KernelFeatures:
    """Zero the features of padded keys (``pad [B, N]``) and keep their log scale out of any max."""
    if pad is None:
        return feats
    kf = feats.k * (~pad[:, None, :, None])
    kls = feats.key_log_scale
    if kls is not None:
        floor = kls.detach().amin(dim=-1, keepdim=True)
        kls = torch.where(pad[:, None, :], floor, kls)
    return KernelFeatures(feats.q, kf, kls, feats.a, feats.c)


class KernelCore(CoreBase):
    """Base of the linear cores: the kernel features and settings parts
    (:mod:`flt.layers.parts`; ``features`` default :class:`~flt.layers.parts.FavorPlus`,
    ``settings`` default :class:`~flt.layers.parts.Settings`), as
    :class:`flt.layers.performer.PerformerAttention` takes them. ``feature_dim`` is the size of
    the feature map's inputs, ``head_dim`` unless a subclass joins more inputs to the queries
    and keys (FLT's logit coupling, :class:`flt.layers.flt.FLTCore`).

    ``redraw_interval=k`` (default ``None``: off) is for training loops of one's own: in
    training mode every ``k``-th forward call (counted by the persistent buffer
    ``redraw_calls``) first calls :func:`flt.layers.draws.redraw` on the core, which
    redraws all its draws (projection and spectrum). ``flt train`` does not need it: it
    redraws the whole model every ``RunConfig.redraw_interval`` steps through the same
    function.

    ``backend="triton"`` computes ``forward`` by :func:`flt.ops.triton.favor_attention`
    (features made inside the kernel; the backward pass recomputes through the PyTorch ops)
    and raises, naming the fix, on CPU tensors outside triton's interpreter;
    ``backend="triton-split"`` by the feature-split kernels (``split_features=True``; for the
    multiplicative coupling their sums of values widened by ``c``, read with ``a``), whose
    backward is a kernel too. Decoding
    (:meth:`step`, :meth:`prefill`) and :meth:`reference` use the PyTorch ops."""

    supports_decoding = True

    def __init__(self, heads: int, head_dim: int, *, pos_dim: int = 1, causal: bool = False, features: Features | None = None,
                 settings: Settings | None = None, feature_dim: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(heads, head_dim, pos_dim=pos_dim, causal=causal)
        features = FavorPlus() if features is None else features
        settings = Settings() if settings is None else settings
        check_kernel_parts(features, settings)
        check_choice("backend", settings.backend, KERNEL_BACKENDS)
        check_rules(Facts(features=features.kind, backend=settings.backend, rope=settings.rope, head_dim=head_dim, pos_dim=pos_dim))
        self.kernel, self.settings, self.backend = features, settings, settings.backend
        chunk_size = settings.chunk_size
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int, or None for the default chosen from the shapes; got {shown(chunk_size)}")
        self.rope, self.rope_base, self.chunk_size = bool(settings.rope), settings.rope_base, chunk_size
        self.scaling = QKScaling(heads, head_dim, qk_norm=features.qk_norm, temperature=features.temperature, device=device, dtype=dtype)
        self.feature_map = features.build(feature_dim or head_dim, device=device, dtype=dtype)
        self.redraw_calls: torch.Tensor  # a buffer where redraw_interval is set
        redraw_interval = settings.redraw_interval
        if redraw_interval is not None:
            check_positive_int("redraw_interval", redraw_interval)
            self.register_buffer("redraw_calls", torch.zeros((), dtype=torch.long, device=device), persistent=True)
        self.redraw_interval = redraw_interval

    def step_schedule(self) -> None:
        """Count a training forward call and, every ``redraw_interval`` calls, redraw the
        core's draws with :func:`flt.layers.draws.redraw` (from the feature map's seeded
        generator, or torch's global one)."""
        if self.training and self.redraw_interval is not None:
            if int(self.redraw_calls) > 0 and int(self.redraw_calls) % self.redraw_interval == 0:
                redraw(self, self.feature_map._generator)
            self.redraw_calls += 1

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # Before the redraw protocol the counter was the feature map's ``calls``.
        legacy = state_dict.get(prefix + "feature_map.calls")
        if legacy is not None and self.redraw_interval is not None:
            state_dict.setdefault(prefix + "redraw_calls", legacy)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def scaled_qk(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_q, x_k)`` with the kernel ``exp(x_q.x_k)``; RoPE rotates before scaling."""
        if self.rope:
            q = apply_rope(q, pos, base=self.rope_base)
            k = apply_rope(k, pos, base=self.rope_base)
        return self.scaling(q, k)

    def features(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> KernelFeatures:
        xq, xk = self.scaled_qk(q, k, pos)
        qf, _ = self.feature_map(xq)
        kf, kls = self.feature_map(xk)
        return KernelFeatures(qf, kf, kls)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H, N, Dv]`` by the fast op (after the redraw schedule's count)."""
        self.step_schedule()
        return self.attend(Prepared(q, k, v, pos, pad))

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                  pad: torch.Tensor | None = None) -> torch.Tensor:
        """The same features through the O(N^2) quadratic formula (the fast path's reference)."""
        return self.attend(Prepared(q, k, v, pos, pad), reference=True)

    def exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              pad: torch.Tensor | None = None) -> torch.Tensor:
        """The attention the features estimate, with the same parameters: softmax
        ``softmax(x_q.x_k)`` for FAVOR+, the arc-cosine kernel for ``"relu"``, and for the
        deterministic ``"elu"``, ``"taylor"`` and ``"hedgehog"`` maps their own kernel (so ``exact`` equals
        ``forward``)."""
        xq, xk = self.scaled_qk(q, k, pos)
        mask = self.padding_mask_matrix(pad, xq.dtype)
        return self.exact_attention(xq, xk, v.to(xq.dtype), mask=mask)

    def attend(self, p: Prepared, *, reference: bool = False) -> torch.Tensor:
        """``[B, H, N, Dv]`` from projected inputs, by the fast op or (``reference``) its
        O(N^2) formula. Subclasses with another estimator override this."""
        if self.backend in ("triton", "triton-split") and not reference:
            return self.attend_triton(p)
        return self.attend_features(mask_padded_keys(self.features(p.q, p.k, p.pos), p.pad), p, reference=reference)

    def attend_triton(self, p: Prepared) -> torch.Tensor:
        """``[B, H, N, Dv]`` by the Triton kernel, from the scaled queries and keys and
        :meth:`triton_inputs`."""
        from flt.ops.triton import favor_attention

        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        key_mask = None if p.pad is None else ~p.pad
        projection = self.feature_map.projection
        assert projection is not None  # rule triton_needs_favor: the Triton kernel is FAVOR+'s
        return favor_attention(xq, xk, p.v, projection, causal=self.causal, key_mask=key_mask,
                               split_features=self.backend == "triton-split", **self.triton_inputs(p.pos))

    def triton_inputs(self, pos: torch.Tensor) -> dict[str, Any]:
        """What the kernel joins to the queries and keys (none for a Performer)."""
        return {}

    def attend_features(self, f: KernelFeatures, p: Prepared, *, reference: bool = False) -> torch.Tensor:
        """``[B, H, N, Dv]`` of the values ``p.v`` weighted by the features ``f``."""
        if f.a is None:
            if reference:
                return linear_attention_reference(f.q, f.k, p.v, causal=self.causal, key_log_scale=f.key_log_scale)
            return linear_attention(f.q, f.k, p.v, causal=self.causal, key_log_scale=f.key_log_scale, chunk_size=self.chunk_size)
        assert f.c is not None  # the far-field features come as a pair
        if reference:
            return flt_attention_reference(f.q, f.k, p.v, f.a, f.c, causal=self.causal, key_log_scale=f.key_log_scale)
        return flt_attention(f.q, f.k, p.v, f.a, f.c, causal=self.causal, key_log_scale=f.key_log_scale, chunk_size=self.chunk_size)

    def exact_attention(self, xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """O(N^2) attention with the exact kernel the feature map estimates (``exp(x_q.x_k)``
        for FAVOR+, :meth:`flt.layers.features.FeatureMap.exact_kernel` otherwise), times
        ``mask`` and ``exp(bias)``, normalised over the keys: the core of ``exact()``."""
        kernel = self.feature_map.exact_kernel(xq, xk)
        if kernel is None:
            return rpe_attention_reference(xq, xk, v, mask=mask, bias=bias, causal=self.causal, scale=1.0)
        if bias is not None:
            raise ValueError(f"a logit bias needs the exponential kernel (feature_map='favor+'), this map is {self.feature_map.kind!r}")
        weights = kernel if mask is None else kernel * mask
        # Zero logits: the weights are the kernel times the mask.
        zq, zk = xq.new_zeros(*xq.shape[:-1], 1), xk.new_zeros(*xk.shape[:-1], 1)
        return rpe_attention_reference(zq, zk, v, mask=weights, causal=self.causal, scale=1.0)

    def step_offset(self, state: Any) -> int:
        """The next token's default position; the state must be this core's :class:`DecodeState`."""
        self.check_decoding("step")
        if state is None:
            return 0
        if not isinstance(state, DecodeState):
            raise TypeError(f"state must be the DecodeState of the previous step (or None), got {type(state).__name__}")
        return check_state_position("DecodeState", state)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: DecodeState | None,
             pos: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
        """One token with constant memory (``causal=True`` only): ``q, k [B, H, 1, D]``,
        ``v [B, H, 1, Dv]``, ``pos [B|1, 1, P]`` -> ``(out [B, H, 1, Dv], state)``;
        feeding a sequence token by token gives the outputs of the causal forward."""
        self.check_decoding("step")
        state = state or DecodeState()
        f = self.features(q, k, pos)
        first = lambda t: None if t is None else t[:, :, 0]  # noqa: E731
        out, inner = recurrent_step(
            f.q[:, :, 0], f.k[:, :, 0], v[:, :, 0], state.inner, a=first(f.a), c=first(f.c), key_log_scale=first(f.key_log_scale)
        )
        return out.unsqueeze(2), DecodeState(inner, state.position + 1)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, DecodeState]:
        """The causal attention of a prompt and the state :meth:`step` continues from
        (``causal=True`` only): ``(out [B, H, N, Dv], state)``, ``out`` that of
        :meth:`forward` and ``state`` the linear state of the whole prompt. Padded keys
        (``pad``) are in neither."""
        self.check_decoding("prefill")
        p = Prepared(q, k, v, pos, pad)
        f = mask_padded_keys(self.features(q, k, pos), pad)
        return self.attend_features(f, p), DecodeState(linear_state(f, v, self.chunk_size), q.shape[2])


class KernelAttention(AttentionBase):
    """Base of the linear layers: projections plus a :class:`KernelCore` (``self.core``)."""

    supports_decoding = True
    size_options: ClassVar[tuple[str, ...]] = ("num_features", "chunk_size")
    core: KernelCore
    feature_map = OfCore[FeatureMap]("The core's kernel features (``layer.core.feature_map``).")
    scaling = OfCore[QKScaling]("The core's query and key scaling (``layer.core.scaling``).")

    @classmethod
    def parameter_values(cls, options: dict, *, dim: int, heads: int, pos_dim: int = 1) -> int:
        """The projections, the random feature projection (``m x`` its input ``D``) and a
        relative table of ``H (2 max_distance + 1)`` values (``max_distance`` 0 without one)."""
        head_dim = max(dim // max(heads, 1), 1)
        m, distance = size(cls.option(options, "num_features")), size(cls.option(options, "max_distance"))
        return (super().parameter_values(options, dim=dim, heads=heads, pos_dim=pos_dim) + m * head_dim
                + heads * (2 * distance + 1))

    @classmethod
    def forward_values(cls, options: dict, *, batch: int, heads: int, length: int, head_dim: int) -> int:
        """The features of queries and keys, ``2 B H N m``, and the state ``B H m Dv``."""
        m = size(cls.option(options, "num_features"), 1)
        return 2 * batch * heads * length * m + batch * heads * m * head_dim


def linear_state(f: KernelFeatures, v: torch.Tensor, chunk_size: int | None = None) -> RecurrentState:
    """The :class:`flt.ops.linear.RecurrentState` after keys ``f.k [B, H, N, m]`` (with
    ``f.c``, ``f.key_log_scale``) and values ``v [B, H, N, Dv]``: what
    :func:`flt.ops.linear.recurrent_step` accumulates token by token, in one sum over ``N``
    relative to the largest key log scale (in chunks of ``chunk_size`` tokens, which bounds
    the ``[chunk, 2R, m]`` products of the multiplicative coupling)."""
    with full_precision(f.k, f.c is not None):
        return _linear_state(f, v, chunk_size)


def _linear_state(f: KernelFeatures, v: torch.Tensor, chunk_size: int | None) -> RecurrentState:
    kf = f.k
    B, H, N, m = kf.shape
    dtype = torch.promote_types(torch.promote_types(f.q.dtype, kf.dtype), v.dtype)
    kf, v = kf.to(dtype), v.to(dtype)
    if f.key_log_scale is None:
        level = kf.new_zeros(B, H)
    else:
        kls = f.key_log_scale.to(dtype)
        level = kls.amax(dim=-1)
        kf = kf * torch.exp(kls - level.unsqueeze(-1)).unsqueeze(-1)
    c = kf.new_ones(1, H, N, 1) if f.c is None else f.c.to(dtype)  # plain linear attention: 2R = 1
    c = c.expand(B, H, N, c.shape[-1])
    kv = kf.new_zeros(B, H, c.shape[-1], m, v.shape[-1])
    step = chunk_size or DEFAULT_CHUNK_SIZE
    for s in range(0, N, step):
        e = min(s + step, N)
        kv += torch.einsum("bhnr,bhnm,bhnd->bhrmd", c[:, :, s:e], kf[:, :, s:e], v[:, :, s:e])
    z = torch.einsum("bhnr,bhnm->bhrm", c, kf)
    return RecurrentState(kv.flatten(-2), z, level, N)  # kv: [B, H, 2R, m*Dv]
