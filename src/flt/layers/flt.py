"""FLTAttention: linear attention with a learned relative positional encoding (FLT).

The RPE mask ``f(r_i - r_j)`` is the Fourier transform of a learned spectrum (see
:mod:`flt.spectra`), estimated with random frequencies as ``a(r_i) . c(r_j)``. Two couplings
(docs/math.md sections 4 and 5):

* ``"logit"`` (default): FAVOR+ on ``[x_q, a(r_i)]`` and ``[x_k, c(r_j)]`` estimates
  ``exp(x_q.x_k + f(r_i - r_j))``: softmax attention with a learned relative bias, at the
  cost of plain FAVOR+ with ``D + 2R`` input dimensions. Spectra start at ``f = 0``, so a
  fresh layer is exactly a Performer.
* ``"multiplicative"``: ``f(r_i - r_j) * phi(q_i).phi(k_j)``, the FLT paper's mask, computed
  exactly for the given features through Kronecker features in ``O(N 2R m Dv)``. Spectra
  start near ``f = 1``.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange

from flt._checks import check_choice, check_nonnegative_int, compiling
from flt._dtype import compute_dtype
from flt.layers.band_decode import band_prefill, band_step
from flt.layers.base import batch_shared, regular_step
from flt.layers.kernel import KernelAttention, KernelFeatures, mask_padded_keys
from flt.ops.band import band_attention, band_attention_reference
from flt.ops.linear import kronecker_condition
from flt.ops.neighbors import near_offsets, nearest_keys, neighbor_attention, neighbor_attention_reference
from flt.spectra import SPECTRA

COUPLINGS = ("logit", "multiplicative")

#: The multiplicative coupling warns when the bound on its row condition numbers exceeds
#: this, or ``1 / u`` for inputs of unit roundoff ``u`` (:meth:`FLTAttention.check_conditioning`).
CONDITION_LIMIT = 1000.0


class ConditioningWarning(RuntimeWarning):
    """The multiplicative coupling's row sums cancel so much that rounding changes outputs."""


class FLTAttention(KernelAttention):
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
        feature_map: ``"favor+"`` (default), ``"relu"``, ``"elu"``, ``"taylor"`` or ``"hedgehog"``
            (learned features; multiplicative only: the logit coupling needs the exponential kernel).
        qk_norm: L2-normalise queries and keys with a learned temperature (default on for
            FAVOR+, whose error grows exponentially with ``|q|^2``).
        temperature: initial temperature for ``qk_norm``.
        orthogonal, seed: passed to :class:`flt.layers.features.FeatureMap`.
        redraw_interval: a layer-level redraw schedule of the projection and the spectrum's
            draws (:class:`flt.layers.kernel.KernelAttention`; ``flt train`` redraws by
            ``RunConfig.redraw_interval`` instead, see :mod:`flt.layers.draws`).
        rope, rope_base: also rotate queries and keys by RoPE at the same positions.
        chunk_size: block size of the chunked computations (None: chosen from the shapes,
            :func:`flt.ops.linear.causal_chunk_size` when causal).
        near_field: ``w >= 1`` turns on the banded estimator (logit coupling only): pairs
            with ``|i - j| <= w`` in token order get their exact weights
            ``exp(x_q.x_k + f(r_i - r_j) + f_near(r_i - r_j))``, all other pairs the FAVOR+
            estimate of ``exp(x_q.x_k + f)``. ``f_near`` is a second spectrum of the same
            family (its own parameters, also starting at 0) that acts only inside the
            band and is always evaluated exactly, so a strong local bias costs no
            variance; ``f`` is the far-field bias, estimated by random features as
            without ``near_field``. ``0`` (default) turns it off. The band follows token
            order: for sequences, not for sets (atoms). Cost ``O(N T (D + Dv))``
            with blocks of ``T = max(w, 16)`` tokens on top of the linear part (causal: the
            far field is the chunked scan of plain FLT, keys delayed by ``w + 1`` tokens); see
            :func:`flt.ops.band.band_attention` and docs/math.md section 5.1. Causal layers
            with a band decode token by token in constant memory (:meth:`step`,
            :mod:`flt.layers.band_decode`: the last ``w + 1`` tokens and the far field's state).
        near_neighbors: ``k >= 1`` turns on the spatial near field instead (either coupling,
            ``causal=False``; exclusive with ``near_field``): each query's ``k`` nearest keys
            in position space (itself included, padded keys excluded, ``min(k, N)`` for
            shorter sets) get their exact weights with the mask ``f + f_near`` (logit:
            ``exp(x_q.x_k + f + f_near)``; multiplicative: ``(f + f_near) exp(x_q.x_k)`` with
            FAVOR+, ``(f + f_near) phi(x_q).phi(x_k)`` with any other ``feature_map``, the
            far field's kernel), all other pairs the random-feature estimate, as for the band. For sets of atoms or image patches, whose
            token order means nothing. The search uses cell lists from ``N = 1024`` points in
            up to 3 dimensions (``O(N k)`` for evenly spread points), else ``O(N^2 P)`` in
            chunks (once per batch when the positions are shared), the attention ``O(N k (D + m + Dv))`` on
            top of the linear part; see :mod:`flt.ops.neighbors` and docs/math.md section 5.1.1.
        near_relative: the near set's term ``f_near``: ``None`` (default) a second spectrum
            of the same family starting at 0; or the name of any term in
            :data:`flt.relative.RELATIVE` that is a function of the offset, e.g.
            ``"clipped"``, a learned table with one entry per offset of the band
            (``max_distance`` defaults to ``near_field``; its output scale is learned, as
            for softmax's tables). Only its exact values are used, so it needs no features.
        near_relative_options: keyword options of that term.
        far_field: ``False`` fixes the far-field mask at ``f = 0`` and freezes the spectrum:
            a control for measuring what the random-feature relative term contributes.
            With the logit coupling the layer is then a Performer (plus the exact near set
            and its ``f_near``, if one is set: the local + linear hybrid); with the
            multiplicative coupling only the near set carries weight (a cutoff model), so
            it needs ``near_neighbors``, and ``f_near`` starts at the spectrum's
            ``amplitude`` instead of 0 (at 0 no pair would carry weight and the mask
            would get no gradient). The spectrum's parameters stay in the state dict.
            ``"near"`` is the control between the two: the spectrum is learnt and ``f`` is
            used exactly on the near set (``f + f_near`` there, as with ``True``), but its
            random-feature estimate beyond the near set is dropped (``f = 0`` there: a
            Performer beyond the band for the logit coupling, zero weight for the
            multiplicative one). Comparing it with ``True`` measures what the random-feature
            far field adds; it needs ``near_field`` or ``near_neighbors``.
        check_condition: with the multiplicative coupling, warn (:class:`ConditioningWarning`)
            when its row sums cancel so much that rounding can reach ``1e-4`` of an output in
            float32, or swamp it in bfloat16 / float16 (:meth:`check_conditioning`; default
            on: one extra ``O(N 2R m)`` pass and one host synchronisation per forward call).
        backend: ``"torch"`` (default) or ``"triton"``: the forward pass by the Triton kernels
            :func:`flt.ops.triton.favor_attention` and, with ``near_field``,
            :func:`flt.ops.triton.band.band_attention` (CUDA; FAVOR+; not with
            ``near_neighbors``; :class:`flt.layers.kernel.KernelAttention`).
        **spectrum_options: forwarded to the spectrum (``amplitude`` defaults to 0 for the
            logit coupling and 1 for the multiplicative one).

    Shapes: ``forward(x [B, N, dim], pos [B, N, P] | [N, P] | None, key_padding_mask [B, N])
    -> [B, N, dim]``.
    """

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
        temperature: float = 1.0,
        orthogonal: bool = True,
        redraw_interval: int | None = None,
        seed: int | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        chunk_size: int | None = None,
        near_field: int = 0,
        near_neighbors: int = 0,
        near_relative: str | None = None,
        near_relative_options: dict | None = None,
        far_field: bool | Literal["near"] = True,
        check_condition: bool = True,
        backend: str = "torch",
        device=None,
        dtype=None,
        **spectrum_options,
    ) -> None:
        check_choice("coupling", coupling, COUPLINGS)
        check_choice("spectrum", spectrum, SPECTRA)
        if coupling == "logit" and feature_map != "favor+":
            raise ValueError(f"coupling='logit' needs feature_map='favor+' (it estimates exp(q.k + f)), got {feature_map!r}")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        head_dim = dim // heads
        super().__init__(
            dim, heads, pos_dim=pos_dim, causal=causal,
            feature_dim=head_dim + 2 * num_frequencies if coupling == "logit" else head_dim,
            num_features=num_features, feature_map=feature_map, qk_norm=qk_norm, temperature=temperature,
            orthogonal=orthogonal, redraw_interval=redraw_interval, seed=seed, rope=rope, rope_base=rope_base,
            chunk_size=chunk_size, backend=backend, device=device, dtype=dtype,
        )
        if backend == "triton" and near_neighbors:
            raise ValueError("backend='triton' has no kernel for near_neighbors (the band, near_field, has one); use backend='torch'")
        self.coupling = coupling
        if not isinstance(check_condition, bool):
            raise ValueError(f"check_condition must be True or False (warn when rounding can change the multiplicative coupling's outputs), got {check_condition!r}")
        self.check_condition = check_condition
        self._condition_warned: set = set()  # precisions warned about: once each per layer, then no check
        self._condition_trained: set = set()  # precisions checked in training mode (first step only)
        spectrum_options.setdefault("amplitude", 0.0 if coupling == "logit" else 1.0)
        self.spectrum = SPECTRA[spectrum](
            heads=heads, pos_dim=pos_dim, num_frequencies=num_frequencies, device=device, dtype=dtype, **spectrum_options
        )
        check_nonnegative_int("near_field", near_field, "the band half-width w in tokens; 0 = off")
        self.near_field = near_field
        check_nonnegative_int("near_neighbors", near_neighbors, "k nearest keys in position space; 0 = off")
        self.near_neighbors = near_neighbors
        if near_field and near_neighbors:
            raise ValueError(f"near_field ({near_field}) and near_neighbors ({near_neighbors}) are exclusive: choose one near set, the token band or the k nearest keys")
        if near_field and feature_map != "favor+":
            raise ValueError(f"the band holds exact softmax weights exp(x_q.x_k) next to the estimate: it needs feature_map='favor+', got {feature_map!r}")
        # near_neighbors takes any map with the multiplicative coupling (the near pairs keep the
        # features' kernel, flt.ops.neighbors); the logit coupling needs favor+ (checked above).
        if near_neighbors and causal:
            raise ValueError("near_neighbors is bidirectional (the near set of a set of points has no causal order); use causal=False, or near_field for causal sequences")
        if near_field and coupling != "logit":
            raise ValueError("near_field needs coupling='logit' (the band op holds exact softmax weights); pass near_field=0 "
                             "to turn it off, or use near_neighbors, which takes both couplings")
        if near_relative is not None and not (near_field or near_neighbors):
            raise ValueError(f"near_relative ({near_relative!r}) is the near set's term: it needs near_field or near_neighbors")
        if near_relative_options is not None and near_relative is None:
            raise ValueError("near_relative_options need near_relative (the name of a term in flt.relative.RELATIVE)")
        if near_field or near_neighbors:
            # The near set's mask is f + f_near. f_near starts at 0, so the near set starts
            # with the far one's mask; but a multiplicative layer without a far field has
            # f = 0, and f_near = 0 would give every pair weight 0 and the mask no gradient
            # (the cutoff model could never learn): there f_near starts where f would.
            near_amplitude = spectrum_options["amplitude"] if coupling == "multiplicative" and far_field is False else 0.0
            if near_relative is None:
                # Only its exact f is used; its frequencies are never sampled.
                near_options = {**spectrum_options, "amplitude": near_amplitude}
                self.near_spectrum = SPECTRA[spectrum](
                    heads=heads, pos_dim=pos_dim, num_frequencies=num_frequencies, device=device, dtype=dtype, **near_options
                )
            else:
                from flt.relative import build_relative

                options = dict(near_relative_options or {})
                if near_relative == "clipped":
                    options.setdefault("max_distance", max(near_field, 1))  # one entry per offset of the band
                if near_relative in SPECTRA:  # a spectrum of another family or other options: starts at 0
                    options.setdefault("num_frequencies", num_frequencies)
                    options.setdefault("amplitude", near_amplitude)
                self.near_spectrum = build_relative(near_relative, heads=heads, pos_dim=pos_dim, causal=causal,
                                                    device=device, dtype=dtype, **options)
            self.near_spectrum.has_random_features = False  # flt.layers.draws leaves it alone
            self.supports_decoding = bool(near_field)  # the band decodes (flt.layers.band_decode); near sets do not
        else:
            self.near_spectrum = None
        if not (isinstance(far_field, bool) or far_field == "near"):
            raise TypeError(f"far_field must be true, false or 'near' (f exact on the near set, 0 beyond it), got {far_field!r}")
        if far_field == "near" and not (near_field or near_neighbors):
            raise ValueError("far_field='near' keeps f on the near set only: it needs near_field (a token band) or "
                             "near_neighbors (k nearest keys); without a near set use far_field=false")
        if far_field is False and coupling == "multiplicative" and not near_neighbors:
            raise ValueError("far_field=False with coupling='multiplicative' leaves no pair any weight (f = 0 "
                             "multiplies every kernel value): add near_neighbors, or use coupling='logit'")
        self.far_field = far_field
        if far_field is False:
            self.spectrum.requires_grad_(False)

    def step(self, x: torch.Tensor, state=None, pos: torch.Tensor | None = None):
        """Decode one token (``causal=True``); with ``near_field`` through
        :func:`flt.layers.band_decode.band_step` (exact band from a ring buffer, far field
        from the linear state), else :meth:`flt.layers.kernel.KernelAttention.step`."""
        if self.near_field:
            return band_step(self, x, state, pos)
        return super().step(x, state, pos)

    def prefill(self, x: torch.Tensor, pos: torch.Tensor | None = None):
        """The causal forward over a prompt and the decoding state :meth:`step` continues
        from: with ``near_field`` the band's ring buffer and far field
        (:func:`flt.layers.band_decode.band_prefill`), else the linear state
        (:meth:`flt.layers.kernel.KernelAttention.prefill`)."""
        if self.near_field:
            return band_prefill(self, x, pos)
        return super().prefill(x, pos)

    def far_features(self, pos: torch.Tensor | None):
        """The spectrum's random features ``a(r), c(r)``, the estimate of ``f`` beyond the
        near set; zeros unless ``far_field=True``."""
        a, c = self.spectrum.features(pos)
        if self.far_field is not True:
            a, c = torch.zeros_like(a), torch.zeros_like(c)
        return a, c

    def far_mask(self, delta: torch.Tensor) -> torch.Tensor:
        """The spectrum's exact ``f(delta)`` (``[..., P] -> [..., H]``) as the near set (and
        :meth:`exact`) uses it; zeros with ``far_field=False``. With ``far_field="near"``
        it is ``f`` itself: :meth:`exact` zeroes it beyond the near set."""
        f = self.spectrum.mask(delta)
        return torch.zeros_like(f) if self.far_field is False else f

    def attend_features(self, f: KernelFeatures, p, *, reference: bool = False) -> torch.Tensor:
        out = super().attend_features(f, p, reference=reference)
        if f.a is not None and self.check_condition and not reference and not compiling():
            self.check_conditioning(f, p)
        return out

    def attend_triton(self, p) -> torch.Tensor:
        out = super().attend_triton(p)
        if self.coupling == "multiplicative" and self.check_condition and not compiling() and self._condition_due(p):
            self.check_conditioning(mask_padded_keys(self.features(p.q, p.k, p.pos), p.pad), p)
        return out

    def triton_inputs(self, pos) -> dict:
        """The spectral features: joined to FAVOR+'s inputs (logit) or the mask's factors."""
        a, c = self.far_features(pos)
        return {"extra_q": a, "extra_k": c} if self.coupling == "logit" else {"a": a, "c": c}

    def _condition_due(self, p) -> bool:
        """Whether :meth:`check_conditioning` would check this call (not a no-op)."""
        precision = min((t.dtype for t in (p.q, p.k, p.v)), key=lambda d: torch.finfo(d).bits)
        return not (precision in self._condition_warned or (self.training and precision in self._condition_trained))

    def check_conditioning(self, f: KernelFeatures, p) -> float:
        """Warn (:class:`ConditioningWarning`) when rounding can visibly change the
        multiplicative coupling's output; returns ``kappa``.

        ``kappa`` is the largest row condition number of the denominators, bounded above
        by :func:`flt.ops.linear.kronecker_condition` (measured 8 to 15 times the true
        value): a relative rounding ``u`` of the projected queries, keys and values
        (bfloat16 under bfloat16 autocast, float16 for a half layer) can move a row's
        output by about ``kappa u`` of its size. The warning fires when ``kappa`` exceeds
        ``max(CONDITION_LIMIT, 1e-4 / u)`` (1700 in float32: rounding can then reach
        ``1e-4`` of an output) or ``1 / u`` (256 in bfloat16: rounding alone can then swamp
        an output). Far from the query the random-feature mask ``f^`` does not decay but
        oscillates around 0 with an amplitude of about ``f(0) / sqrt(R)``, so over many
        keys the row sums cancel, more so as ``N`` grows (docs/math.md section 4,
        "Conditioning"). One extra pass of ``O(N 2R m)`` and one host synchronisation per
        call (``forward``, ``prefill``; not ``step``) until the layer has warned once for
        the precision at hand, and in training mode on the first call per precision only
        (otherwise it returns NaN without checking: a training step pays for no host
        synchronisation; evaluation in ``eval()`` mode checks again); ``check_condition=False``
        turns it off.
        """
        precision = min((t.dtype for t in (p.q, p.k, p.v)), key=lambda d: torch.finfo(d).bits)
        if not self._condition_due(p):
            return float("nan")
        if self.training:  # not every training step: its host synchronisation would stall each one
            self._condition_trained.add(precision)
        with torch.no_grad():
            kappa = kronecker_condition(f.q, f.k, f.a, f.c, causal=self.causal, key_log_scale=f.key_log_scale,
                                        chunk_size=self.chunk_size)
        worst = float(kappa.max())
        roundoff = torch.finfo(precision).eps / 2
        limit = min(1 / roundoff, max(CONDITION_LIMIT, 1e-4 / roundoff))
        if worst > limit:
            self._condition_warned.add(precision)
            change = "all" if worst * roundoff >= 1 else f"about {worst * roundoff:.1e}"
            warnings.warn(
                f"FLTAttention(coupling='multiplicative'): the signed mask's row sums cancel over these "
                f"{kappa.shape[-1]} tokens (condition number up to {worst:.3g}, limit {limit:.3g}), so rounding the {str(precision).removeprefix('torch.')} "
                f"projections (u = {roundoff:.1e}) can change some outputs by {change} of their size. Use float32 "
                f"for this layer (no autocast), more num_frequencies, shorter sequences, or coupling='logit' (positive "
                f"weights); check_condition=False silences this.",
                ConditioningWarning, stacklevel=4,
            )
        return worst

    def features(self, q, k, pos) -> KernelFeatures:
        """Kernel features, and for the multiplicative coupling the spectral ``a, c``."""
        xq, xk = self.scaled_qk(q, k, pos)
        a, c = self.far_features(pos)
        if self.coupling == "logit":
            # FAVOR+ of [x_q, a(r)] and [x_k, c(r)], without forming the concatenation.
            cdt = torch.promote_types(xq.dtype, a.dtype)
            qf, _ = self.feature_map.forward_split(xq.to(cdt), a.to(cdt))
            kf, kls = self.feature_map.forward_split(xk.to(cdt), c.to(cdt))
            return KernelFeatures(qf, kf, kls, None, None)
        qf, _ = self.feature_map(xq)
        kf, kls = self.feature_map(xk)
        return KernelFeatures(qf, kf, kls, a, c)

    def attend(self, p, *, reference: bool = False) -> torch.Tensor:
        if self.near_neighbors:
            return self._attend_neighbors(p, reference)
        if not self.near_field:
            return super().attend(p, reference=reference)
        if self.backend == "triton" and not reference:
            return self._attend_band_triton(p)
        xq, xk, qf, kf, q_shift, k_shift = self._near_set_features(p)
        bias = self.band_bias(batch_shared(p.pos).to(xq.dtype))  # [B|1, H, N, 2w + 1]
        key_mask = None if p.pad is None else ~p.pad
        if reference:
            return band_attention_reference(xq, xk, p.v, qf, kf, q_shift, k_shift, bias, width=self.near_field,
                                            causal=self.causal, key_mask=key_mask)
        return band_attention(xq, xk, p.v, qf, kf, q_shift, k_shift, bias, width=self.near_field, causal=self.causal,
                              key_mask=key_mask, chunk_size=self.chunk_size)

    def _attend_band_triton(self, p):
        """The band by :func:`flt.ops.triton.band.band_attention` (far-field features made in the kernel)."""
        from flt.ops.triton.band import band_attention as band_kernel

        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        a, c = self.far_features(p.pos)
        bias = self.band_bias(batch_shared(p.pos).to(compute_dtype(xq, a)))
        key_mask = None if p.pad is None else ~p.pad
        return band_kernel(xq, xk, p.v, self.feature_map.projection, bias, width=self.near_field, extra_q=a, extra_k=c,
                           causal=self.causal, key_mask=key_mask)

    def _near_set_features(self, p):
        """What both near-set estimators need: the scaled ``x_q, x_k`` (exact weights on the
        near set) and the FAVOR+ features of ``[x_q, a(r)]``, ``[x_k, c(r)]`` with their
        shifts (the far field), all in one compute dtype."""
        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        a, c = self.far_features(p.pos)
        cdt = torch.promote_types(xq.dtype, a.dtype)
        xq, xk = xq.to(cdt), xk.to(cdt)
        qf, q_shift = self.feature_map.forward_split(xq, a.to(cdt))
        kf, k_shift = self.feature_map.forward_split(xk, c.to(cdt))
        return xq, xk, qf, kf, q_shift, k_shift

    def _attend_neighbors(self, p, reference: bool) -> torch.Tensor:
        key_mask = None if p.pad is None else ~p.pad
        op = neighbor_attention_reference if reference else neighbor_attention
        if self.coupling == "logit":
            xq, xk, qf, kf, q_shift, k_shift = self._near_set_features(p)
            pos = batch_shared(p.pos).to(xq.dtype)
            idx = self.near_keys(pos, key_mask)
            return op(xq, xk, p.v, qf, kf, q_shift, k_shift, idx, self.neighbor_bias(pos, idx), key_mask=key_mask)
        # Multiplicative: the exact mask on the near set (times exp(x_q.x_k) for FAVOR+, the
        # features' own kernel for other maps), the Kronecker estimate elsewhere.
        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        a, c = self.far_features(p.pos)
        cdt = torch.promote_types(xq.dtype, a.dtype)
        xq, xk = xq.to(cdt), xk.to(cdt)
        qf, q_shift = self.feature_map(xq)
        kf, k_shift = self.feature_map(xk)
        pos = batch_shared(p.pos).to(cdt)
        idx = self.near_keys(pos, key_mask)
        return op(xq, xk, p.v, qf, kf, q_shift, k_shift, idx, None, key_mask=key_mask, a=a, c=c,
                  near_mask=self.neighbor_bias(pos, idx),
                  near_kernel="exp" if self.feature_map.kind == "favor+" else "features")

    def near_keys(self, pos: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """The near set: ``min(k, N)`` nearest keys of every query, ``[B|1, N, k]``
        (:func:`flt.ops.neighbors.nearest_keys`; sequences shorter than ``k`` are exact)."""
        return nearest_keys(pos, min(self.near_neighbors, pos.shape[1]), key_mask=key_mask)

    def neighbor_bias(self, pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Exact ``f + f_near`` of query ``i`` and its near keys ``idx[i]``:
        ``pos [B|1, N, P], idx [B|1, N, k] -> [B|1, H, N, k]``."""
        delta = near_offsets(pos, idx)
        return rearrange(self.far_mask(delta) + self.near_spectrum.of_offsets(delta), "b n k h -> b h n k")

    def band_bias(self, pos: torch.Tensor) -> torch.Tensor:
        """Exact ``f + f_near`` of query ``i`` and key ``i + o``, ``o = -w .. w``:
        ``pos [B, N, P] -> [B, H, N, 2w + 1]`` (offsets outside the sequence hold junk the
        band op ignores)."""
        w = self.near_field
        step = regular_step(pos)
        if step is not None:
            # Token indices: every query sees the same offsets, so f is evaluated on 2w + 1
            # offsets instead of N (2w + 1), and the bias is a broadcast view over the rows.
            delta = (torch.arange(w, -w - 1, -1, device=pos.device, dtype=pos.dtype) * step).view(1, 1, 2 * w + 1, 1)
        else:
            neighbours = F.pad(pos, (0, 0, w, w)).unfold(1, 2 * w + 1, 1)  # [B, N, P, 2w+1]
            delta = rearrange(pos.unsqueeze(-1) - neighbours, "b n p o -> b n o p")
        f = self.far_mask(delta) + self.near_spectrum.of_offsets(delta)  # [B | 1, N | 1, 2w+1, H]
        return rearrange(f, "b n o h -> b h n o").expand(pos.shape[0], -1, pos.shape[1], -1)

    def _near_set_matrix(self, p, cdt) -> torch.Tensor | None:
        """Which pairs the near set holds, ``[B|1, 1, N, N]`` booleans (the band
        ``|i - j| <= w`` or each query's nearest keys); None without a near set."""
        n = p.q.shape[2]
        if self.near_field:
            idx = torch.arange(n, device=p.q.device)
            return ((idx.view(-1, 1) - idx.view(1, -1)).abs() <= self.near_field).view(1, 1, n, n)
        if self.near_neighbors:
            idx = self.near_keys(batch_shared(p.pos).to(cdt), None if p.pad is None else ~p.pad)
            return torch.zeros(idx.shape[0], 1, n, n, dtype=torch.bool, device=p.q.device).scatter(-1, idx.unsqueeze(1), True)
        return None

    def exact(self, x: torch.Tensor, pos: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The O(N^2) attention this layer approximates, with the same parameters.

        The exact softmax kernel ``exp(x_q.x_k)`` and the exact mask ``f`` of the spectrum:
        ``softmax(x_q.x_k + f)`` for the logit coupling, ``f * exp(x_q.x_k)`` normalised for
        the multiplicative one; with ``feature_map="relu"``, ``"elu"``, ``"taylor"`` or
        ``"hedgehog"`` the kernel those features estimate instead of ``exp(x_q.x_k)``
        (:meth:`flt.layers.kernel.KernelAttention.exact_attention`). As ``num_features`` and
        ``num_frequencies`` grow, ``forward`` converges to this. With ``far_field="near"``
        the mask is ``f + f_near`` on the near set and ``0`` beyond it (a Performer's exact
        kernel there for the logit coupling, no weight for the multiplicative one).
        """
        p = self.prepare(x, pos, key_padding_mask)
        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        cdt = compute_dtype(xq)
        delta = p.pos.unsqueeze(2) - p.pos.unsqueeze(1)  # [B|1, N, N, P]
        f = rearrange(self.far_mask(delta.to(cdt)), "b i j h -> b h i j")
        in_set = self._near_set_matrix(p, cdt)
        if in_set is not None:
            near = rearrange(self.near_spectrum.of_offsets(delta.to(cdt)), "b i j h -> b h i j")
            if self.far_field == "near":
                f = torch.where(in_set, f, torch.zeros_like(f))
            f = f + torch.where(in_set, near, torch.zeros_like(near))
        pad = self.padding_mask_matrix(p.pad, cdt)
        v = p.v.to(cdt)
        if self.coupling == "logit":
            out = self.exact_attention(xq.to(cdt), xk.to(cdt), v, bias=f, mask=pad)
        else:
            out = self.exact_attention(xq.to(cdt), xk.to(cdt), v, mask=f if pad is None else f * pad)
        return self.finish(out, x)
