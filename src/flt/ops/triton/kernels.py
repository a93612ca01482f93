"""Triton kernels of the FAVOR+ linear attention core: Performer, FLT logit and multiplicative.

Imported only by :mod:`flt.ops.triton.launch` once it has checked that triton is installed (and,
for CPU tensors, that ``TRITON_INTERPRET=1`` was set before this import: triton decides at
decoration time whether a kernel is compiled or interpreted).

One kernel, :func:`favor_attention_kernel`, in the chunked style of fast linear-attention
kernels: one program per (batch x head, spectral index ``r``, block of value columns,
segment of the sequence) walks its segment in chunks of ``BC`` tokens. With several
segments (short of programs otherwise: ``B x H`` small against the GPU) a first launch
writes every segment's key state, the caller combines them (:func:`flt.ops.triton.launch.combine_segments`), and a
second launch starts each segment from the keys before it. FAVOR+ features are computed inside the
kernel from the scaled queries/keys and the projection (``[B, H, N, m]`` features never
reach memory) and everything accumulates in float32 or float64. Each program writes the
numerator columns of its value block and, in the first value block, the denominator
into ``OUT [B, H, N, Dv + 1]``; the caller divides. Products: IEEE float32/float64
(``PREC``), TF32 where the caller allows it, and bfloat16 operands with float32
accumulation (``LOW``) for bfloat16 inputs and positive weights in the bidirectional pass
(the caller never sets it for the causal pass: on an H200 its bfloat16 products gave
infinite outputs).

The multiplicative coupling ``sum_r a_ir c_jr (qf_i.kf_j)`` is a sum over ``r`` of plain
linear attentions with scalar per-query and per-key factors: program ``r`` computes its
term and adds it to ``OUT`` atomically (``R2 > 1``), so its state is ``[m, BV]``, never
``[2R, m, Dv]``. Its features are recomputed by every ``r`` program.

Stabilisation (as :mod:`flt.ops.linear`): a key's FAVOR+ log scale ``s_j`` goes into the
state relative to a running level, the maximum of the ``s`` seen. Bidirectional: one pass
over the keys with online rescaling, then one pass over the queries. Causal: row ``i``'s
level is ``max(level before the chunk, max_(j <= i in the chunk) s_j)``, so nothing in row
``i`` depends on a key after ``i``.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Log scale of keys that carry no weight (padding, or past the end of the sequence):
#: finite, so levels built from them never give ``-inf - -inf``.
_NO_KEY = tl.constexpr(-1.0e30)


@triton.jit
def _features(X, E, WX, WE, rows, row_ok, D, EDIM, log_norm,
              HAS_EXTRA: tl.constexpr, ACC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr,
              M, PREC: tl.constexpr):
    """FAVOR+ features of ``[x, e]`` for rows ``rows`` ([BC]): ``(feat [BC, BM], s [BC])`` with
    ``phi = feat * exp(s)``; ``WX [BD, BM]`` and ``WE [BE, BM]`` are the loaded, transposed
    projection blocks."""
    cols = tl.arange(0, BD)
    x = tl.load(X + rows[:, None] * D + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < D), other=0.0).to(ACC)
    proj = tl.dot(x, WX, input_precision=PREC, out_dtype=ACC)
    half = tl.sum(x * x, axis=1)
    if HAS_EXTRA:
        ecols = tl.arange(0, BE)
        e = tl.load(E + rows[:, None] * EDIM + ecols[None, :], mask=row_ok[:, None] & (ecols[None, :] < EDIM), other=0.0).to(ACC)
        proj += tl.dot(e, WE, input_precision=PREC, out_dtype=ACC)
        half += tl.sum(e * e, axis=1)
    feature_ok = tl.arange(0, BM) < M
    proj = tl.where(feature_ok[None, :], proj, float("-inf"))
    top = tl.max(proj, axis=1)
    feat = tl.exp(proj - top[:, None])
    return feat, top - 0.5 * half - log_norm


@triton.jit
def _projection(W, D, EDIM, M, HAS_EXTRA: tl.constexpr, ACC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr):
    """The projection, transposed: ``WX [BD, BM]`` acting on x and ``WE [BE, BM]`` on the
    extra inputs (``WX`` again without them)."""
    fm = tl.arange(0, BM)
    fd = tl.arange(0, BD)
    WX = tl.load(W + fm[None, :] * (D + EDIM) + fd[:, None], mask=(fm[None, :] < M) & (fd[:, None] < D), other=0.0).to(ACC)
    WE = WX
    if HAS_EXTRA:
        fe = tl.arange(0, BE)
        WE = tl.load(W + fm[None, :] * (D + EDIM) + D + fe[:, None], mask=(fm[None, :] < M) & (fe[:, None] < EDIM), other=0.0).to(ACC)
    return WX, WE


@triton.jit
def _start_state(ST, LV, vcols, vcol_ok, M, DV, HAS_INIT: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr):
    """``(state [BM, BV], key sums [BM], level)``: read from ``ST``/``LV`` (``HAS_INIT``) or empty."""
    fm = tl.arange(0, BM)
    if HAS_INIT:
        state = tl.load(ST + fm[:, None] * (DV + 1) + vcols[None, :], mask=(fm[:, None] < M) & vcol_ok[None, :], other=0.0).to(ACC)
        zsum = tl.load(ST + fm * (DV + 1) + DV, mask=fm < M, other=0.0).to(ACC)
        level = tl.load(LV).to(ACC)
    else:
        state = tl.zeros([BM, BV], dtype=ACC)
        zsum = tl.zeros([BM], dtype=ACC)
        level = tl.full([], _NO_KEY, ACC)
    return state, zsum, level


@triton.jit
def _store_state(ST, LV, state, zsum, level, vb, vcols, vcol_ok, M, DV, BM: tl.constexpr):
    """Write a segment's key state, and (first value block) its key sums and level."""
    fm = tl.arange(0, BM)
    tl.store(ST + fm[:, None] * (DV + 1) + vcols[None, :], state, mask=(fm[:, None] < M) & vcol_ok[None, :])
    if vb == 0:
        tl.store(ST + fm * (DV + 1) + DV, zsum, mask=fm < M)
        tl.store(LV, level)


@triton.jit
def _absorb(state, zsum, level, kw, s, v, LOW: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """Add the keys ``kw [BC, BM]`` (features times their weights) with log scales ``s``
    and values ``v`` to the state, rescaled to the new level ``max(level, max s)``."""
    new_level = tl.maximum(level, tl.max(s, axis=0))
    kw = kw * tl.exp(s - new_level)[:, None]
    keep_old = tl.exp(level - new_level)
    if LOW:
        state = state * keep_old + tl.dot(tl.trans(kw).to(tl.bfloat16), v.to(tl.bfloat16), out_dtype=ACC)
    else:
        state = state * keep_old + tl.dot(tl.trans(kw), v, input_precision=PREC, out_dtype=ACC)
    zsum = zsum * keep_old + tl.sum(kw, axis=0)
    return state, zsum, new_level


@triton.jit
def favor_attention_kernel(
    XQ, XK, EQ, EK, A, C, V, W, KEEP, OUT, ST, LV,
    H, N, D, EDIM, M, DV, R2, e_batch_stride, ac_batch_stride, SEG, NSEG, NVB,
    CAUSAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_MASK: tl.constexpr, HAS_KEEP: tl.constexpr,
    ATOMIC: tl.constexpr, LOW: tl.constexpr, PREC: tl.constexpr, STATES_ONLY: tl.constexpr, HAS_INIT: tl.constexpr,
    BC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """Numerators and denominators of FAVOR+ attention; module docstring.

    Layouts (contiguous): ``XQ, XK [B, H, N, D]``; ``EQ, EK [B|1, H, N, EDIM]`` (logit
    coupling: the spectral features joined to the inputs of FAVOR+); ``A, C [B|1, H, N, R2]``
    (multiplicative coupling); ``V [B, H, N, DV]``; ``W [M, D + EDIM]``; ``KEEP [B, N]``
    (1 for a real key, 0 for padding); ``OUT [B, H, N, DV + 1]``, zeroed when ``ATOMIC``.

    Segments: program axis 2 is ``value block + NVB * segment``, a segment the tokens
    ``[SEG * s, SEG * (s + 1))``. ``STATES_ONLY``: write the segment's key state and its
    level into ``ST [B * H, R2, NSEG, M, DV + 1]`` (the key sums in the last column) and
    ``LV [B * H, R2, NSEG]``, nothing else. ``HAS_INIT``: start from the state and level
    found there (the caller's combination of the segments: the keys before the segment
    when causal, all keys otherwise) and write the segment's outputs. Neither: one segment
    of all ``N`` tokens, bidirectional in two passes.
    """
    bh = tl.program_id(0)
    r = tl.program_id(1)
    vb = tl.program_id(2) % NVB
    seg = tl.program_id(2) // NVB
    b = bh // H
    h = bh % H
    ACC = OUT.dtype.element_ty
    # 0.5 log m in the accumulation type: a Python float argument reaches a compiled kernel
    # as float32, which shifted the band's far-field weights against its exact ones by 1e-7.
    log_norm = 0.5 * tl.log(tl.full((), M, ACC))  # (tl.full: M may arrive as a compile-time constant)
    XQ += bh * N * D
    XK += bh * N * D
    V += bh * N * DV
    OUT += bh * N * (DV + 1)
    EQ += b * e_batch_stride + h * N * EDIM
    EK += b * e_batch_stride + h * N * EDIM
    A += b * ac_batch_stride + h * N * R2 + r
    C += b * ac_batch_stride + h * N * R2 + r
    KEEP += b * N
    ST += ((bh * R2 + r) * NSEG + seg) * M * (DV + 1)
    LV += (bh * R2 + r) * NSEG + seg
    lo = seg * SEG
    hi = tl.minimum(N, lo + SEG)

    WX, WE = _projection(W, D, EDIM, M, HAS_EXTRA, ACC, BD, BE, BM)
    vcols = vb * BV + tl.arange(0, BV)
    vcol_ok = vcols < DV
    state, zsum, level = _start_state(ST, LV, vcols, vcol_ok, M, DV, HAS_INIT, ACC, BM, BV)
    offs = tl.arange(0, BC)

    if STATES_ONLY or (not CAUSAL and not HAS_INIT):
        # Key pass: the state of the segment's keys (of all keys: bidirectional, one segment).
        for start in range(lo, hi, BC):
            rows = start + offs
            ok = rows < hi
            kf, s = _features(XK, EK, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, M, PREC)
            weight = tl.where(ok, 1.0, 0.0).to(ACC)
            if HAS_KEEP:
                weight *= tl.load(KEEP + rows, mask=ok, other=0.0).to(ACC)
            s = tl.where(weight != 0, s, _NO_KEY)
            if HAS_MASK:
                weight *= tl.load(C + rows * R2, mask=ok, other=0.0).to(ACC)
            v = tl.load(V + rows[:, None] * DV + vcols[None, :], mask=ok[:, None] & vcol_ok[None, :], other=0.0).to(ACC)
            state, zsum, level = _absorb(state, zsum, level, kf * weight[:, None], s, v, LOW, PREC, ACC)
    if STATES_ONLY:
        _store_state(ST, LV, state, zsum, level, vb, vcols, vcol_ok, M, DV, BM)
    elif CAUSAL:
        for start in range(lo, hi, BC):
            rows = start + offs
            ok = rows < hi
            kf, s = _features(XK, EK, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, M, PREC)
            qf, _ = _features(XQ, EQ, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, M, PREC)
            weight = tl.where(ok, 1.0, 0.0).to(ACC)
            if HAS_KEEP:
                weight *= tl.load(KEEP + rows, mask=ok, other=0.0).to(ACC)
            s = tl.where(weight != 0, s, _NO_KEY)
            if HAS_MASK:
                weight *= tl.load(C + rows * R2, mask=ok, other=0.0).to(ACC)
            v = tl.load(V + rows[:, None] * DV + vcols[None, :], mask=ok[:, None] & vcol_ok[None, :], other=0.0).to(ACC)
            past = offs[:, None] >= offs[None, :]
            row_level = tl.maximum(tl.max(tl.where(past, s[None, :], _NO_KEY), axis=1), level)  # [BC]
            decay = tl.exp(tl.where(past, s[None, :] - row_level[:, None], float("-inf")))
            kw = kf * weight[:, None]
            carry = tl.exp(level - row_level)
            # No bfloat16 operands here (LOW is never set for the causal pass: module docstring).
            scores = tl.dot(qf, tl.trans(kw), input_precision=PREC, out_dtype=ACC) * decay
            num = tl.dot(scores, v, input_precision=PREC, out_dtype=ACC)
            num += tl.dot(qf, state, input_precision=PREC, out_dtype=ACC) * carry[:, None]
            den = tl.sum(scores, axis=1) + tl.sum(qf * zsum[None, :], axis=1) * carry
            _emit(OUT, A, rows, ok, vcols, vcol_ok, num, den, vb, DV, R2, HAS_MASK, ATOMIC, ACC)
            state, zsum, level = _absorb(state, zsum, level, kw, s, v, False, PREC, ACC)
    else:
        for start in range(lo, hi, BC):
            rows = start + offs
            ok = rows < hi
            qf, _ = _features(XQ, EQ, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, M, PREC)
            if LOW:
                num = tl.dot(qf.to(tl.bfloat16), state.to(tl.bfloat16), out_dtype=ACC)
            else:
                num = tl.dot(qf, state, input_precision=PREC, out_dtype=ACC)
            den = tl.sum(qf * zsum[None, :], axis=1)
            _emit(OUT, A, rows, ok, vcols, vcol_ok, num, den, vb, DV, R2, HAS_MASK, ATOMIC, ACC)


@triton.jit
def _emit(OUT, A, rows, ok, vcols, vcol_ok, num, den, vb, DV, R2,
          HAS_MASK: tl.constexpr, ATOMIC: tl.constexpr, ACC: tl.constexpr):
    """Write (or, for one term of the multiplicative coupling, add) a chunk's numerators and,
    from the first value block, its denominators."""
    if HAS_MASK:
        a = tl.load(A + rows * R2, mask=ok, other=0.0).to(ACC)
        num = num * a[:, None]
        den = den * a
    where = OUT + rows[:, None] * (DV + 1) + vcols[None, :]
    if ATOMIC:
        tl.atomic_add(where, num, mask=ok[:, None] & vcol_ok[None, :])
        if vb == 0:
            tl.atomic_add(OUT + rows * (DV + 1) + DV, den, mask=ok)
    else:
        tl.store(where, num, mask=ok[:, None] & vcol_ok[None, :])
        if vb == 0:
            tl.store(OUT + rows * (DV + 1) + DV, den, mask=ok)


@triton.jit
def _band_keys(XK, EK, V, KEEP, BIAS, WX, WE, xq, rows, row_ok, start, N, D, EDIM, M, DV, WIDTH, vcols, vcol_ok, log_norm,
               CAUSAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_KEEP: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
               BC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr):
    """One block of ``BC`` keys from ``start`` seen by the query rows ``rows``: FAVOR+
    features and log scales, values, the exact logits ``x_i.y_j + b_ij`` on the band
    (``-inf`` elsewhere) and the band / far masks ``[BC, BC]``."""
    keys = start + tl.arange(0, BC)
    key_ok = (keys >= 0) & (keys < N)
    kf, s = _features(XK, EK, WX, WE, keys, key_ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, M, PREC)
    if HAS_KEEP:
        key_ok = key_ok & (tl.load(KEEP + keys, mask=key_ok, other=0.0) != 0)
    s = tl.where(key_ok, s, _NO_KEY)
    cols = tl.arange(0, BD)
    xk = tl.load(XK + keys[:, None] * D + cols[None, :], mask=key_ok[:, None] & (cols[None, :] < D), other=0.0).to(ACC)
    v = tl.load(V + keys[:, None] * DV + vcols[None, :], mask=key_ok[:, None] & vcol_ok[None, :], other=0.0).to(ACC)
    off = keys[None, :] - rows[:, None]  # j - i
    live = key_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        live = live & (off <= 0)
    near = live & (off <= WIDTH) & (off >= -WIDTH)
    far = live & ((off > WIDTH) | (off < -WIDTH))
    bias = tl.load(BIAS + rows[:, None] * (2 * WIDTH + 1) + off + WIDTH, mask=near, other=0.0).to(ACC)
    logit = tl.where(near, tl.dot(xq, tl.trans(xk), input_precision=PREC, out_dtype=ACC) + bias, float("-inf"))
    return kf, s, v, logit, near, far, key_ok


@triton.jit
def band_attention_kernel(
    XQ, XK, EQ, EK, V, W, BIAS, KEEP, OUT, ST, LV,
    H, N, D, EDIM, M, DV, WIDTH, e_batch_stride, bias_batch_stride, SEG, NSEG, NVB,
    CAUSAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_KEEP: tl.constexpr, PREC: tl.constexpr,
    STATES_ONLY: tl.constexpr, HAS_INIT: tl.constexpr,
    BC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """FLT's banded estimator (:func:`flt.ops.band.band_attention`): exact weights
    ``exp(x_i.y_j + b_ij)`` for ``|i - j| <= WIDTH``, FAVOR+ estimates of ``[x, a]``,
    ``[y, c]`` elsewhere; numerators and denominators into ``OUT [B, H, N, DV + 1]``.

    ``BC >= WIDTH``, so query chunk ``t`` finds its band in key chunks ``t - 1, t`` (and
    ``t + 1`` bidirectionally). Causal: the linear state holds the chunks ``<= t - 2``, all
    far; chunk ``t - 1`` joins it after chunk ``t``. Bidirectional: the state of all keys,
    from which the window's band estimates are taken out again (as the PyTorch op does).
    Row ``i`` is scaled by ``exp(sq_i + L_i + c_i)``: ``sq`` the query's feature shift,
    ``L`` the key level (over ``j <= i`` when causal), ``c_i >= 0`` its largest band
    exponent above ``sq_i + L_i``; every exponent is then ``<= 0``.
    ``BIAS [B|1, H, N, 2 WIDTH + 1]``; other layouts, ``ST``, ``LV`` and the segments as
    :func:`favor_attention_kernel` (``R2 = 1``), except that a causal segment's key state
    covers the tokens ``[lo - BC, hi - BC)``: what the next segment's state lacks, the chunk
    before it being part of its first window.
    """
    bh = tl.program_id(0)
    vb = tl.program_id(2) % NVB
    seg = tl.program_id(2) // NVB
    b = bh // H
    h = bh % H
    ACC = OUT.dtype.element_ty
    # 0.5 log m in the accumulation type: a Python float argument reaches a compiled kernel
    # as float32, which shifted the band's far-field weights against its exact ones by 1e-7.
    log_norm = 0.5 * tl.log(tl.full((), M, ACC))  # (tl.full: M may arrive as a compile-time constant)
    XQ += bh * N * D
    XK += bh * N * D
    V += bh * N * DV
    OUT += bh * N * (DV + 1)
    EQ += b * e_batch_stride + h * N * EDIM
    EK += b * e_batch_stride + h * N * EDIM
    BIAS += b * bias_batch_stride + h * N * (2 * WIDTH + 1)
    KEEP += b * N
    ST += (bh * NSEG + seg) * M * (DV + 1)
    LV += bh * NSEG + seg
    lo = seg * SEG
    hi = tl.minimum(N, lo + SEG)

    WX, WE = _projection(W, D, EDIM, M, HAS_EXTRA, ACC, BD, BE, BM)
    vcols = vb * BV + tl.arange(0, BV)
    vcol_ok = vcols < DV
    offs = tl.arange(0, BC)
    cols = tl.arange(0, BD)
    state, zsum, level = _start_state(ST, LV, vcols, vcol_ok, M, DV, HAS_INIT, ACC, BM, BV)

    if STATES_ONLY or (not CAUSAL and not HAS_INIT):  # key states, at the level of their largest log scale
        first = lo - BC if CAUSAL else lo
        for start in range(first, first + (hi - lo), BC):
            rows = start + offs
            kf, s, v, _l, _n, _f, key_ok = _band_keys(XK, EK, V, KEEP, BIAS, WX, WE, tl.zeros([BC, BD], dtype=ACC), rows, rows < N,
                                                      start, N, D, EDIM, M, DV, WIDTH, vcols, vcol_ok, log_norm,
                                                      CAUSAL, HAS_EXTRA, HAS_KEEP, ACC, PREC, BC, BD, BE, BM)
            key_ok = key_ok & (rows < first + (hi - lo))
            s = tl.where(key_ok, s, _NO_KEY)
            state, zsum, level = _absorb(state, zsum, level, kf * tl.where(key_ok, 1.0, 0.0)[:, None], s, v, False, PREC, ACC)

    if STATES_ONLY:
        _store_state(ST, LV, state, zsum, level, vb, vcols, vcol_ok, M, DV, BM)
    else:
        for start in range(lo, hi, BC):
            rows = start + offs
            ok = rows < hi
            qf, sq = _features(XQ, EQ, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, M, PREC)
            xq = tl.load(XQ + rows[:, None] * D + cols[None, :], mask=ok[:, None] & (cols[None, :] < D), other=0.0).to(ACC)
            kf_p, s_p, v_p, l_p, near_p, far_p, ok_p = _band_keys(XK, EK, V, KEEP, BIAS, WX, WE, xq, rows, ok, start - BC, N, D, EDIM, M, DV,
                                                                  WIDTH, vcols, vcol_ok, log_norm, CAUSAL, HAS_EXTRA, HAS_KEEP, ACC, PREC,
                                                                  BC, BD, BE, BM)
            kf_c, s_c, v_c, l_c, near_c, far_c, _ok_c = _band_keys(XK, EK, V, KEEP, BIAS, WX, WE, xq, rows, ok, start, N, D, EDIM, M, DV,
                                                                  WIDTH, vcols, vcol_ok, log_norm, CAUSAL, HAS_EXTRA, HAS_KEEP, ACC, PREC,
                                                                  BC, BD, BE, BM)
            top = tl.maximum(tl.max(l_p, axis=1), tl.max(l_c, axis=1))
            if CAUSAL:
                past = offs[:, None] >= offs[None, :]
                row_level = tl.maximum(tl.maximum(level, tl.max(s_p, axis=0)), tl.max(tl.where(past, s_c[None, :], _NO_KEY), axis=1))
            else:
                row_level = level + tl.zeros([BC], dtype=ACC)
                kf_n, s_n, v_n, l_n, near_n, _far_n, _ok_n = _band_keys(XK, EK, V, KEEP, BIAS, WX, WE, xq, rows, ok, start + BC, N, D, EDIM, M,
                                                                      DV, WIDTH, vcols, vcol_ok, log_norm, CAUSAL, HAS_EXTRA, HAS_KEEP,
                                                                      ACC, PREC, BC, BD, BE, BM)
                top = tl.maximum(top, tl.max(l_n, axis=1))
            c = tl.maximum(top - sq - row_level, 0.0)
            far_ref = row_level + c
            near_ref = sq + far_ref
            # Causal: exact weights on the band plus estimates of the window's far keys.
            # Bidirectional: exact weights on the band less their estimates (the state has them).
            pick_p = far_p if CAUSAL else near_p
            pick_c = far_c if CAUSAL else near_c
            sign = 1.0 if CAUSAL else -1.0
            w_p = tl.exp(l_p - near_ref[:, None]) + sign * tl.dot(qf, tl.trans(kf_p), input_precision=PREC, out_dtype=ACC) * tl.exp(
                tl.where(pick_p, s_p[None, :] - far_ref[:, None], float("-inf")))
            w_c = tl.exp(l_c - near_ref[:, None]) + sign * tl.dot(qf, tl.trans(kf_c), input_precision=PREC, out_dtype=ACC) * tl.exp(
                tl.where(pick_c, s_c[None, :] - far_ref[:, None], float("-inf")))
            carry = tl.exp(level - far_ref)
            num = tl.dot(w_p, v_p, input_precision=PREC, out_dtype=ACC) + tl.dot(w_c, v_c, input_precision=PREC, out_dtype=ACC)
            num += tl.dot(qf, state, input_precision=PREC, out_dtype=ACC) * carry[:, None]
            den = tl.sum(w_p, axis=1) + tl.sum(w_c, axis=1) + tl.sum(qf * zsum[None, :], axis=1) * carry
            if not CAUSAL:
                w_n = tl.exp(l_n - near_ref[:, None]) - tl.dot(qf, tl.trans(kf_n), input_precision=PREC, out_dtype=ACC) * tl.exp(
                    tl.where(near_n, s_n[None, :] - far_ref[:, None], float("-inf")))
                num += tl.dot(w_n, v_n, input_precision=PREC, out_dtype=ACC)
                den += tl.sum(w_n, axis=1)
            tl.store(OUT + rows[:, None] * (DV + 1) + vcols[None, :], num, mask=ok[:, None] & vcol_ok[None, :])
            if vb == 0:
                tl.store(OUT + rows * (DV + 1) + DV, den, mask=ok)
            if CAUSAL:  # chunk t - 1 joins the state: every later query sees it as far
                state, zsum, level = _absorb(state, zsum, level, kf_p * tl.where(ok_p, 1.0, 0.0)[:, None], s_p, v_p, False, PREC, ACC)
