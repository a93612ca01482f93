"""Triton kernel of FAVOR+ attention (Performer, FLT logit coupling) with the ``m`` features
split over programs: :func:`favor_split_kernel`, launched by :mod:`flt.ops.triton.split`.

:func:`flt.ops.triton.kernels.favor_attention_kernel` keeps the whole ``[m, BV]`` state in
one program; at ``m = 256`` only its fallback tile (16 tokens, 32 value columns, one stage)
fits the shared memory of an H200, so it walks the sequence 16 tokens at a time with
products too small for the tensor cores. Here program ``(b h, feature block f, value block
x segment)`` owns the ``[BM, BV]`` slice of the state for the features ``[f BM, (f + 1) BM)``
and walks its segment in chunks of ``BC`` tokens (chunked causal form: the quadratic
products inside a chunk under the causal mask, the running state for the chunks before).
Every product is at most ``BC x BM x BV`` (64 cubed by default: tensor-core shapes), and
the programs of one head share nothing but their inputs.

The numerator and denominator are sums over the features, so each program writes the part
of its feature block, ``PART [B H, F, N, Dv + 1]``, and the caller adds the ``F`` parts.

Stabilisation: per feature block, not per token. A token's FAVOR+ features
``phi_k(x) = m^(-1/2) exp(w_k.x - |x|^2 / 2)`` are shifted by the largest exponent of its
own block, ``t_f(x) = max_(k in f) w_k.x``, instead of the largest over all ``m``
(:func:`flt.ops.features.favor_plus_features`); ``phi = feat_f * exp(s_f)`` holds per block
as it does for all ``m`` at once, so the block's keys enter its state relative to a running
level of their ``s_f`` exactly as in the one-program kernel, and every exponent inside a
program is ``<= 0``. A program's part for row ``i`` is then relative to
``exp(LEV_f[i])``, ``LEV_f[i] = s_f(q_i) + level_f(i)`` (the query's block shift plus the
key level that row saw: over ``j <= i`` when causal, all keys otherwise), which it writes
to ``LEV [B H, F, N]``; the caller adds the parts with the factors
``exp(LEV_f[i] - max_f' LEV_f'[i]) <= 1``. No first pass over all ``m`` is needed for the
row maxima, nothing depends on a key after the row (the levels are causal per block), and
the result is the same function as :func:`flt.ops.triton.favor_attention_torch`'s: the
per-token shifts cancel in the ratio there as here. (The alternative, one global key
level from a first pass as the bidirectional PyTorch path uses, would cost a pass and is
not causal.)

Segments, products (``PREC``, ``LOW``) and padded keys as in
:func:`flt.ops.triton.kernels.favor_attention_kernel`, whose helpers this kernel calls on
the block's slice of the projection.

Backward (:func:`favor_split_dq_kernel`, :func:`favor_split_dkv_kernel`), per feature block
and with all value columns in one program: the output ``num / den`` is linear in the
augmented values ``[v, 1]``, so with the upstream gradient ``g`` the added numerators and
denominators get ``[g / den, -(g.out) / den]`` (computed in PyTorch), and block ``f`` that
times ``exp(LEV_f - max_f' LEV_f')``, the factor the forward added it with. Queries walk
the chunks in the forward's order with the running key state (``dL/dqf_i = S(i) gn_i +
z(i) gd_i``); keys and values walk them from the last, with a running query state kept at
the least row level it holds. The per-token stabilisers are constants here: the forward's
result does not depend on them. The query's ``-|x|^2 / 2`` scales all of a row's weights
alike and cancels in the ratio, so ``d xq = W^T (dL/dqf * qf)``; a key's does not:
``d xk = W^T (dL/dkf * kf) - xk sum_k (dL/dkf * kf)_k``. Each block writes its part of every
gradient; PyTorch adds them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flt.ops.triton.kernels import (
    _NO_KEY,
    _absorb,
    _features,
    _projection,
    _start_state,
    _store_state,
)


@triton.jit
def _store_part(PART, LEV, rows, ok, vcols, vcol_ok, num, den, lev, vb, DV):
    """Write a chunk's numerator columns and, from the first value block, its denominators
    and row levels."""
    tl.store(PART + rows[:, None] * (DV + 1) + vcols[None, :], num, mask=ok[:, None] & vcol_ok[None, :])
    if vb == 0:
        tl.store(PART + rows * (DV + 1) + DV, den, mask=ok)
        tl.store(LEV + rows, lev, mask=ok)


@triton.jit
def _keys(XK, EK, V, KEEP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
          HAS_EXTRA: tl.constexpr, HAS_KEEP: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
          BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr):
    """A chunk of keys: block features times their weights (0 for padding and past the
    end), block log scales (``_NO_KEY`` where the weight is 0) and values."""
    kf, s = _features(XK, EK, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, MB, PREC)
    weight = tl.where(ok, 1.0, 0.0).to(ACC)
    if HAS_KEEP:
        weight *= tl.load(KEEP + rows, mask=ok, other=0.0).to(ACC)
    s = tl.where(weight != 0, s, _NO_KEY)
    v = tl.load(V + rows[:, None] * DV + vcols[None, :], mask=ok[:, None] & vcol_ok[None, :], other=0.0).to(ACC)
    return kf * weight[:, None], s, v


@triton.jit
def favor_split_kernel(
    XQ, XK, EQ, EK, V, W, KEEP, PART, LEV, ST, LV,
    H, N, D, EDIM, M, DV, e_batch_stride, SEG, NSEG, NVB, NMB,
    CAUSAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_KEEP: tl.constexpr, LOW: tl.constexpr, PREC: tl.constexpr,
    STATES_ONLY: tl.constexpr, HAS_INIT: tl.constexpr,
    BC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """One feature block's part of FAVOR+ attention (module docstring).

    Layouts (contiguous): ``XQ, XK [B, H, N, D]``; ``EQ, EK [B|1, H, N, EDIM]``;
    ``V [B, H, N, DV]``; ``W [M, D + EDIM]``; ``KEEP [B, N]``; ``PART [B H, NMB, N, DV + 1]``
    (numerators, then the denominator); ``LEV [B H, NMB, N]``. Program axis 1 is the feature
    block, axis 2 ``value block + NVB * segment``. ``ST [B H, NMB, NSEG, BM, DV + 1]`` and
    ``LV [B H, NMB, NSEG]``: a segment's key state per feature block, written
    (``STATES_ONLY``) or read (``HAS_INIT``) as :func:`flt.ops.triton.kernels.favor_attention_kernel`
    does for all ``M`` features.
    """
    bh = tl.program_id(0)
    fb = tl.program_id(1)
    vb = tl.program_id(2) % NVB
    seg = tl.program_id(2) // NVB
    b = bh // H
    h = bh % H
    ACC = PART.dtype.element_ty
    # 0.5 log m of all M features (the normaliser of phi), in the accumulation type.
    log_norm = 0.5 * tl.log(tl.full((), M, ACC))
    MB = M - fb * BM  # features from this block's first on: the block has min(BM, MB)
    XQ += bh * N * D
    XK += bh * N * D
    V += bh * N * DV
    EQ += b * e_batch_stride + h * N * EDIM
    EK += b * e_batch_stride + h * N * EDIM
    KEEP += b * N
    W += fb * BM * (D + EDIM)
    PART += (bh * NMB + fb) * N * (DV + 1)
    LEV += (bh * NMB + fb) * N
    ST += ((bh * NMB + fb) * NSEG + seg) * BM * (DV + 1)
    LV += (bh * NMB + fb) * NSEG + seg
    lo = seg * SEG
    hi = tl.minimum(N, lo + SEG)

    WX, WE = _projection(W, D, EDIM, MB, HAS_EXTRA, ACC, BD, BE, BM)
    vcols = vb * BV + tl.arange(0, BV)
    vcol_ok = vcols < DV
    state, zsum, level = _start_state(ST, LV, vcols, vcol_ok, MB, DV, HAS_INIT, ACC, BM, BV)
    offs = tl.arange(0, BC)

    if STATES_ONLY or (not CAUSAL and not HAS_INIT):
        # Key pass: the block's state of the segment's keys (of all keys: bidirectional, one segment).
        for start in range(lo, hi, BC):
            rows = start + offs
            ok = rows < hi
            kw, s, v = _keys(XK, EK, V, KEEP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
                             HAS_EXTRA, HAS_KEEP, ACC, PREC, BD, BE, BM)
            state, zsum, level = _absorb(state, zsum, level, kw, s, v, LOW, PREC, ACC)
    if STATES_ONLY:
        _store_state(ST, LV, state, zsum, level, vb, vcols, vcol_ok, MB, DV, BM)
    elif CAUSAL:
        past = offs[:, None] >= offs[None, :]
        for start in range(lo, hi, BC):
            rows = start + offs
            ok = rows < hi
            kw, s, v = _keys(XK, EK, V, KEEP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
                             HAS_EXTRA, HAS_KEEP, ACC, PREC, BD, BE, BM)
            qf, sq = _features(XQ, EQ, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, MB, PREC)
            row_level = tl.maximum(tl.max(tl.where(past, s[None, :], _NO_KEY), axis=1), level)  # [BC]
            decay = tl.exp(tl.where(past, s[None, :] - row_level[:, None], float("-inf")))
            carry = tl.exp(level - row_level)
            scores = tl.dot(qf, tl.trans(kw), input_precision=PREC, out_dtype=ACC) * decay
            num = tl.dot(scores, v, input_precision=PREC, out_dtype=ACC)
            num += tl.dot(qf, state, input_precision=PREC, out_dtype=ACC) * carry[:, None]
            den = tl.sum(scores, axis=1) + tl.sum(qf * zsum[None, :], axis=1) * carry
            _store_part(PART, LEV, rows, ok, vcols, vcol_ok, num, den, sq + row_level, vb, DV)
            state, zsum, level = _absorb(state, zsum, level, kw, s, v, False, PREC, ACC)
    else:
        for start in range(lo, hi, BC):
            rows = start + offs
            ok = rows < hi
            qf, sq = _features(XQ, EQ, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, MB, PREC)
            if LOW:
                num = tl.dot(qf.to(tl.bfloat16), state.to(tl.bfloat16), out_dtype=ACC)
            else:
                num = tl.dot(qf, state, input_precision=PREC, out_dtype=ACC)
            den = tl.sum(qf * zsum[None, :], axis=1)
            _store_part(PART, LEV, rows, ok, vcols, vcol_ok, num, den, sq + level, vb, DV)


@triton.jit
def _upstream(G, LEV, TOP, rows, ok, vcols, vcol_ok, DV, ACC: tl.constexpr):
    """The upstream gradient of a chunk's rows for this feature block: ``(gn [BC, BV], gd [BC])``,
    the gradient of the numerators and of the denominator (``G [B H, N, DV + 1]``) times the
    factor ``exp(LEV - TOP)`` the forward added the block's part with (0 past the end)."""
    scale = tl.exp(tl.load(LEV + rows, mask=ok, other=0.0).to(ACC) - tl.load(TOP + rows, mask=ok, other=0.0).to(ACC))
    scale = tl.where(ok, scale, 0.0)
    gn = tl.load(G + rows[:, None] * (DV + 1) + vcols[None, :], mask=ok[:, None] & vcol_ok[None, :], other=0.0).to(ACC)
    gd = tl.load(G + rows * (DV + 1) + DV, mask=ok, other=0.0).to(ACC)
    return gn * scale[:, None], gd * scale


@triton.jit
def _input_gradient(DX, DE, X, E, dfx, rows, ok, D, EDIM, WX, WE, WITH_NORM: tl.constexpr, HAS_EXTRA: tl.constexpr,
                    ACC: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """Write a chunk's part of ``d x`` (and ``d e``) from ``dfx = dL/dfeat * feat`` ``[BC, BM]``:
    ``W^T dfx``, less ``x sum_k dfx`` (``WITH_NORM``: the ``-|x|^2 / 2`` of a key's
    features; a query's cancels in the ratio)."""
    cols = tl.arange(0, BD)
    part = tl.dot(dfx, tl.trans(WX), input_precision=PREC, out_dtype=ACC)
    total = tl.sum(dfx, axis=1)
    if WITH_NORM:
        x = tl.load(X + rows[:, None] * D + cols[None, :], mask=ok[:, None] & (cols[None, :] < D), other=0.0).to(ACC)
        part -= x * total[:, None]
    tl.store(DX + rows[:, None] * D + cols[None, :], part, mask=ok[:, None] & (cols[None, :] < D))
    if HAS_EXTRA:
        ecols = tl.arange(0, BE)
        epart = tl.dot(dfx, tl.trans(WE), input_precision=PREC, out_dtype=ACC)
        if WITH_NORM:
            e = tl.load(E + rows[:, None] * EDIM + ecols[None, :], mask=ok[:, None] & (ecols[None, :] < EDIM), other=0.0).to(ACC)
            epart -= e * total[:, None]
        tl.store(DE + rows[:, None] * EDIM + ecols[None, :], epart, mask=ok[:, None] & (ecols[None, :] < EDIM))


@triton.jit
def _query_rows(XQ, EQ, G, LEV, TOP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
                HAS_EXTRA: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr):
    """A chunk of query rows for the key gradients: block features, upstream gradients
    (:func:`_upstream`) and the forward's row levels ``r = LEV - s_q`` (``-_NO_KEY``, above
    every level, past the end)."""
    qf, sq = _features(XQ, EQ, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, MB, PREC)
    gn, gd = _upstream(G, LEV, TOP, rows, ok, vcols, vcol_ok, DV, ACC)
    r = tl.where(ok, tl.load(LEV + rows, mask=ok, other=0.0).to(ACC) - sq, -_NO_KEY)
    return qf, gn, gd, r


@triton.jit
def _absorb_queries(tn, td, lam, qf, gn, gd, r, PREC: tl.constexpr, ACC: tl.constexpr):
    """Add query rows to the query state ``(tn, td)`` held at ``lam``, moved to the new
    least level ``min(lam, min r)``: every factor ``<= 1``."""
    new_lam = tl.minimum(tl.min(r, axis=0), lam)
    qs = qf * tl.exp(new_lam - r)[:, None]
    keep_old = tl.exp(new_lam - lam)
    tn = tn * keep_old + tl.dot(tl.trans(qs), gn, input_precision=PREC, out_dtype=ACC)
    td = td * keep_old + tl.sum(qs * gd[:, None], axis=0)
    return tn, td, new_lam


@triton.jit
def favor_split_dq_kernel(
    XQ, XK, EQ, EK, V, W, KEEP, G, LEV, TOP, DXQ, DEQ, ST, LV,
    H, N, D, EDIM, M, DV, e_batch_stride, SEG, NSEG, NMB,
    CAUSAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_KEEP: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr,
    BC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """Backward, queries: one feature block's part of ``d xq`` (and ``d extra_q``) for one
    segment, in the forward's order and at its levels. ``dL/dqf_i = S(i) gn_i + z(i) gd_i``
    with the running key state ``S, z`` (inside a chunk ``sum_(j <= i) (gn_i.v_j + gd_i)
    decay_ij kw_j``). ``G [B H, N, DV + 1]`` (:func:`flt.ops.triton.split.upstream_gradient`),
    ``LEV [B H, NMB, N]`` and ``TOP [B H, N]`` (its maximum over the blocks) from the forward;
    ``DXQ [B H, NMB, N, D]``, ``DEQ [B H, NMB, N, EDIM]`` the parts. All ``DV`` value columns in
    one program (``BV >= DV``). ``HAS_INIT``: the segment starts from the key state in
    ``ST, LV`` (as :func:`favor_split_kernel` reads it: the keys before the segment, or all
    keys bidirectionally); else one segment."""
    bh = tl.program_id(0)
    fb = tl.program_id(1)
    seg = tl.program_id(2)
    b = bh // H
    h = bh % H
    ACC = DXQ.dtype.element_ty
    log_norm = 0.5 * tl.log(tl.full((), M, ACC))
    MB = M - fb * BM
    XQ += bh * N * D
    XK += bh * N * D
    V += bh * N * DV
    EQ += b * e_batch_stride + h * N * EDIM
    EK += b * e_batch_stride + h * N * EDIM
    KEEP += b * N
    W += fb * BM * (D + EDIM)
    G += bh * N * (DV + 1)
    LEV += (bh * NMB + fb) * N
    TOP += bh * N
    DXQ += (bh * NMB + fb) * N * D
    DEQ += (bh * NMB + fb) * N * EDIM
    ST += ((bh * NMB + fb) * NSEG + seg) * BM * (DV + 1)
    LV += (bh * NMB + fb) * NSEG + seg
    lo = seg * SEG
    hi = tl.minimum(N, lo + SEG)

    WX, WE = _projection(W, D, EDIM, MB, HAS_EXTRA, ACC, BD, BE, BM)
    vcols = tl.arange(0, BV)
    vcol_ok = vcols < DV
    state, zsum, level = _start_state(ST, LV, vcols, vcol_ok, MB, DV, HAS_INIT, ACC, BM, BV)
    offs = tl.arange(0, BC)
    if not CAUSAL and not HAS_INIT:
        for start in range(0, N, BC):
            rows = start + offs
            ok = rows < N
            kw, s, v = _keys(XK, EK, V, KEEP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
                             HAS_EXTRA, HAS_KEEP, ACC, PREC, BD, BE, BM)
            state, zsum, level = _absorb(state, zsum, level, kw, s, v, False, PREC, ACC)
    past = offs[:, None] >= offs[None, :]
    for start in range(lo, hi, BC):
        rows = start + offs
        ok = rows < hi
        qf, _sq = _features(XQ, EQ, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, MB, PREC)
        gn, gd = _upstream(G, LEV, TOP, rows, ok, vcols, vcol_ok, DV, ACC)
        dqf = tl.dot(gn, tl.trans(state), input_precision=PREC, out_dtype=ACC) + gd[:, None] * zsum[None, :]
        if CAUSAL:
            kw, s, v = _keys(XK, EK, V, KEEP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
                             HAS_EXTRA, HAS_KEEP, ACC, PREC, BD, BE, BM)
            row_level = tl.maximum(tl.max(tl.where(past, s[None, :], _NO_KEY), axis=1), level)
            decay = tl.exp(tl.where(past, s[None, :] - row_level[:, None], float("-inf")))
            carry = tl.exp(level - row_level)
            ds = (tl.dot(gn, tl.trans(v), input_precision=PREC, out_dtype=ACC) + gd[:, None]) * decay
            dqf = dqf * carry[:, None] + tl.dot(ds, kw, input_precision=PREC, out_dtype=ACC)
            state, zsum, level = _absorb(state, zsum, level, kw, s, v, False, PREC, ACC)
        _input_gradient(DXQ, DEQ, XQ, EQ, dqf * qf, rows, ok, D, EDIM, WX, WE, False, HAS_EXTRA, ACC, PREC, BD, BE)


@triton.jit
def favor_split_dkv_kernel(
    XQ, XK, EQ, EK, V, W, KEEP, G, LEV, TOP, DXK, DEK, DV_, ST, LV,
    H, N, D, EDIM, M, DV, e_batch_stride, SEG, NSEG, NMB,
    CAUSAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_KEEP: tl.constexpr, PREC: tl.constexpr,
    STATES_ONLY: tl.constexpr, HAS_INIT: tl.constexpr,
    BC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """Backward, keys and values: one feature block's part of ``d xk``, ``d extra_k`` and
    ``d v`` for one segment, walking its chunks from the last. The query state
    ``T = sum_i exp(lam - r_i) qf_i [gn_i, gd_i]^T`` over the rows after the chunk (all rows:
    bidirectional) is kept at ``lam``, the least row level ``r_i`` it holds (levels grow
    with ``i``, so every factor is ``<= 1``; a key ``j`` before them has
    ``s_j <= r_j <= lam``). A row's level is the forward's, ``r_i = LEV_i - s_q(i)`` (the
    query's block shift recomputed), so that the weights here are the forward's:
    ``w_ij = exp(s_j - r_i) qf_i.kw_j`` for ``j <= i`` (all ``j``: bidirectional). Then
    ``dL/dkf_j = sum_i w_ij (gn_i.v_j + gd_i) qf_i`` and ``dv_j = sum_i w_ij gn_i``.

    Segments as :func:`favor_split_kernel`, with the query state in ``ST [B H, NMB, NSEG,
    BM, DV + 1]`` (``T``'s ``gd`` column last) and ``lam`` in ``LV``: ``STATES_ONLY`` writes
    the segment's own rows' state, ``HAS_INIT`` starts from the caller's combination (the
    rows after the segment; all rows bidirectionally). Other layouts as
    :func:`favor_split_dq_kernel`; ``DV_ [B H, NMB, N, DV]``."""
    bh = tl.program_id(0)
    fb = tl.program_id(1)
    seg = tl.program_id(2)
    b = bh // H
    h = bh % H
    ACC = DXK.dtype.element_ty
    log_norm = 0.5 * tl.log(tl.full((), M, ACC))
    MB = M - fb * BM
    XQ += bh * N * D
    XK += bh * N * D
    V += bh * N * DV
    EQ += b * e_batch_stride + h * N * EDIM
    EK += b * e_batch_stride + h * N * EDIM
    KEEP += b * N
    W += fb * BM * (D + EDIM)
    G += bh * N * (DV + 1)
    LEV += (bh * NMB + fb) * N
    TOP += bh * N
    DXK += (bh * NMB + fb) * N * D
    DEK += (bh * NMB + fb) * N * EDIM
    DV_ += (bh * NMB + fb) * N * DV
    ST += ((bh * NMB + fb) * NSEG + seg) * BM * (DV + 1)
    LV += (bh * NMB + fb) * NSEG + seg
    lo = seg * SEG
    hi = tl.minimum(N, lo + SEG)

    WX, WE = _projection(W, D, EDIM, MB, HAS_EXTRA, ACC, BD, BE, BM)
    vcols = tl.arange(0, BV)
    vcol_ok = vcols < DV
    offs = tl.arange(0, BC)
    if HAS_INIT:
        tn, td, lam = _start_state(ST, LV, vcols, vcol_ok, MB, DV, True, ACC, BM, BV)
    else:  # no rows held yet: every factor exp(. - lam) is 0
        tn = tl.zeros([BM, BV], dtype=ACC)
        td = tl.zeros([BM], dtype=ACC)
        lam = tl.full([], -_NO_KEY, ACC)
    if STATES_ONLY or (not CAUSAL and not HAS_INIT):
        # Query pass: the state of the segment's rows (of all rows: bidirectional, one segment).
        for start in range(lo, hi, BC):
            rows = start + offs
            ok = rows < hi
            qf, gn, gd, r = _query_rows(XQ, EQ, G, LEV, TOP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
                                        HAS_EXTRA, ACC, PREC, BD, BE, BM)
            tn, td, lam = _absorb_queries(tn, td, lam, qf, gn, gd, r, PREC, ACC)
    if STATES_ONLY:
        _store_state(ST, LV, tn, td, lam, 0, vcols, vcol_ok, MB, DV, BM)
    else:
        past = offs[:, None] >= offs[None, :]  # [i, j]: query i sees key j
        chunks = tl.cdiv(hi - lo, BC)
        for step in range(0, chunks):
            start = lo + ((chunks - 1 - step) * BC if CAUSAL else step * BC)
            rows = start + offs
            ok = rows < hi
            kw, s, v = _keys(XK, EK, V, KEEP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
                             HAS_EXTRA, HAS_KEEP, ACC, PREC, BD, BE, BM)
            key_scale = tl.exp(s - lam)  # [BC], <= 1
            dv = tl.dot(kw * key_scale[:, None], tn, input_precision=PREC, out_dtype=ACC)
            dkf = (tl.dot(v, tl.trans(tn), input_precision=PREC, out_dtype=ACC) + td[None, :]) * key_scale[:, None]
            if CAUSAL:
                qf, gn, gd, r = _query_rows(XQ, EQ, G, LEV, TOP, WX, WE, rows, ok, vcols, vcol_ok, D, EDIM, DV, MB, log_norm,
                                            HAS_EXTRA, ACC, PREC, BD, BE, BM)
                decay = tl.exp(tl.where(past, s[None, :] - r[:, None], float("-inf")))  # [i, j]
                wts = tl.dot(qf, tl.trans(kw), input_precision=PREC, out_dtype=ACC) * decay
                dv += tl.dot(tl.trans(wts), gn, input_precision=PREC, out_dtype=ACC)
                ds = (tl.dot(gn, tl.trans(v), input_precision=PREC, out_dtype=ACC) + gd[:, None]) * decay
                dkf += tl.dot(tl.trans(ds), qf, input_precision=PREC, out_dtype=ACC)
                tn, td, lam = _absorb_queries(tn, td, lam, qf, gn, gd, r, PREC, ACC)
            tl.store(DV_ + rows[:, None] * DV + vcols[None, :], dv, mask=ok[:, None] & vcol_ok[None, :])
            _input_gradient(DXK, DEK, XK, EK, dkf * kw, rows, ok, D, EDIM, WX, WE, True, HAS_EXTRA, ACC, PREC, BD, BE)
