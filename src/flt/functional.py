"""Attention cores without projections: ``attention(q, k, v, *, pos=None, core=...)``.

A user who has their own projections (a model of their own, a converted Hugging Face
decoder, :mod:`flt.integrations.transformers`) passes queries, keys and values
``[B, H, N, D]`` and gets ``[B, H, N, Dv]`` back. Every mechanism of
:data:`flt.layers.ATTENTION` is available: FLT in both couplings with its near sets
(``near_field``, ``near_neighbors``), Performer, Toeplitz, and softmax with any relative
term. An :class:`AttentionCore` holds only the learned parts of its mechanism (the
spectrum, the feature map and its projection, the tables, the query-key scaling), never
the ``to_qkv`` / ``to_out`` projections of the layer.

Every layer of :data:`flt.layers.ATTENTION` is its projections plus a mechanism core
(``layer.core``: :class:`flt.layers.flt.FLTCore`, :class:`~flt.layers.performer.PerformerCore`,
:class:`~flt.layers.toeplitz.ToeplitzCore`, :class:`~flt.layers.softmax.SoftmaxCore`), and an
:class:`AttentionCore` holds one such core (``core.attention``, the name its state-dict keys
have always had) and checks the caller's inputs before calling it. The layer and the core run
the same code on the same projected inputs, so they agree to the last bit
(tests/library/test_functional.py); :meth:`AttentionCore.from_layer` holds the layer's own core.
:meth:`AttentionCore.weights` gives the ``N x N`` attention weights the output is made of
(the weights ``flt linearize --transfer weights`` matches to a softmax model's).

Shapes: ``q [B, H, Nq, D]``, ``k [B, H, N, D]``, ``v [B, H, N, Dv]``, positions
``pos [B, N, P]``, ``[N, P]`` or ``[B, N]`` (integer position ids, ``P = 1``), None for
token indices; ``key_padding_mask [B, N]`` (bool, True marks padding). ``Nq < N`` is
allowed for causal cores only: the queries are then the last ``Nq`` tokens (decoding
against cached keys), computed as the last rows of the full causal attention. No token
(``N = 0``) or no query (``Nq = 0``) gives the empty output ``[B, H, Nq, Dv]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from flt._checks import check_choice, check_positions, check_tensor
from flt._dtype import compute_dtype
from flt.layers.base import AttentionBase, CoreBase, token_positions
from flt.layers.registry import ATTENTION

__all__ = ["DEFAULT_SEED", "AttentionCore", "attention"]

#: The seed of the random draws (features, initial spectra) of a core that
#: :func:`attention` builds from a name without ``seed=``: the same call gives the same
#: output every time.
DEFAULT_SEED = 0


class AttentionCore(nn.Module):
    """The learned parts of one attention mechanism, called on queries, keys and values.

    Args:
        mechanism: a name in :data:`flt.layers.ATTENTION` (``"flt"``, ``"performer"``,
            ``"softmax"``, ``"toeplitz"``).
        heads, head_dim: ``H`` and ``D`` of the queries and keys.
        pos_dim, causal, device, dtype: as every attention layer.
        **options: the layer's options (``coupling``, ``near_field``, ``near_neighbors``,
            ``num_features``, ``relative_bias``, ``qk_norm``, ...), checked by name as the
            layer checks them.

    The mechanism's core (the ``core`` of the layer those options build) is
    ``self.attention``. :meth:`from_layer` holds the core of an existing layer, sharing its
    parameters.
    """

    #: Which method a converted ``transformers`` model calls (``"forward"``, ``"reference"``,
    #: ``"exact"``); set by :func:`flt.integrations.transformers.convert`, absent otherwise.
    path: str
    attention: CoreBase

    def __init__(self, mechanism: str = "flt", *, heads: int, head_dim: int, pos_dim: int = 1, causal: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, **options: Any) -> None:
        super().__init__()
        check_choice("mechanism", mechanism, sorted(ATTENTION))
        # The layer checks the options by name and draws what the layer draws; its projections are dropped.
        layer = ATTENTION[mechanism].from_options(heads * head_dim, heads, pos_dim=pos_dim, causal=causal, device=device, dtype=dtype, **options)
        self.mechanism_name = mechanism
        self.attention = layer.core

    @classmethod
    def from_checked_options(cls, mechanism: str, options: dict[str, Any], *, heads: int, head_dim: int, pos_dim: int = 1,
                             causal: bool = False, device: torch.device | str | None = None,
                             dtype: torch.dtype | None = None) -> AttentionCore:
        """The core ``AttentionCore(mechanism, heads=, ..., **options)`` builds, from
        ``options`` as :func:`flt.options.check_attention_options` returned them (with
        :data:`flt.options.ATTENTION_ARGUMENTS` reserved): built without checking them again,
        so that one set checked once builds a core per layer of a model (any other dict is
        checked here, as the constructor would)."""
        from flt.options import checked_once

        check_choice("mechanism", mechanism, sorted(ATTENTION))
        layer = ATTENTION[mechanism].from_checked_options(heads * head_dim, heads, pos_dim=pos_dim, causal=causal, device=device,
                                                          dtype=dtype, **checked_once(mechanism, options))
        return cls._holding(mechanism, layer.core)

    @classmethod
    def from_layer(cls, layer: nn.Module) -> AttentionCore:
        """The core of ``layer`` (an instance of a class in :data:`flt.layers.ATTENTION`):
        ``layer.core`` itself, shared (training the core trains the layer), without the
        layer's projections. The train/eval mode is shared too: ``.eval()`` on the returned
        core also stops the layer's redraw schedule (``redraw_interval``) while the layer
        itself stays in training mode, and ``layer.train()`` restarts it."""
        names = {type_: name for name, type_ in ATTENTION.items()}
        if not isinstance(layer, AttentionBase) or type(layer) not in names:  # (every entry is one)
            raise TypeError(f"layer must be an instance of a class in flt.layers.ATTENTION, got {type(layer).__name__}")
        return cls._holding(names[type(layer)], layer.core)

    @classmethod
    def _holding(cls, mechanism: str, attention: CoreBase) -> AttentionCore:
        """An instance holding the core ``attention`` of ``mechanism``, built by neither
        constructor (the classmethods build their layer themselves)."""
        core = cls.__new__(cls)
        nn.Module.__init__(core)
        core.mechanism_name = mechanism
        core.attention = attention
        return core

    @property
    def heads(self) -> int:
        return self.attention.heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def causal(self) -> bool:
        return self.attention.causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H, Nq, Dv]``: the mechanism's estimator (the core's ``forward``)."""
        return self._run("forward", q, k, v, pos, key_padding_mask)

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same computation by the O(N^2) reference formula (the core's ``reference``)."""
        return self._run("reference", q, k, v, pos, key_padding_mask)

    def exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The O(N^2) attention the mechanism estimates, with the same parameters (the
        core's ``exact``: for FLT's logit coupling ``softmax(x_q.x_k + f)``)."""
        return self._run("exact", q, k, v, pos, key_padding_mask)

    def weights(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, *, path: str = "forward") -> torch.Tensor:
        """``[B, H, Nq, N]``: the normalised attention weights ``w_ij`` this core gives
        query ``i`` and key ``j``, so that its output is ``weights @ v`` (``O(N^2)`` memory).

        ``path="forward"`` (or ``"reference"``) gives the weights of the estimator (the
        kernel features' ``phi(q_i).phi(k_j)`` row-normalised; with FLT's band the exact
        weights on the band and the estimate beyond it); ``"exact"`` those of the attention
        it estimates (:meth:`exact`). No new formula: they are the core's own ``O(N^2)``
        reference (or exact) formula applied to the values ``v = I`` (``[B, H, N, N]``),
        whose output row ``i`` is ``sum_j w_ij e_j``; this costs ``O(N^2 (D + N))`` per head.
        Causal cores give zeros above the diagonal; each row sums to 1 (0 for a row whose
        keys are all padded or whose kernel values all vanish).

        Refused (``ValueError``): the multiplicative coupling (FLT's or softmax's), whose
        signed mask ``f`` makes the weights a ratio of signed sums rather than a
        distribution over the keys.
        """
        if getattr(self.attention, "coupling", "logit") == "multiplicative":
            raise ValueError(f"weights() of {self.mechanism_name!r} with coupling='multiplicative': its signed mask f "
                             "makes the weights signed, not a distribution over the keys; use coupling='logit'")
        methods = {"forward": "reference", "reference": "reference", "exact": "exact"}
        check_choice("path", path, sorted(methods))
        check_tensor("k", k, ndim=4, layout="[B, H, N, D]")
        n = k.shape[2]
        eye = torch.eye(n, device=k.device, dtype=compute_dtype(q)).expand(*k.shape[:2], n, n)
        return self._run(methods[path], q, k, eye, pos, key_padding_mask)

    def _run(self, method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        q, pos = self._check(q, k, v, pos)
        nq = q.shape[2]
        if nq == 0:  # no query (and for N = 0 no key either): nothing to attend with
            return v.new_zeros(*v.shape[:2], 0, v.shape[3])
        if nq < k.shape[2]:
            # Causal rows are independent: the last rows of the full attention are these
            # queries' outputs, whatever the earlier (zero) queries are.
            q = torch.cat([q.new_zeros(*q.shape[:2], k.shape[2] - nq, q.shape[3]), q], dim=2)
        out = getattr(self.attention, method)(q, k, v, pos, key_padding_mask)
        return out[:, :, -nq:].to(v.dtype)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """The causal attention of a prompt and the state :meth:`step` continues from
        (the core's ``prefill``: for the kernel mechanisms the constant-size linear state,
        with FLT's band also the last ``w + 1`` keys and values; for softmax a KV cache):
        ``(out [B, H, N, Dv], state)``. ``key_padding_mask [B, N]`` (True marks padding;
        kernel mechanisms only) keeps padded keys out of both: a batch of prompts padded on
        the left then decodes each row as its prompt alone."""
        self._check_decoding("prefill", q, k)
        self.attention.check_prefill(key_padding_mask)
        q, pos = self._check(q, k, v, pos)
        if q.shape[2] == 0:
            raise ValueError("prefill() needs a prompt of at least one token (q, k, v have N = 0); start from step() with state=None")
        out, state = self.attention.prefill(q, k, v, pos, key_padding_mask)
        return out.to(v.dtype), state

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any = None, pos: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """One decoding step from ``state`` (None to start): ``q, k [B, H, 1, D]``, ``v [B,
        H, 1, Dv]``, ``pos [B|1, 1, P]``, ``[B, 1]`` position ids or None (the next token
        index) -> ``(out [B, H, 1, Dv], state)``; token by token equals the causal forward."""
        self._check_decoding("step", q, k)
        if q.shape[2] != 1:
            raise ValueError(f"step() takes one token (q [B, H, 1, D]), got q {tuple(q.shape)}; use prefill() for a prompt")
        offset = self.attention.step_offset(state)
        if pos is not None:
            pos = positions(pos, batch=q.shape[0], length=1, pos_dim=self.attention.pos_dim, like=q)
        self._check(q, k, v, pos)
        if pos is None:
            if self.attention.pos_dim != 1:
                raise ValueError(f"pos is required when pos_dim = {self.attention.pos_dim} (token indices only serve P = 1)")
            pos = token_positions(1, q, offset)
        out, state = self.attention.step(q, k, v, state, pos)
        return out.to(v.dtype), state

    def _check_decoding(self, what: str, q: torch.Tensor, k: torch.Tensor) -> None:
        if not (self.causal and self.attention.supports_decoding):
            raise ValueError(f"{what}() needs a causal core of a mechanism that decodes ({self.mechanism_name!r}, causal={self.causal})")
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"{what}() takes as many queries as keys (the new tokens); got {q.shape[2]} and {k.shape[2]}")

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, ndim=4, layout="[B, H, N, D]")
        B, H, nq, D = q.shape
        N = k.shape[2]
        if (H, D) != (self.heads, self.head_dim):
            raise ValueError(f"q has H = {H} heads of size D = {D}; this core was built for heads={self.heads}, head_dim={self.head_dim}")
        if k.shape[:2] != (B, H) or k.shape[3] != D or v.shape[:3] != (B, H, N):
            raise ValueError(f"k must be [B, H, N, D] = [{B}, {H}, N, {D}] and v [B, H, N, Dv] with the same N; got k {tuple(k.shape)}, v {tuple(v.shape)}")
        if nq > N or (nq < N and not self.causal):
            raise ValueError(f"q has {nq} tokens and k {N}: fewer queries than keys (the last tokens) needs a causal core")
        return q, positions(pos, batch=B, length=N, pos_dim=self.attention.pos_dim, like=q)


def positions(pos: torch.Tensor | None, *, batch: int, length: int, pos_dim: int, like: torch.Tensor) -> torch.Tensor:
    """``pos`` as ``[B|1, N, P]`` in the compute dtype of ``like``: token indices for None,
    ``[B, N]`` integer position ids (Hugging Face's ``position_ids``) as ``P = 1``."""
    dtype = compute_dtype(like)
    if pos is None:
        if pos_dim != 1:
            raise ValueError(f"pos is required when pos_dim = {pos_dim} (token indices only serve P = 1)")
        return torch.arange(length, device=like.device, dtype=dtype).view(1, length, 1)
    if not isinstance(pos, torch.Tensor):
        raise TypeError(f"pos must be a tensor [B, N, P], [N, P] or [B, N] (position ids), got {type(pos).__name__}")
    if not pos.is_floating_point():
        pos = (pos.unsqueeze(-1) if pos.ndim == 2 else pos).to(dtype)  # [B, N] are position ids
    if pos.ndim in (2, 3) and pos.shape[-1] != pos_dim:
        raise ValueError(f"pos has position dimension P = {pos.shape[-1]} (shape {tuple(pos.shape)}), but the core was built "
                         f"for pos_dim = {pos_dim}; pass pos_dim={pos.shape[-1]} (attention(..., pos_dim={pos.shape[-1]}) or "
                         f"AttentionCore(..., pos_dim={pos.shape[-1]}))")
    return check_positions("pos", pos, batch=batch, length=length, pos_dim=pos_dim).to(device=like.device, dtype=dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, core: AttentionCore | str, pos: torch.Tensor | None = None,
              causal: bool | None = None, key_padding_mask: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
    """Attention of ``q [B, H, Nq, D]`` on ``k [B, H, N, D]``, ``v [B, H, N, Dv]`` at
    positions ``pos``: ``[B, H, Nq, Dv]``.

    ``core`` is required, since no mechanism is every caller's: an :class:`AttentionCore`
    (its learned parts are used and trained), or the name of a mechanism, for which a
    fresh core is built from ``causal``, ``pos_dim`` and ``options`` (a learned term at its
    initial value): ``attention(q, k, v, core="softmax", causal=True)`` is causal softmax,
    ``attention(q, k, v, core="flt")`` FLT at initialisation. A core built from a name
    draws its random parts (features, initial spectra) from ``seed`` when given, else
    from :data:`DEFAULT_SEED`, so a call gives the same output every time; the caller's
    random state (CPU, and the CUDA device of ``q``) is left as it was.
    """
    if isinstance(core, str):
        with _default_draws(q.device):
            core = AttentionCore(core, heads=q.shape[1], head_dim=q.shape[-1], causal=bool(causal), device=q.device,
                                 dtype=q.dtype if q.is_floating_point() else None, **options)
    elif not isinstance(core, AttentionCore):
        raise TypeError(f"core must be an AttentionCore or a mechanism name in {sorted(ATTENTION)}, got {type(core).__name__}")
    elif options or causal is not None:
        raise ValueError(f"causal and options ({sorted(options)}) build a core from a name; core {core.mechanism_name!r} was built with its own")
    return core(q, k, v, pos, key_padding_mask)


@contextlib.contextmanager
def _default_draws(device: torch.device) -> Iterator[None]:
    """Draws from torch's generators seeded with :data:`DEFAULT_SEED` (those of the CPU and
    of ``device`` when it is a CUDA device), restored to their state before on exit."""
    cuda = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(DEFAULT_SEED)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(DEFAULT_SEED)
        yield
