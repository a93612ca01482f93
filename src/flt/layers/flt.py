"""FLTAttention: linear attention with a learned relative positional encoding (FLT).

The RPE mask ``f(r_i - r_j)`` is the Fourier transform of a learned spectrum (see
:mod:`flt.relative.spectra`), estimated with random frequencies as ``a(r_i) . c(r_j)``. Two couplings
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
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import rearrange

from flt._checks import (
    check_choice,
    check_positive_int,
    compiling,
    shown,
)
from flt._dtype import compute_dtype
from flt._limits import FLOAT_BYTES, check_memory
from flt.layers import flat
from flt.layers.base import OfCore, Prepared, size, spectrum_values
from flt.layers.kernel import KernelAttention, KernelCore, KernelFeatures, mask_padded_keys
from flt.layers.near import NearSet
from flt.layers.parts import COUPLINGS, FavorPlus, Features, Settings, Term, check_kernel_parts
from flt.layers.rules import Facts, check_rules
from flt.ops.linear import kronecker_condition
from flt.relative.base import RelativeTerm
from flt.relative.spectra import SPECTRA, Spectrum

#: The multiplicative coupling warns when the bound on its row condition numbers exceeds
#: this, or ``1 / u`` for inputs of unit roundoff ``u`` (:meth:`FLTCore.check_conditioning`).
CONDITION_LIMIT = 1000.0


class ConditioningWarning(RuntimeWarning):
    """The multiplicative coupling's row sums cancel so much that rounding changes outputs."""


class FLTCore(KernelCore):
    """The mechanism of :class:`FLTAttention` without its projections: the far term
    (``spectrum``), the kernel features (``feature_map``, ``scaling``), the near set
    (``near``, ``near_spectrum``) and ``far_constant``, computing on queries, keys and values
    ``[B, H, N, D]``. The arguments are :class:`FLTAttention`'s, with ``head_dim`` for ``dim``.
    """

    def __init__(self, heads: int, head_dim: int, *, pos_dim: int = 1, causal: bool = False,
                 relative: str | Term | Spectrum | None = None, features: Features | None = None, near: NearSet | None = None,
                 coupling: str = "logit", far_field: bool | Literal["near", "constant", "positive"] = True,
                 settings: Settings | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        check_choice("coupling", coupling, COUPLINGS)
        features = FavorPlus() if features is None else features
        settings = Settings() if settings is None else settings
        relative = _far_term(relative, coupling)
        _check_parts(features, near, settings)
        if not (isinstance(far_field, bool) or far_field in ("near", "constant", "positive")):
            raise TypeError(f"far_field must be true, false, 'near' (f exact on the near set, 0 beyond it), 'constant' "
                            f"(f exact on the near set, a learnt constant per head beyond it) or 'positive' (the same "
                            f"constant kept >= 0), got {shown(far_field)}")
        if not isinstance(settings.check_condition, bool):
            raise ValueError(f"check_condition must be True or False (warn when rounding can change the multiplicative coupling's outputs), got {shown(settings.check_condition)}")
        check_positive_int("heads", heads)
        check_positive_int("head_dim", head_dim)
        facts = layer_facts(features=features, near=near, coupling=coupling, far_field=far_field, causal=causal,
                            settings=settings, head_dim=head_dim, pos_dim=pos_dim)
        check_rules(facts)
        num_frequencies = relative.options["num_frequencies"] if isinstance(relative, Term) else relative.num_frequencies
        self._check_part_memory(heads, head_dim, pos_dim, features, num_frequencies, near, coupling, device)
        super().__init__(heads, head_dim, pos_dim=pos_dim, causal=causal, features=features, settings=settings,
                         feature_dim=head_dim + 2 * num_frequencies if coupling == "logit" else head_dim,
                         device=device, dtype=dtype)
        self.coupling, self.near = coupling, near
        self.check_condition = settings.check_condition
        self._condition_warned: set = set()  # precisions warned about: once each per layer, then no check
        self._condition_trained: set = set()  # precisions checked in training mode (first step only)
        if isinstance(relative, Term):
            self.spectrum = SPECTRA[relative.name](heads=heads, pos_dim=pos_dim, device=device, dtype=dtype, **relative.options)
        else:
            self.spectrum = relative
        self.near_field, self.near_neighbors = facts.near_field, facts.near_neighbors
        self.near_spectrum: RelativeTerm | None
        if near is not None:
            # The near set's mask is f + f_near. f_near starts at 0, so the near set starts
            # with the far one's mask; but a multiplicative layer without a far field has
            # f = 0, and f_near = 0 would give every pair weight 0 and the mask no gradient
            # (the cutoff model could never learn): there f_near starts where f would.
            start = 0.0
            if coupling == "multiplicative" and far_field is False:
                start = relative.options["amplitude"] if isinstance(relative, Term) else 1.0
            self.near_spectrum = near.build_term(relative, heads=heads, pos_dim=pos_dim, causal=causal, start=start,
                                                 device=device, dtype=dtype)
            self.supports_decoding = near.decodes  # the band decodes; the nearest keys do not
        else:
            self.near_spectrum = None
        self.far_field = far_field
        if far_field is False:
            self.spectrum.requires_grad_(False)
        self.far_constant: torch.nn.Parameter | None = None
        if far_field == "constant":
            # Zero, so that the layer starts where far_field="near" starts (no weight beyond
            # the near set with the multiplicative coupling, exactly; the plain kernel with the
            # logit one, in exact() and in expectation, the FAVOR+ draw having one more input):
            # the two controls then differ by what training moves c_h to.
            self.far_constant = torch.nn.Parameter(torch.zeros(heads, device=device, dtype=dtype))
        elif far_field == "positive":
            # softplus(-4) ~ 0.018: near where "near" starts, and Adam moves theta by about
            # the learning rate a step, so a few thousand steps reach c_h ~ 1 (f's amplitude).
            self.far_constant = torch.nn.Parameter(torch.full((heads,), -4.0, device=device, dtype=dtype))

    @staticmethod
    def _check_part_memory(heads: int, head_dim: int, pos_dim: int, features: Features, num_frequencies: object,
                           near: NearSet | None, coupling: str, device: torch.device | str | None) -> None:
        """Refuse parts whose parameters cannot fit (:meth:`FLTAttention.parameter_values`'
        terms: the feature projection ``m x`` its input, and ``4 H R P`` for the spectrum and
        again for the near set's), before the core allocates them: ``pos_dim = 2**40``
        would otherwise ask for petabytes."""
        m, r = features.map_options()["num_features"], num_frequencies
        if str(device) == "meta" or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (m, r, pos_dim)):
            return  # other types are the parts' own checks to report
        assert isinstance(m, int) and isinstance(r, int)
        feature_dim = head_dim + 2 * r if coupling == "logit" else head_dim
        values = m * feature_dim + 4 * heads * r * pos_dim * (2 if near is not None else 1)
        check_memory(f"FLTAttention's parts (heads={heads}, pos_dim={pos_dim}, num_features={m}, num_frequencies={r})",
                     values * FLOAT_BYTES, device=device, hint="make these sizes smaller")

    def pairwise_values(self, batch: int, length: int) -> int:
        """:meth:`flt.layers.base.CoreBase.pairwise_values` plus the exact mask ``f`` of every
        pair: the offsets ``[B, N, N, P]``, and per head and mixture component a phase, a
        decay and their products (five values; a spectrum without components counts as one),
        again for the near set's own term. Measured for README example 1 (4 heads of 4
        components, P = 2): 87 values per pair formed without gradients, against 98 here."""
        per_pair = 0
        for spectrum in (self.spectrum, self.near_spectrum):
            if spectrum is not None:
                components = getattr(spectrum, "components", 1)
                components = components if isinstance(components, int) and components > 0 else 1
                per_pair += self.pos_dim + 5 * self.heads * components
        return super().pairwise_values(batch, length) + batch * length * length * per_pair

    def step_offset(self, state: Any) -> int:
        """The next token's default position; with a band the state must be the band's."""
        if self.near is not None and self.near.decodes:
            return self.near.step_offset(self, state)
        return super().step_offset(state)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any, pos: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Decode one token (``causal=True``); with a band through
        :meth:`flt.layers.near.Band.step` (exact band from a ring buffer, far field
        from the linear state), else :meth:`flt.layers.kernel.KernelCore.step`."""
        if self.near is not None and self.near.decodes:
            return self.near.step(self, q, k, v, state, pos)
        return super().step(q, k, v, state, pos)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """The causal attention of a prompt and the decoding state :meth:`step` continues
        from: with a band its ring buffer and far field (:meth:`flt.layers.near.Band.prefill`),
        else the linear state (:meth:`flt.layers.kernel.KernelCore.prefill`); padded
        keys (``pad [B, N]``, True marks padding) are in neither."""
        if self.near is not None and self.near.decodes:
            return self.near.prefill(self, q, k, v, pos, pad)
        return super().prefill(q, k, v, pos, pad)

    def far_features(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The spectrum's random features ``a(r), c(r)`` (``[B|1, H, N, 2R]``), the estimate of
        ``f`` beyond the near set; zeros unless ``far_field=True``. With
        ``far_field="constant"`` or ``"positive"``, features of the same shape whose products
        are ``c_h`` for every pair (:func:`_constant_features`), so every estimator path (the
        near sets subtract their pairs' estimates from the far sum) takes the constant as it
        takes ``f``'s estimate. Only ``far_field=True`` computes the random features."""
        if self.far_field is True:
            return self.spectrum.features(pos)
        first = next(self.spectrum.parameters(), None)
        dtype = compute_dtype(pos, *([] if first is None else [first]))
        lead = (pos.shape[0] if pos.ndim == 3 else 1, self.heads, pos.shape[-2], 1)
        width = 2 * self.spectrum.num_frequencies
        if self.far_constant is not None:
            return _constant_features(self.far_constant_value(), lead, width, dtype)
        zeros = pos.new_zeros(*lead[:-1], width, dtype=dtype)
        return zeros, torch.zeros_like(zeros)

    def far_constant_value(self) -> torch.Tensor:
        """``c_h [H]``, the mask beyond the near set with ``far_field="constant"`` (the
        parameter itself) or ``"positive"`` (its softplus)."""
        if self.far_constant is None:
            raise ValueError(f"far_constant_value needs far_field='constant' or 'positive', got far_field={self.far_field!r}")
        return F.softplus(self.far_constant) if self.far_field == "positive" else self.far_constant

    def far_mask(self, delta: torch.Tensor) -> torch.Tensor:
        """The spectrum's exact ``f(delta)`` (``[..., P] -> [..., H]``) as the near set (and
        :meth:`exact`) uses it; zeros with ``far_field=False``. With ``far_field="near"``
        ``"constant"`` or ``"positive"`` it is ``f`` itself: :meth:`exact` replaces it beyond
        the near set (by 0, or by ``c_h``)."""
        f = self.spectrum.mask(delta)
        return torch.zeros_like(f) if self.far_field is False else f

    def attend_features(self, f: KernelFeatures, p: Prepared, *, reference: bool = False) -> torch.Tensor:
        out = super().attend_features(f, p, reference=reference)
        if f.a is not None and self.check_condition and not reference and not compiling():
            self.check_conditioning(f, p)
        return out

    def attend_triton(self, p: Prepared) -> torch.Tensor:
        out = super().attend_triton(p)
        if self.coupling == "multiplicative" and self.check_condition and not compiling() and self._condition_due(p):
            self.check_conditioning(mask_padded_keys(self.features(p.q, p.k, p.pos), p.pad), p)
        return out

    def triton_inputs(self, pos: torch.Tensor) -> dict[str, Any]:
        """The spectral features: joined to FAVOR+'s inputs (logit) or the mask's factors."""
        a, c = self.far_features(pos)
        return {"extra_q": a, "extra_k": c} if self.coupling == "logit" else {"a": a, "c": c}

    def _condition_due(self, p: Prepared) -> bool:
        """Whether :meth:`check_conditioning` would check this call (not a no-op)."""
        precision = min((t.dtype for t in (p.q, p.k, p.v)), key=lambda d: torch.finfo(d).bits)
        return not (precision in self._condition_warned or (self.training and precision in self._condition_trained))

    def check_conditioning(self, f: KernelFeatures, p: Prepared) -> float:
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
        assert f.a is not None and f.c is not None  # the multiplicative coupling's mask factors
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

    def features(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> KernelFeatures:
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

    def attend(self, p: Prepared, *, reference: bool = False) -> torch.Tensor:
        if self.near is not None:
            return self.near.attend(self, p, reference=reference)
        return super().attend(p, reference=reference)

    def near_set_features(self, p: Prepared) -> tuple[torch.Tensor, ...]:
        """What both near sets need: the scaled ``x_q, x_k`` (exact weights on the near set)
        and the FAVOR+ features of ``[x_q, a(r)]``, ``[x_k, c(r)]`` with their shifts (the
        far field), all in one compute dtype."""
        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        a, c = self.far_features(p.pos)
        cdt = torch.promote_types(xq.dtype, a.dtype)
        xq, xk = xq.to(cdt), xk.to(cdt)
        qf, q_shift = self.feature_map.forward_split(xq, a.to(cdt))
        kf, k_shift = self.feature_map.forward_split(xk, c.to(cdt))
        return xq, xk, qf, kf, q_shift, k_shift

    def near_mask(self, delta: torch.Tensor) -> torch.Tensor:
        """The near set's exact mask ``f + f_near`` at offsets ``delta [..., P] -> [..., H]``."""
        assert self.near_spectrum is not None  # built with the near set, the only caller
        return self.far_mask(delta) + self.near_spectrum.of_offsets(delta)

    def exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              pad: torch.Tensor | None = None) -> torch.Tensor:
        """The O(N^2) attention this layer approximates, with the same parameters.

        The exact softmax kernel ``exp(x_q.x_k)`` and the exact mask ``f`` of the spectrum:
        ``softmax(x_q.x_k + f)`` for the logit coupling, ``f * exp(x_q.x_k)`` normalised for
        the multiplicative one; with ``feature_map="relu"``, ``"elu"``, ``"taylor"`` or
        ``"hedgehog"`` the kernel those features estimate instead of ``exp(x_q.x_k)``
        (:meth:`flt.layers.kernel.KernelCore.exact_attention`). As ``num_features`` and
        ``num_frequencies`` grow, ``forward`` converges to this. With ``far_field="near"``
        the mask is ``f + f_near`` on the near set and ``0`` beyond it (a Performer's exact
        kernel there for the logit coupling, no weight for the multiplicative one); with
        ``far_field="constant"`` or ``"positive"`` it is ``c_h`` (:meth:`far_constant_value`)
        beyond the near set.
        """
        p = Prepared(q, k, v, pos, pad)
        xq, xk = self.scaled_qk(p.q, p.k, p.pos)
        cdt = compute_dtype(xq)
        delta = p.pos.unsqueeze(2) - p.pos.unsqueeze(1)  # [B|1, N, N, P]
        f = rearrange(self.far_mask(delta.to(cdt)), "b i j h -> b h i j")
        if self.near is not None:
            assert self.near_spectrum is not None  # built with the near set
            in_set = self.near.pairs(self, p, cdt)
            near = rearrange(self.near_spectrum.of_offsets(delta.to(cdt)), "b i j h -> b h i j")
            if self.far_constant is not None:
                f = torch.where(in_set, f, self.far_constant_value().to(cdt).view(1, -1, 1, 1).expand_as(f))
            elif self.far_field == "near":
                f = torch.where(in_set, f, torch.zeros_like(f))
            f = f + torch.where(in_set, near, torch.zeros_like(near))
        pad = self.padding_mask_matrix(p.pad, cdt)
        v = p.v.to(cdt)
        if self.coupling == "logit":
            out = self.exact_attention(xq.to(cdt), xk.to(cdt), v, bias=f, mask=pad)
        else:
            out = self.exact_attention(xq.to(cdt), xk.to(cdt), v, mask=f if pad is None else f * pad)
        return out



class FLTAttention(KernelAttention):
    """Multi-head FourierLearner-Transformer attention, linear in the sequence length.

    A layer is its projections (``to_qkv``, ``to_out``) plus a core made of parts
    (:mod:`flt.layers.parts`, :mod:`flt.layers.near`), each with its own options::

        FLTAttention(64, 4, relative=Term("local", num_frequencies=16),
                     features=FavorPlus(num_features=64, seed=0), near=Band(16, term="clipped"))

    The flat option names of presets and the command line build the same parts through
    :meth:`from_options` (``FLTAttention.from_options(64, 4, spectrum="local",
    num_frequencies=16, num_features=64, seed=0, near_field=16, near_relative="clipped")``).
    Which parts combine is ruled in :mod:`flt.layers.rules`.

    Args:
        dim: model width; ``heads`` must divide it.
        heads: ``H``.
        pos_dim: ``P``, dimension of the positions (1 text, 2 patches, 3 atoms, ...).
        causal: token ``i`` attends to ``j <= i``; enables :meth:`step`.
        relative: the far term ``f``, a spectrum (:data:`flt.relative.spectra.SPECTRA`) with
            random features ``a(r), c(r)``: a name, a :class:`flt.layers.parts.Term` (name and
            options: ``num_frequencies`` ``R`` (default 32), ``seed``, the family's own), or a
            spectrum module. Default ``"gaussian_mixture"``; a spectrum built here starts at
            ``amplitude`` 0 for the logit coupling and 1 for the multiplicative one.
        features: the kernel features (:class:`flt.layers.parts.FavorPlus`, the default, with
            ``num_features`` ``m = 256``; ``ReLUFeatures``, ``EluFeatures``, ``TaylorFeatures``,
            ``Hedgehog``: multiplicative coupling only, the logit coupling needs the
            exponential kernel).
        near: ``None`` or a near set whose pairs get their exact weights with the mask
            ``f + f_near`` (:mod:`flt.layers.near`): :class:`~flt.layers.near.Band` ``(w)``, the
            token band ``|i - j| <= w`` (logit coupling; sequences; causal layers decode it
            token by token in constant memory), or :class:`~flt.layers.near.Neighbors` ``(k)``,
            each query's ``k`` nearest keys in position space (either coupling; sets, not
            causal). ``f_near`` is the near set's own term (``term``; by default a second
            spectrum of the far term's family starting at 0; ``"zero"``: none, ``f_near =
            0``), exact only, so a strong local bias costs no variance. See docs/math.md sections 5.1 and 5.1.1.
        coupling: ``"logit"`` or ``"multiplicative"`` (module docstring).
        far_field: ``False`` fixes the far-field mask at ``f = 0`` and freezes the spectrum:
            a control for measuring what the random-feature relative term contributes.
            With the logit coupling the layer is then a Performer (plus the exact near set
            and its ``f_near``, if one is set: the local + linear hybrid); with the
            multiplicative coupling only the near set carries weight (a cutoff model), so
            it needs :class:`~flt.layers.near.Neighbors`, and ``f_near`` starts at the
            spectrum's ``amplitude`` instead of 0 (at 0 no pair would carry weight and the
            mask would get no gradient). The spectrum's parameters stay in the state dict.
            ``"near"`` is the control between the two: the spectrum is learnt and ``f`` is
            used exactly on the near set (``f + f_near`` there, as with ``True``), but its
            random-feature estimate beyond the near set is dropped (``f = 0`` there).
            Comparing it with ``True`` measures what the random-feature far field adds; it
            needs a near set. ``"constant"`` is the control for the far field's shape: ``f``
            as with ``"near"`` on the near set, and beyond it a learnt constant ``c_h`` per
            head (``far_constant``, ``[H]``, starting at 0, so the layer starts as
            ``"near"``: exactly with the multiplicative coupling, in expectation with the
            logit one) in place of ``f``'s estimate: ``c_h`` times the kernel for the
            multiplicative coupling, a logit bias ``c_h`` for the logit one. Comparing it
            with ``True`` measures what the learnt shape of ``f`` beyond the near set adds
            over attending there at all; it needs a near set. ``"positive"`` is the same
            control with ``c_h = softplus(theta_h) >= 0`` (``far_constant`` holds ``theta_h``,
            starting at -4, ``c_h`` about 0.018): the multiplicative coupling's learnt
            ``f`` is a nonnegative Gaussian mask beyond the near set, while a free constant
            can go negative there and make rows of weights cancel.
        settings: :class:`flt.layers.parts.Settings`: ``rope``/``rope_base`` (also rotate
            queries and keys by RoPE), ``chunk_size`` (None: chosen from the shapes),
            ``backend`` (``"torch"``, or ``"triton"``: the forward pass by
            :func:`flt.ops.triton.favor_attention` and, with a band,
            :func:`flt.ops.triton.band.band_attention`; CUDA; FAVOR+; no
            :class:`~flt.layers.near.Neighbors`; ``"triton-split"``: the feature-split kernels
            of :mod:`flt.ops.triton.split`, forward and backward, both couplings (the
            multiplicative one as sums of values widened by ``c``,
            :func:`flt.ops.triton.split.favor_attention_split_kronecker`); with a band
            :func:`flt.ops.triton.band.band_attention_split`), ``redraw_interval`` (a
            layer-level redraw schedule, :class:`flt.layers.kernel.KernelCore`; ``flt train`` redraws by
            ``RunConfig.redraw_interval`` instead) and ``check_condition`` (with the
            multiplicative coupling, warn, :class:`ConditioningWarning`, when its row sums
            cancel so much that rounding can reach ``1e-4`` of an output in float32, or swamp
            it in bfloat16 / float16; :meth:`check_conditioning`; default on: one extra
            ``O(N 2R m)`` pass and one host synchronisation per forward call).
        device, dtype: of the parameters and buffers.

    The layer is ``to_qkv``, ``to_out`` and its core, ``layer.core`` (an :class:`FLTCore`),
    which keeps the parts (``core.kernel``: the features, ``core.near``, ``core.settings``) and
    the modules they build: ``spectrum`` (``f``), ``near_spectrum`` (``f_near``, or None),
    ``feature_map`` and ``scaling``; ``near_field`` and ``near_neighbors`` are the band's width
    and the neighbours' ``k`` (0 without). The layer has properties that read them on the core
    (``layer.spectrum`` is ``layer.core.spectrum``), as well as ``near``, ``coupling``,
    ``far_field``, ``far_constant`` and ``check_condition`` (which can also be set,
    ``layer.check_condition = False``); anything else is read on ``layer.core``.

    Shapes: ``forward(x [B, N, dim], pos [B, N, P] | [N, P] | None, key_padding_mask [B, N])
    -> [B, N, dim]``.
    """

    registry_name = "flt"
    #: Its flat options and how they become its parts (:mod:`flt.layers.flat`).
    flat_builder = staticmethod(flat.flt)
    core_class = FLTCore
    core: FLTCore
    size_options: ClassVar[tuple[str, ...]] = ("num_features", "num_frequencies", "near_field", "near_neighbors",
                                               "chunk_size", "hidden")

    @classmethod
    def parameter_values(cls, options: dict, *, dim: int, heads: int, pos_dim: int = 1) -> int:
        """The kernel's (:class:`flt.layers.kernel.KernelAttention`), the logit coupling's
        ``2R`` more inputs of the feature projection, the spectrum's frequencies and
        parameters ``4 H R P`` (again for the near set's own) and a neural spectrum's MLP."""
        m, r = size(cls.option(options, "num_features")), size(cls.option(options, "num_frequencies"))
        values = super().parameter_values(options, dim=dim, heads=heads, pos_dim=pos_dim)
        if cls.option(options, "coupling", "logit") == "logit":
            values += m * 2 * r
        near = r and (cls.option(options, "near_field") or cls.option(options, "near_neighbors"))
        values += 4 * heads * r * max(pos_dim, 1) * (2 if near else 1)
        return values + spectrum_values(cls, options, heads=heads, pos_dim=pos_dim)

    @classmethod
    def forward_values(cls, options: dict, *, batch: int, heads: int, length: int, head_dim: int) -> int:
        """The kernel's; the multiplicative coupling's spectral features ``2 B H N 2R`` and
        state ``B H m 2R Dv``; a band of ``w`` tokens ``2 B H N (2w + 1)``, ``k`` nearest keys
        ``2 B H N k``."""
        values = super().forward_values(options, batch=batch, heads=heads, length=length, head_dim=head_dim)
        b, h, n = batch, heads, length
        m, r = size(cls.option(options, "num_features"), 1), size(cls.option(options, "num_frequencies"))
        if cls.option(options, "coupling", "logit") == "multiplicative":
            values += 2 * b * h * n * 2 * r + b * h * m * 2 * r * head_dim
        w, k = size(cls.option(options, "near_field")), size(cls.option(options, "near_neighbors"))
        return values + 2 * b * h * n * (2 * w + 1 if w else 0) + 2 * b * h * n * k

    spectrum = OfCore[Spectrum]("The far term ``f`` (``layer.core.spectrum``).")
    near_spectrum = OfCore[RelativeTerm | None]("The near set's own term ``f_near`` (``layer.core.near_spectrum``), or None.")
    near = OfCore[NearSet | None]("The near set part (``layer.core.near``), or None.")
    near_field = OfCore[int]("The band's half-width ``w`` in tokens (0 without a band).")
    near_neighbors = OfCore[int]("The nearest keys ``k`` of each query (0 without them).")
    coupling = OfCore[str]('``"logit"`` or ``"multiplicative"``.')
    far_field = OfCore[bool | Literal["near", "constant", "positive"]](
        'The layer\'s ``far_field`` (``True``, ``False``, ``"near"``, ``"constant"``, ``"positive"``).')
    far_constant = OfCore[torch.nn.Parameter | None](
        '``[H]``: the learnt constant beyond the near set (``far_field="constant"`` or ``"positive"``; the core\'s '
        "parameter), else None.")

    @property
    def check_condition(self) -> bool:
        """Whether the multiplicative coupling checks its conditioning (:meth:`FLTCore.check_conditioning`)."""
        return self.core.check_condition

    @check_condition.setter
    def check_condition(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"check_condition must be True or False, got {shown(value)}")
        self.core.check_condition = value


def _constant_features(constant: torch.Tensor, lead: tuple[int, ...], width: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``a, c [*lead[:-1], width]`` with ``a_i . c_j = constant[h]`` for every pair:
    ``(constant / t, 0, ...)`` and ``(t, 0, ...)``, ``t = sqrt(|constant|)`` (detached, at
    least 1e-3). The split is symmetric because the logit coupling joins these features to
    FAVOR+'s inputs, whose variance grows with their norms: ``(constant, 0, ...)`` against
    ``(1, 0, ...)`` would add a unit input to every key even at ``constant = 0``. The product
    is ``constant`` with gradient 1 (``t`` carries none)."""
    value = constant.to(dtype).view(1, -1, 1, 1)
    t = value.detach().abs().clamp_min(1e-6).sqrt()
    rest = value.new_zeros(*lead[:-1], width - 1)
    return torch.cat([(value / t).expand(lead), rest], dim=-1), torch.cat([t.expand(lead), rest], dim=-1)


def _far_term(relative: str | Term | Spectrum | None, coupling: str) -> Term | Spectrum:
    """The far term as a :class:`flt.layers.parts.Term` with the layer's defaults
    (``num_frequencies=32``, ``amplitude`` 0 for the logit coupling and 1 for the
    multiplicative one), or the spectrum module given."""
    if relative is None or isinstance(relative, str):
        relative = Term("gaussian_mixture" if relative is None else relative)
    if isinstance(relative, Term):
        check_choice("spectrum", relative.name, SPECTRA)
        return relative.with_defaults(num_frequencies=32, amplitude=0.0 if coupling == "logit" else 1.0)
    if not isinstance(relative, Spectrum):
        raise TypeError(f"relative must be a spectrum (a name in flt.relative.spectra.SPECTRA, a Term or a Spectrum module: the far "
                        f"term needs random features), got {type(relative).__name__}")
    return relative


def _check_parts(features: object, near: object, settings: object) -> None:
    """Each part is of its kind (its own values are checked when it is made)."""
    check_kernel_parts(features, settings)
    if not isinstance(near, (NearSet, type(None))):
        raise TypeError(f"near must be None, Band(w) or Neighbors(k), got {shown(near)} ({type(near).__name__})")


def layer_facts(*, features: Features, near: NearSet | None, coupling: str, far_field: bool | str, causal: bool,
                settings: Settings, head_dim: int, pos_dim: int) -> Facts:
    """The :class:`flt.layers.rules.Facts` of an FLT layer made of these parts."""
    sizes: dict[str, Any] = {} if near is None else {near.size_option: near.size}  # near_field or near_neighbors
    return Facts(features=features.kind, coupling=coupling, near_term=None if near is None else near.term,
                 far_field=far_field, causal=causal, backend=settings.backend, rope=settings.rope, head_dim=head_dim,
                 pos_dim=pos_dim, spectrum_term=True, **sizes)

