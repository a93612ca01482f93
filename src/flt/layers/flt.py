"""FLTAttention: linear attention with a learned relative positional encoding (FLT).

The RPE mask ``f(r_i - r_j)`` is the Fourier transform of a learned spectrum (see
:mod:`flt.spectra`), estimated with random frequencies as ``a(r_i) . c(r_j)``. Two couplings
(MATH.md sections 4 and 5):

* ``"logit"`` (default): FAVOR+ on ``[x_q, a(r_i)]`` and ``[x_k, c(r_j)]`` estimates
  ``exp(x_q.x_k + f(r_i - r_j))``: softmax attention with a learned relative bias, at the
  cost of plain FAVOR+ with ``D + 2R`` input dimensions. Spectra start at ``f = 0``, so a
  fresh layer is exactly a Performer.
* ``"multiplicative"``: ``f(r_i - r_j) * phi(q_i).phi(k_j)``, the FLT paper's mask, computed
  exactly for the given features through Kronecker features in ``O(N 2R m Dv)``. Spectra
  start near ``f = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from flt._checks import check_choice, check_tensor
from flt.layers.base import AttentionBase, QKScaling
from flt.layers.features import FeatureMap
from flt.ops.linear import DEFAULT_CHUNK_SIZE, RecurrentState, flt_attention, linear_attention, recurrent_step
from flt.ops.reference import rpe_attention_reference
from flt.spectra import SPECTRA

COUPLINGS = ("logit", "multiplicative")


@dataclass
class DecodeState:
    """Constant-size state of a causal linear layer decoding token by token."""

    inner: RecurrentState | None = None
    position: int = 0


def mask_padded_keys(kf: torch.Tensor, kls: torch.Tensor | None, pad: torch.Tensor | None):
    """Zero the features of padded keys (``pad [B, N]``) and keep their log scale out of any max."""
    if pad is None:
        return kf, kls
    keep = ~pad[:, None, :, None]
    kf = kf * keep
    if kls is not None:
        floor = kls.detach().amin(dim=-1, keepdim=True)
        kls = torch.where(pad[:, None, :], floor, kls)
    return kf, kls


class FLTAttention(AttentionBase):
    """Multi-head FourierLearner-Transformer attention, linear in the sequence length.

    Args:
        dim: model width; ``heads`` must divide it.
        heads: ``H``.
        pos_dim: ``P``, dimension of the positions (1 text, 2 patches, 3 atoms, ...).
        spectrum: a name in :data:`flt.spectra.SPECTRA`.
        coupling: ``"logit"`` or ``"multiplicative"`` (module docstring).
        num_features: ``m``, kernel features per head.
        num_frequencies: ``R``, random frequencies per head (features ``2R``).
        causal: token ``i`` attends to ``j <= i``; enables :meth:`step`.
        feature_map: ``"favor+"`` (default), ``"relu"`` or ``"elu"`` (multiplicative only:
            the logit coupling needs the exponential kernel).
        qk_norm: L2-normalise queries and keys with a learned temperature (default on for
            FAVOR+, whose error grows exponentially with ``|q|^2``).
        temperature: initial temperature for ``qk_norm``.
        orthogonal, redraw_interval, seed: passed to :class:`flt.layers.features.FeatureMap`.
        chunk_size: block size of the chunked computations.
        **spectrum_options: forwarded to the spectrum (``amplitude`` defaults to 0 for the
            logit coupling and 1 for the multiplicative one).

    Shapes: ``forward(x [B, N, dim], pos [B, N, P] | [N, P] | None, key_padding_mask [B, N])
    -> [B, N, dim]``.
    """

    supports_decoding = True

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        pos_dim: int = 1,
        spectrum: str = "gaussian_mixture",
        coupling: str = "logit",
        num_features: int = 256,
        num_frequencies: int = 32,
        causal: bool = False,
        feature_map: str = "favor+",
        qk_norm: bool | None = None,
        temperature: float = 2.0,
        orthogonal: bool = True,
        redraw_interval: int | None = None,
        seed: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        device=None,
        dtype=None,
        **spectrum_options,
    ) -> None:
        super().__init__(dim, heads, pos_dim=pos_dim, causal=causal, device=device, dtype=dtype)
        check_choice("coupling", coupling, COUPLINGS)
        check_choice("spectrum", spectrum, SPECTRA)
        if coupling == "logit" and feature_map != "favor+":
            raise ValueError(f"coupling='logit' needs feature_map='favor+' (it estimates exp(q.k + f)), got {feature_map!r}")
        self.coupling, self.chunk_size = coupling, chunk_size
        qk_norm = feature_map == "favor+" if qk_norm is None else qk_norm
        self.scaling = QKScaling(heads, self.head_dim, qk_norm=qk_norm, temperature=temperature, device=device, dtype=dtype)
        spectrum_options.setdefault("amplitude", 0.0 if coupling == "logit" else 1.0)
        self.spectrum = SPECTRA[spectrum](
            heads=heads, pos_dim=pos_dim, num_frequencies=num_frequencies, device=device, dtype=dtype, **spectrum_options
        )
        feat_dim = self.head_dim + 2 * num_frequencies if coupling == "logit" else self.head_dim
        self.feature_map = FeatureMap(
            feat_dim, num_features, kind=feature_map, orthogonal=orthogonal, redraw_interval=redraw_interval,
            seed=seed, device=device, dtype=dtype,
        )

    def _features(self, q, k, pos):
        """Kernel features (and, for the multiplicative coupling, spectral features)."""
        xq, xk = self.scaling(q, k)
        a, c = self.spectrum.features(pos)
        if self.coupling == "logit":
            B, H, N, _ = xq.shape
            cdt = torch.promote_types(xq.dtype, a.dtype)
            expand = (B, H, N, a.shape[-1])
            xq = torch.cat([xq.to(cdt), a.to(cdt).expand(expand)], dim=-1)
            xk = torch.cat([xk.to(cdt), c.to(cdt).expand(expand)], dim=-1)
            a = c = None
        qf, _ = self.feature_map(xq)
        kf, kls = self.feature_map(xk)
        return qf, kf, kls, a, c

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        p = self.prepare(x, pos, key_padding_mask)
        self.feature_map.step_schedule()
        qf, kf, kls, a, c = self._features(p.q, p.k, p.pos)
        kf, kls = mask_padded_keys(kf, kls, p.pad)
        if a is None:
            out = linear_attention(qf, kf, p.v, causal=self.causal, key_log_scale=kls, chunk_size=self.chunk_size)
        else:
            out = flt_attention(qf, kf, p.v, a, c, causal=self.causal, key_log_scale=kls, chunk_size=self.chunk_size)
        return self.finish(out, x)

    def exact(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The O(N^2) attention this layer approximates, with the same parameters.

        The exact softmax kernel ``exp(x_q.x_k)`` and the exact mask ``f`` of the spectrum:
        ``softmax(x_q.x_k + f)`` for the logit coupling, ``f * exp(x_q.x_k)`` normalised for
        the multiplicative one. As ``num_features`` and ``num_frequencies`` grow, ``forward``
        converges to this.
        """
        p = self.prepare(x, pos, key_padding_mask)
        xq, xk = self.scaling(p.q, p.k)
        cdt = torch.promote_types(xq.dtype, torch.float32)
        delta = p.pos.unsqueeze(2) - p.pos.unsqueeze(1)  # [B|1, N, N, P]
        f = rearrange(self.spectrum.mask(delta.to(cdt)), "b i j h -> b h i j")
        pad = self.padding_mask_matrix(p.pad, cdt)
        v = p.v.to(cdt)
        if self.coupling == "logit":
            out = rpe_attention_reference(xq.to(cdt), xk.to(cdt), v, bias=f, mask=pad, causal=self.causal, scale=1.0)
        else:
            mask = f if pad is None else f * pad
            out = rpe_attention_reference(xq.to(cdt), xk.to(cdt), v, mask=mask, causal=self.causal, scale=1.0)
        return self.finish(out, x)

    def step(self, x: torch.Tensor, state: DecodeState | None = None, pos: torch.Tensor | None = None):
        """Decode one token with constant memory (``causal=True`` only).

        Args:
            x: ``[B, dim]``, the next token.
            state: the state returned by the previous call (``None`` to start).
            pos: ``[B, P]`` or ``[P]``; defaults to the token index for ``P = 1``.

        Returns:
            ``(y [B, dim], state)``: feeding a sequence token by token gives the outputs of
            ``forward`` with ``causal=True``.
        """
        if not self.causal:
            raise ValueError("step() decodes causal attention; build the layer with causal=True")
        check_tensor("x", x, ndim=2, layout="[B, dim]")
        state = state or DecodeState()
        if pos is None:
            pos_seq = None
        else:
            check_tensor("pos", pos, ndim=(1, 2), layout="[B, P] or [P]")
            pos_seq = pos.reshape(-1, 1, pos.shape[-1])
        if pos_seq is None:
            pos_seq = self.default_positions(1, x, offset=state.position)
        p = self.prepare(x.unsqueeze(1), pos_seq, None)
        qf, kf, kls, a, c = self._features(p.q, p.k, p.pos)
        out, inner = recurrent_step(
            qf[:, :, 0], kf[:, :, 0], p.v[:, :, 0], state.inner,
            a=None if a is None else a[:, :, 0], c=None if c is None else c[:, :, 0],
            key_log_scale=None if kls is None else kls[:, :, 0],
        )
        return self.finish(out.unsqueeze(2), x.unsqueeze(1)).squeeze(1), DecodeState(inner, state.position + 1)
