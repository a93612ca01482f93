"""Triton kernels of the FAVOR+ linear attention core: Performer, FLT logit and multiplicative.

Imported only by :mod:`flt.ops.triton` once it has checked that triton is installed (and,
for CPU tensors, that ``TRITON_INTERPRET=1`` was set before this import: triton decides at
decoration time whether a kernel is compiled or interpreted).

One kernel, :func:`favor_attention_kernel`, in the chunked style of fast linear-attention
kernels: one program per (batch x head, spectral index ``r``, block of value columns)
walks the sequence in chunks of ``BC`` tokens. FAVOR+ features are computed inside the
kernel from the scaled queries/keys and the projection (``[B, H, N, m]`` features never
reach memory) and everything accumulates in float32 or float64. Each program writes the
numerator columns of its value block and, in the first value block, the denominator
into ``OUT [B, H, N, Dv + 1]``; the caller divides. Products: IEEE float32/float64
(``PREC``), TF32 where the caller allows it, and bfloat16 operands with float32
accumulation (``LOW``) for bfloat16 inputs and positive weights.

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
def favor_attention_kernel(
    XQ, XK, EQ, EK, A, C, V, W, KEEP, OUT,
    H, N, D, EDIM, M, DV, R2, e_batch_stride, ac_batch_stride, log_norm,
    CAUSAL: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_MASK: tl.constexpr, HAS_KEEP: tl.constexpr,
    ATOMIC: tl.constexpr, LOW: tl.constexpr, PREC: tl.constexpr,
    BC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """Numerators and denominators of FAVOR+ attention; module docstring.

    Layouts (contiguous): ``XQ, XK [B, H, N, D]``; ``EQ, EK [B|1, H, N, EDIM]`` (logit
    coupling: the spectral features joined to the inputs of FAVOR+); ``A, C [B|1, H, N, R2]``
    (multiplicative coupling); ``V [B, H, N, DV]``; ``W [M, D + EDIM]``; ``KEEP [B, N]``
    (1 for a real key, 0 for padding); ``OUT [B, H, N, DV + 1]``, zeroed when ``ATOMIC``.
    """
    bh = tl.program_id(0)
    r = tl.program_id(1)
    vb = tl.program_id(2)
    b = bh // H
    h = bh % H
    ACC = OUT.dtype.element_ty
    XQ += bh * N * D
    XK += bh * N * D
    V += bh * N * DV
    OUT += bh * N * (DV + 1)
    EQ += b * e_batch_stride + h * N * EDIM
    EK += b * e_batch_stride + h * N * EDIM
    A += b * ac_batch_stride + h * N * R2 + r
    C += b * ac_batch_stride + h * N * R2 + r
    KEEP += b * N

    # The projection, transposed: [BD, BM] acting on x and [BE, BM] on the extra inputs.
    fm = tl.arange(0, BM)
    fd = tl.arange(0, BD)
    WX = tl.load(W + fm[None, :] * (D + EDIM) + fd[:, None], mask=(fm[None, :] < M) & (fd[:, None] < D), other=0.0).to(ACC)
    WE = WX
    if HAS_EXTRA:
        fe = tl.arange(0, BE)
        WE = tl.load(W + fm[None, :] * (D + EDIM) + D + fe[:, None], mask=(fm[None, :] < M) & (fe[:, None] < EDIM), other=0.0).to(ACC)

    vcols = vb * BV + tl.arange(0, BV)
    vcol_ok = vcols < DV
    state = tl.zeros([BM, BV], dtype=ACC)
    zsum = tl.zeros([BM], dtype=ACC)
    level = tl.full([], _NO_KEY, ACC)
    offs = tl.arange(0, BC)

    if CAUSAL:
        for start in range(0, N, BC):
            rows = start + offs
            ok = rows < N
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
            if LOW:
                scores = tl.dot(qf.to(tl.bfloat16), tl.trans(kw).to(tl.bfloat16), out_dtype=ACC) * decay
                num = tl.dot(scores.to(tl.bfloat16), v.to(tl.bfloat16), out_dtype=ACC)
                carry = tl.exp(level - row_level)
                num += tl.dot(qf.to(tl.bfloat16), state.to(tl.bfloat16), out_dtype=ACC) * carry[:, None]
            else:
                scores = tl.dot(qf, tl.trans(kw), input_precision=PREC, out_dtype=ACC) * decay
                num = tl.dot(scores, v, input_precision=PREC, out_dtype=ACC)
                carry = tl.exp(level - row_level)
                num += tl.dot(qf, state, input_precision=PREC, out_dtype=ACC) * carry[:, None]
            den = tl.sum(scores, axis=1) + tl.sum(qf * zsum[None, :], axis=1) * carry
            _emit(OUT, A, rows, ok, vcols, vcol_ok, num, den, vb, DV, R2, HAS_MASK, ATOMIC, ACC)
            new_level = tl.maximum(level, tl.max(s, axis=0))
            kw = kw * tl.exp(s - new_level)[:, None]
            keep_old = tl.exp(level - new_level)
            if LOW:
                state = state * keep_old + tl.dot(tl.trans(kw).to(tl.bfloat16), v.to(tl.bfloat16), out_dtype=ACC)
            else:
                state = state * keep_old + tl.dot(tl.trans(kw), v, input_precision=PREC, out_dtype=ACC)
            zsum = zsum * keep_old + tl.sum(kw, axis=0)
            level = new_level
    else:
        for start in range(0, N, BC):
            rows = start + offs
            ok = rows < N
            kf, s = _features(XK, EK, WX, WE, rows, ok, D, EDIM, log_norm, HAS_EXTRA, ACC, BD, BE, BM, M, PREC)
            weight = tl.where(ok, 1.0, 0.0).to(ACC)
            if HAS_KEEP:
                weight *= tl.load(KEEP + rows, mask=ok, other=0.0).to(ACC)
            s = tl.where(weight != 0, s, _NO_KEY)
            if HAS_MASK:
                weight *= tl.load(C + rows * R2, mask=ok, other=0.0).to(ACC)
            v = tl.load(V + rows[:, None] * DV + vcols[None, :], mask=ok[:, None] & vcol_ok[None, :], other=0.0).to(ACC)
            new_level = tl.maximum(level, tl.max(s, axis=0))
            kw = kf * (weight * tl.exp(s - new_level))[:, None]
            keep_old = tl.exp(level - new_level)
            if LOW:
                state = state * keep_old + tl.dot(tl.trans(kw).to(tl.bfloat16), v.to(tl.bfloat16), out_dtype=ACC)
            else:
                state = state * keep_old + tl.dot(tl.trans(kw), v, input_precision=PREC, out_dtype=ACC)
            zsum = zsum * keep_old + tl.sum(kw, axis=0)
            level = new_level
        for start in range(0, N, BC):
            rows = start + offs
            ok = rows < N
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
