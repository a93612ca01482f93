"""Linear attention and the multiplicative (Kronecker) FLT coupling, O(N).

One engine serves both: plain linear attention is the Kronecker coupling with
``a = c = 1`` (``2R = 1``). docs/math.md sections 2 and 4.

Stabilisation. Key features arrive as ``k_feat * exp(key_log_scale)`` (see
:func:`flt.ops.features.favor_plus_features`). Bidirectional attention rescales all keys
by one global maximum; causal attention keeps a running maximum over past keys only and
rescales its state when it grows (the same trick as online softmax), so an output never
depends, not even through rounding or underflow, on a key after it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass

import torch

from flt._checks import check_positive_int, check_state_tensors, check_tensor
from flt._dtype import autocast_dtype
from flt.ops._common import safe_divide

#: Block size of the bidirectional Kronecker path (and the length below which it forms the
#: ``[N, N]`` weights directly); also the default for callers that need one fixed number.
DEFAULT_CHUNK_SIZE = 128


def causal_chunk_size(m: int, two_r: int, dv: int) -> int:
    """The default chunk length of the causal computation, from the shapes.

    Per token, the masked products inside a chunk cost ``2 C (m + 2R + Dv + 1)`` and the
    scan over chunk states (:func:`_scan`, blocks of up to ``S`` chunks) ``2 S 2R m (Dv + 1) / C``:
    their sum is least at ``C* = sqrt(S 2R m (Dv + 1) / (m + 2R + Dv + 1))``. Returned: the
    power of two nearest ``C*`` in ratio, within ``[64, 256]`` (below 64 the many small
    matrix products run far from the machine's peak). Plain linear attention with
    ``m = 256, Dv = 64`` gets 64; the Kronecker coupling with ``m = 64, 2R = 16`` gets 128.
    """
    best = math.sqrt(_SCAN_BLOCK * two_r * m * (dv + 1) / (m + two_r + dv + 1))
    return int(min(256, max(64, 2 ** round(math.log2(best)))))


def _check_features(q_feat, k_feat, v, a=None, c=None, key_log_scale=None) -> None:
    check_tensor("q_feat", q_feat, ndim=4, layout="[B, H, N, m]")
    check_tensor("k_feat", k_feat, ndim=4, layout="[B, H, N, m]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    if q_feat.shape != k_feat.shape:
        raise ValueError(f"q_feat and k_feat must have the same shape, got {tuple(q_feat.shape)} and {tuple(k_feat.shape)}")
    if v.shape[:3] != k_feat.shape[:3]:
        raise ValueError(f"v must be [B, H, N, Dv] matching k_feat {tuple(k_feat.shape[:3])}, got {tuple(v.shape)}")
    if (a is None) != (c is None):
        raise ValueError("a and c must be given together")
    if a is not None:
        B, H, N = q_feat.shape[:3]
        for name, t in (("a", a), ("c", c)):
            check_tensor(name, t, ndim=4, layout="[B or 1, H, N, 2R]")
            if t.shape[0] not in (1, B) or t.shape[1] != H or t.shape[2] != N:
                raise ValueError(f"{name} must be [B or 1, H, N, 2R] = [{B} or 1, {H}, {N}, 2R], got {tuple(t.shape)}")
        if a.shape[-1] != c.shape[-1]:
            raise ValueError(f"a and c must have the same number of spectral features 2R, got {a.shape[-1]} and {c.shape[-1]}")
    if key_log_scale is not None:
        check_tensor("key_log_scale", key_log_scale, ndim=3, layout="[B, H, N]")
        if key_log_scale.shape != k_feat.shape[:3]:
            raise ValueError(f"key_log_scale must be [B, H, N] = {tuple(k_feat.shape[:3])}, got {tuple(key_log_scale.shape)}")


def linear_attention(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, *, causal: bool = False, key_log_scale: torch.Tensor | None = None,
                     chunk_size: int | None = None) -> torch.Tensor:
    """Normalised linear attention ``out_i = qf_i^T S / qf_i^T z`` from nonnegative features.

    Args:
        q_feat, k_feat: ``[B, H, N, m]`` nonnegative features.
        v: ``[B, H, N, Dv]``.
        causal: token ``i`` attends to ``j <= i``; computed in chunks of ``chunk_size``
            with a running ``[m, Dv]`` state, never a per-token prefix sum.
        chunk_size: chunk length; None: :func:`causal_chunk_size` for causal attention,
            :data:`DEFAULT_CHUNK_SIZE` otherwise. The result does not depend on it beyond
            rounding.
        key_log_scale: optional ``[B, H, N]``; the true key features are
            ``k_feat * exp(key_log_scale)``.

    Returns:
        ``[B, H, N, Dv]``. Rows with a zero denominator return zeros.
    """
    _check_features(q_feat, k_feat, v, key_log_scale=key_log_scale)
    return _attend(q_feat, k_feat, v, None, None, causal, key_log_scale, chunk_size)


def flt_attention(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, a: torch.Tensor, c: torch.Tensor, *, causal: bool = False, key_log_scale: torch.Tensor | None = None,
                  chunk_size: int | None = None) -> torch.Tensor:
    """FLT with the multiplicative coupling (docs/math.md section 4), linear in N.

    ``out_i = sum_j (a_i.c_j)(qf_i.kf_j) v_j / sum_j (a_i.c_j)(qf_i.kf_j)``: linear attention
    on the Kronecker features ``a_i (x) qf_i`` and ``c_j (x) kf_j``, which are never
    materialised. Bidirectional: one contraction into a ``[2R, m, Dv]`` state, streamed over
    blocks of ``chunk_size`` tokens. Causal: chunks with a constant-size running state.
    Cost ``O(N * 2R * m * Dv)``. A sequence no longer than ``chunk_size`` is one block, and
    its ``[N, N]`` weights ``(a c^T) * (qf kf^T)`` are formed directly, ``O(N^2 (2R + m + Dv))``:
    the same sums in another order, far cheaper for short sequences such as molecules.

    The mask ``a_i.c_j`` may be negative, so a row sum may vanish or change sign; rows whose
    denominator is zero return zeros (:func:`flt.ops._common.safe_divide`). Nonnegative
    spectra and the logit coupling avoid the issue altogether.

    Args:
        q_feat, k_feat: ``[B, H, N, m]``; v: ``[B, H, N, Dv]``;
        a, c: ``[B or 1, H, N, 2R]`` with ``a_i.c_j = f^(r_i - r_j)``;
        key_log_scale: optional ``[B, H, N]`` as in :func:`linear_attention`;
        chunk_size: as in :func:`linear_attention`.
    """
    _check_features(q_feat, k_feat, v, a, c, key_log_scale)
    return _attend(q_feat, k_feat, v, a, c, causal, key_log_scale, chunk_size)


def _augment(v, weight=None):
    """``[v, 1]``, each row times its key's ``weight``: ``[B, H, N, Dv] -> [B, H, N, Dv + 1]``.

    The column of ones turns every product that forms a numerator into one that forms the
    denominator too (its last column). Per-key scalars go on these ``Dv + 1`` columns
    instead of the ``m`` key features, which are usually several times wider.
    """
    aug = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    return aug if weight is None else aug * weight.unsqueeze(-1)


def _write(kf, c, vaug):
    """Key-side state ``sum_j c_j (x) kf_j (x) vaug_j`` of a block of tokens (any leading dims).

    Plain (``c`` None): ``kf^T vaug``, ``[..., m, Dv+1]``. Kronecker: the Khatri-Rao product of
    the values with the narrower of ``c`` (``2R``) and ``kf`` (``m``) is formed, then contracted
    with the other: ``[..., m, 2R*(Dv+1)]`` when ``2R <= m``, else ``[..., 2R, m*(Dv+1)]``.
    Either way ``O(T * 2R * m * (Dv+1))`` work in one matmul.

    Layout: the gradient of the transposed operand of a batched matmul comes back
    transposed, and every elementwise pass over a transposed ``[N, m]`` gradient (the
    features' own backward) is several times slower than over a contiguous one. So the
    narrower of the two operands is the one transposed: in the plain case ``(vaug^T kf)^T``
    (a transposed view of the state) when ``vaug`` is narrower than ``kf``.
    """
    if c is None:
        if vaug.shape[-1] < kf.shape[-1]:
            return (vaug.transpose(-1, -2) @ kf).transpose(-1, -2)
        return kf.transpose(-1, -2) @ vaug
    if c.shape[-1] <= kf.shape[-1]:
        return kf.transpose(-1, -2) @ (c.unsqueeze(-1) * vaug.unsqueeze(-2)).flatten(-2)
    return c.transpose(-1, -2) @ (kf.unsqueeze(-1) * vaug.unsqueeze(-2)).flatten(-2)


def _read(qf, a, state):
    """``out_i = sum_(k,s) a_ik qf_is state[k, s, :]`` for a block of queries: ``[..., T, Dv+1]``."""
    if a is None:
        return qf @ state
    if a.shape[-1] <= qf.shape[-1]:
        t = (qf @ state).unflatten(-1, (a.shape[-1], -1))  # [..., T, 2R, Dv+1]
        return (a.unsqueeze(-2) @ t).squeeze(-2)
    t = (a @ state).unflatten(-1, (qf.shape[-1], -1))  # [..., T, m, Dv+1]
    return (qf.unsqueeze(-2) @ t).squeeze(-2)


def full_precision(x: torch.Tensor, signed: bool) -> contextlib.AbstractContextManager:
    """The context the sums over keys run in: autocast off (so in the features' float32 or
    better) for signed weights (``signed``: the Kronecker coupling) and under float16
    autocast; otherwise a no-op, leaving bfloat16 autocast its fast products.

    Why (docs/math.md section 4, "Conditioning"): the signed mask's row sums cancel, so a
    bfloat16 rounding of the features or the state (``2^-8``) is amplified by the
    denominator's condition number; and float16 overflows in the state, a sum of ``N``
    values (``65504`` is ``4096`` keys times values of ``16``). Positive weights in
    bfloat16 (plain linear attention, the logit coupling) keep its relative precision.
    """
    lowered = autocast_dtype(x.device.type)
    if lowered is not None and (signed or lowered == torch.float16):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def kronecker_condition(q_feat: torch.Tensor, k_feat: torch.Tensor, a: torch.Tensor, c: torch.Tensor, *, causal: bool = False, key_log_scale: torch.Tensor | None = None,
                        chunk_size: int | None = None) -> torch.Tensor:
    """How much the multiplicative coupling's row sums cancel: ``[B, H, N]``, at least 1.

    ``kappa_i = |a_i| sum_j |c_j| w_ij / |sum_j (a_i.c_j) w_ij|`` with ``w_ij = qf_i.kf_j
    exp(s_j)`` over the keys row ``i`` sees (``j <= i`` when ``causal``): an upper bound of the
    condition number ``sum_j |W_ij| / |sum_j W_ij|`` of row ``i``'s denominator, since
    ``|a_i.c_j| <= |a_i| |c_j|``. A relative perturbation ``u`` of the features (rounding)
    can move row ``i``'s output by about ``kappa_i u`` relative to its size. Rows whose
    denominator cancels to exactly zero get ``inf``; rows without any weight (every key
    padded) get 1. Both sums are the denominators of :func:`flt_attention` and of
    plain linear attention on the features ``|a_i| qf_i``, ``|c_j| kf_j`` (no values):
    ``O(N 2R m)``, ``1 / (Dv + 1)`` of :func:`flt_attention`. docs/math.md section 4.

    Args: as :func:`flt_attention`, without ``v``.
    """
    _check_features(q_feat, k_feat, q_feat[..., :0], a, c, key_log_scale)
    none = q_feat[..., :0]  # Dv = 0: the sums are the denominators alone
    with full_precision(q_feat, True):
        den = _sums(q_feat, k_feat, none, a, c, causal, key_log_scale, chunk_size)[..., 0]
        qa = q_feat * a.norm(dim=-1, keepdim=True).to(q_feat.dtype)
        kc = k_feat * c.norm(dim=-1, keepdim=True).to(k_feat.dtype)
        bound = _sums(qa, kc, none, None, None, causal, key_log_scale, chunk_size)[..., 0]
    ratio = torch.where(den == 0, torch.full_like(bound, float("inf")), bound / den.abs())
    return torch.where(bound == 0, torch.ones_like(ratio), ratio)


def _attend(qf, kf, v, a, c, causal, key_log_scale, chunk_size):
    with full_precision(qf, a is not None):
        out = _sums(qf, kf, v, a, c, causal, key_log_scale, chunk_size)
    return safe_divide(out[..., :-1], out[..., -1:])


def _sums(qf, kf, v, a, c, causal, key_log_scale, chunk_size):
    """``[numerator, denominator]`` of every query, ``[B, H, N, Dv + 1]``, in the promoted dtype."""
    if chunk_size is None:
        two_r = 1 if a is None else a.shape[-1]
        chunk_size = causal_chunk_size(qf.shape[-1], two_r, v.shape[-1]) if causal else DEFAULT_CHUNK_SIZE
    check_positive_int("chunk_size", chunk_size)
    dtype = torch.promote_types(torch.promote_types(qf.dtype, kf.dtype), v.dtype)
    if a is not None:
        dtype = torch.promote_types(torch.promote_types(dtype, a.dtype), c.dtype)
        a, c = a.to(dtype), c.to(dtype)
    qf, kf, v = qf.to(dtype), kf.to(dtype), v.to(dtype)
    kls = None if key_log_scale is None else key_log_scale.to(dtype)
    if causal:
        out, _ = causal_sums(qf, kf, _augment(v), a, c, kls, chunk_size)
    else:
        out = _bidirectional(qf, kf, v, a, c, kls, chunk_size)
    # Under bfloat16 autocast (plain linear attention only, see full_precision) the products
    # come back in bfloat16 (accumulated in float32 by the matmul kernels): the numerator
    # and the normaliser are divided in ``dtype``.
    return out.to(dtype)


def _bidirectional(qf, kf, v, a, c, kls, chunk_size):
    """``[numerator, denominator]`` of every query, ``[B, H, N, Dv + 1]``."""
    # One global shift of the key log scales; it cancels in the ratio.
    vaug = _augment(v, None if kls is None else torch.exp(kls - kls.amax(dim=-1, keepdim=True)))
    if a is None:
        return qf @ _write(kf, None, vaug)
    # Kronecker: stream the Khatri-Rao intermediate [block, min(2R, m) * (Dv+1)] over blocks
    # of tokens, as large as keeps it within the size of the features (few, large matmuls)
    # and at least chunk_size. split, not slicing: the backward concatenates block gradients once.
    _, _, N, m = qf.shape
    if N <= chunk_size:  # one block: the [N, N] weights cost less than the Kronecker state
        return ((qf @ kf.transpose(-1, -2)) * (a @ c.transpose(-1, -2))) @ vaug
    block = max(chunk_size, (N * m) // (min(a.shape[-1], m) * vaug.shape[-1]))
    state = None
    for kb, cb, vb in zip(kf.split(block, 2), c.split(block, 2), vaug.split(block, 2), strict=True):
        part = _write(kb, cb, vb)
        state = part if state is None else state + part
    return torch.cat([_read(qb, ab, state) for qb, ab in zip(qf.split(block, 2), a.split(block, 2), strict=True)], dim=2)


#: Largest number of chunks per block of the two-level scan over chunk states (:func:`_scan`).
_SCAN_BLOCK = 32


def causal_sums(qf: torch.Tensor, kf: torch.Tensor, vaug: torch.Tensor, a: torch.Tensor | None, c: torch.Tensor | None, kls: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal sums ``sum_(j <= i) w_ij vaug_j`` of every query and the level they are relative to.

    ``w_ij = (a_i.c_j) (qf_i.kf_j) exp(s_j - run_i)`` with ``run`` the running maximum of the
    key log scales ``s = kls`` (no scales: ``run`` is None and the factor is 1). ``qf, kf
    [B, H, N, m]``, ``vaug [B, H, N, X]``, ``a, c [B|1, H, N, 2R]`` or None, all in one dtype.
    Returns ``(sums [B, H, N, X], run [B, H, N] or None)``. The building block of
    :func:`linear_attention`, :func:`flt_attention` and of the banded estimator's far field
    (:mod:`flt.ops.band`, which shifts the keys by the band's width).
    """
    run = None if kls is None else torch.cummax(kls, dim=-1).values
    return _causal_chunked(qf, kf, vaug, a, c, kls, run, chunk_size), run


def _causal_chunked(qf, kf, vaug, a, c, kls, run, chunk_size):
    """Causal ``[numerator, denominator]``, ``[B, H, N, X]``, in chunks of ``chunk_size``.

    Tokens are padded to ``G`` whole chunks of ``C`` tokens (zero keys and values after the
    last token, which no real row sees) and viewed as ``[B, H, G, C, ...]``: the masked
    ``C x C`` products inside chunks are one batched matmul over all chunks
    (:func:`_inside_chunks`). Across chunks (:func:`_across_chunks`): every chunk's key state
    in one matmul, the states of all earlier tokens by a two-level scan over the chunk index
    (:func:`_scan`), and one matmul to read them for every query. So that these states take
    at most twice the memory of the features ``B * H * N * m``, the Kronecker state
    ``2R * m * X`` is handled for groups of chunks at a time, the state carried from group to
    group; the number of groups, ``2R X / (2 C)``, does not depend on ``N``. So neither does
    the number of operations: no Python loop runs over chunks.

    With key log scales ``s_j`` the weights are ``w_ij = qf_i.kf_j * exp(s_j - run_i)``,
    ``run`` the running maximum: inside a chunk ``exp(s_j - run_j) * exp(run_j - run_i)``,
    across chunks a state stored relative to the level ``run`` at the end of its last
    chunk. Every exponent is <= 0, and nothing in row ``i`` depends on a key after ``i``.
    """
    B, H, N, m = qf.shape
    C = min(chunk_size, N)
    G = -(-N // C)
    tensors = [_pad_tokens(t, G * C, replicate) for t, replicate in
               ((qf, False), (kf, False), (vaug, False), (a, False), (c, False), (kls, True), (run, True))]
    q5, k5, v5, a5, c5, s5, r5 = (None if t is None else t.unflatten(2, (G, C)) for t in tensors)
    out = _inside_chunks(q5, k5, v5, a5, c5, s5, r5)
    if G > 1:
        R2 = 1 if a is None else a.shape[-1]
        group = max(1, 2 * qf.numel() // (B * H * R2 * m * vaug.shape[-1]))
        carry, cross = None, []
        # strict=False: _groups repeats None endlessly for an absent tensor.
        for qg, kg, vg, ag, cg, sg, rg in zip(*(_groups(t, group) for t in (q5, k5, v5, a5, c5, s5, r5)), strict=False):
            read, carry = _across_chunks(qg, kg, vg, ag, cg, sg, rg, carry)
            cross.append(read)
        out = out + _cat(cross, dim=2)
    return out.flatten(2, 3)[:, :, :N]


def _pad_tokens(t, length, replicate):
    """``t [B, H, N, ...]`` or ``[B, H, N]`` padded along dim 2 to ``length`` tokens: zeros,
    or with ``replicate`` copies of the last entry (so running maxima stay nondecreasing)."""
    if t is None or t.shape[2] == length:
        return t
    extra = length - t.shape[2]
    if replicate:
        return torch.cat([t, t[:, :, -1:].expand(*t.shape[:2], extra, *t.shape[3:])], dim=2)
    return torch.cat([t, t.new_zeros(*t.shape[:2], extra, *t.shape[3:])], dim=2)


def _groups(t, group):
    """Groups of ``group`` chunks along dim 2; ``None`` stays ``None``. A single group is the
    tensor itself (a split's backward would copy its gradient)."""
    if t is None:
        return itertools.repeat(None)
    return (t,) if group >= t.shape[2] else t.split(group, dim=2)


def _cat(parts, dim):
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _inside_chunks(q, k, vaug, a, c, s, run):
    """Weights of keys in the same chunk, ``j <= i``: ``[B, H, chunks, T, X]``."""
    w = q @ k.transpose(-1, -2)  # [B, H, chunks, T, T]
    if a is not None:
        w = w * (a @ c.transpose(-1, -2))
    if run is None:
        return w.tril() @ vaug
    T = q.shape[-2]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    # exp(run_j - run_i) <= 1 for j <= i; masked before exp so nothing overflows.
    w = w * torch.exp((run.unsqueeze(-2) - run.unsqueeze(-1)).masked_fill(future, -float("inf")))
    return w @ (vaug * torch.exp(s - run).unsqueeze(-1))


def _across_chunks(q, k, vaug, a, c, s, run, carry):
    """Weights of keys in earlier chunks, for a group of G chunks, and the state after them.

    ``carry = (state, level)`` after the previous group (None at the start): the key sums of
    all earlier tokens relative to ``exp(level)``. Chunk ``g``'s own state is stored relative
    to ``e_g``, the running max at its last token. Returns ``([B, H, G, T, X], carry)``.
    """
    if run is None:
        ends, fresh = None, _write(k, c, vaug)
    else:
        ends = run[..., -1]  # [B, H, G]
        fresh = _write(k, c, vaug * torch.exp(s - ends.unsqueeze(-1)).unsqueeze(-1))
    if carry is None:
        carry = (torch.zeros_like(fresh[:, :, 0]), None if run is None else run[..., 0, 0])
    prefix, levels, carry = _scan(fresh, ends, carry)
    read = _read(q, a, prefix)
    if run is not None:
        read = read * torch.exp(levels.unsqueeze(-1) - run).unsqueeze(-1)  # <= 1
    return read, carry


def _prefix_matrix(ends, level, n, like):
    """The ``[.., n + 1, n]`` matrix of one scan level and its row levels.

    Entry ``(g, g')`` is ``exp(e_g' - l_g)`` for ``g' < g``, 0 otherwise, with ``l_0 = level``
    and ``l_g = e_(g-1)``: row ``g < n`` sums the states before ``g``, row ``n`` all of them.
    ``ends [.., n]``, ``level [..]``; both None without key scales (entries 1, levels None).
    ``l`` and ``e`` are nondecreasing, so every exponent is <= 0. Returns ``(matrix, l [.., n + 1])``.
    """
    below = torch.ones(n + 1, n, dtype=torch.bool, device=like.device).tril(-1)
    if ends is None:
        return below.to(like.dtype), None
    levels = torch.cat([level.unsqueeze(-1), ends], dim=-1)
    return torch.exp((ends.unsqueeze(-2) - levels.unsqueeze(-1)).masked_fill(~below, -float("inf"))), levels


def _scan(fresh, ends, carry):
    """States of all tokens before each of G chunks, from the chunks' own states.

    ``fresh [B, H, G, X, Y]``: chunk ``g``'s key sums relative to ``exp(e_g)`` (``ends``
    ``[B, H, G]``, None without key scales). The state before chunk ``g`` is
    ``P_g = state * exp(level - l_g) + sum_(g' < g) fresh_g' * exp(e_g' - l_g)`` at level
    ``l_g`` (``level`` for ``g = 0``, else ``e_(g-1)``). Two levels, so a fixed number of
    operations for any ``G``: the chunks are cut into ``S`` blocks of ``b <= _SCAN_BLOCK``
    (the last padded with empty chunks); one ``[b + 1, b]`` matmul per block (all blocks at
    once) gives each chunk the sums of the earlier chunks of its block, and the block its
    total; one ``[S + 1, S]`` matmul gives each block the sums before it, and the carry after
    the last. Cost ``(b + S^2 / G) X Y`` per chunk, next to ``C X Y`` for writing the states.
    Returns ``(P [B, H, G, X, Y], l [B, H, G] or None, carry)``.
    """
    state, level = carry
    G = fresh.shape[2]
    b = min(_SCAN_BLOCK, math.isqrt(G - 1) + 1)
    S = -(-G // b)
    flat = _pad_tokens(fresh.flatten(-2), S * b, False).unflatten(2, (S, b))  # [B, H, S, b, XY]
    e = None if ends is None else _pad_tokens(ends, S * b, True).unflatten(2, (S, b))  # [B, H, S, b]
    block_ends = None if e is None else e[..., -1]  # E_s, [B, H, S]
    # Across blocks: the levels lambda_0 = level, lambda_s = E_(s-1) (None without scales).
    outer, block_levels = _prefix_matrix(block_ends, level, S, flat)
    starts = None if e is None else block_levels[..., :S]
    inner, chunk_levels = _prefix_matrix(e, starts, b, flat)
    # Rows t < b at l_(s,t), row b the block total at E_s. split, not slicing, for the large
    # tensors here: the backward of a slice fills a zero tensor of the whole size per slice
    # and adds them; that of a split concatenates once.
    prefix, totals = (inner @ flat).split([b, 1], dim=3)  # [B, H, S, b, XY], [B, H, S, 1, XY]
    start = state.flatten(-2).unsqueeze(2)  # the carry, re-expressed at every block's level
    if block_levels is not None:
        start = start * torch.exp(level.unsqueeze(-1) - block_levels).unsqueeze(-1)
    before, after = (outer @ totals.squeeze(3) + start).split([S, 1], dim=2)  # [B, H, S + 1, XY] cut
    if e is None:
        prefix = prefix + before.unsqueeze(3)
    else:
        assert starts is not None and chunk_levels is not None  # both set when e is
        chunk_levels = chunk_levels[..., :b]  # [B, H, S, b]
        prefix = prefix + before.unsqueeze(3) * torch.exp(starts.unsqueeze(-1) - chunk_levels).unsqueeze(-1)
        chunk_levels = chunk_levels.flatten(2)[..., :G]
    prefix = prefix.flatten(2, 3)
    if prefix.shape[2] > G:
        prefix = prefix[:, :, :G]
    prefix = prefix.unflatten(-1, fresh.shape[-2:])
    carry = (after.squeeze(2).unflatten(-1, fresh.shape[-2:]), None if e is None else block_levels[..., S])
    return prefix, chunk_levels, carry


@dataclass
class RecurrentState:
    """State of causal linear / FLT attention after some tokens: constant size in N.

    ``kv [B, H, 2R, m*Dv]`` and ``z [B, H, 2R, m]`` hold the key sums relative to
    ``exp(level)`` (``level [B, H]``, the running maximum of the key log scales); plain
    linear attention uses ``2R = 1``. ``position`` counts the tokens seen.
    """

    kv: torch.Tensor
    z: torch.Tensor
    level: torch.Tensor
    position: int = 0


def recurrent_step(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, state: RecurrentState | None = None, *, a: torch.Tensor | None = None, c: torch.Tensor | None = None,
                   key_log_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, RecurrentState]:
    """One token of causal linear (``a = c = None``) or multiplicative FLT attention.

    Args:
        q_feat, k_feat: ``[B, H, m]``; v: ``[B, H, Dv]``; a, c: ``[B or 1, H, 2R]``;
        key_log_scale: ``[B, H]`` or None; state: from the previous step (None to start).

    Returns:
        ``(out [B, H, Dv], new_state)``; feeding tokens one by one reproduces
        :func:`flt_attention` / :func:`linear_attention` with ``causal=True``.
    """
    check_tensor("q_feat", q_feat, ndim=3, layout="[B, H, m]")
    check_tensor("k_feat", k_feat, ndim=3, layout="[B, H, m]")
    check_tensor("v", v, ndim=3, layout="[B, H, Dv]")
    if (a is None) != (c is None):
        raise ValueError("a and c must be given together")
    with full_precision(q_feat, a is not None):
        return _step(q_feat, k_feat, v, state, a, c, key_log_scale)


def _step(q_feat, k_feat, v, state, a, c, key_log_scale):
    B, H, m = k_feat.shape
    Dv = v.shape[-1]
    dtype = torch.promote_types(torch.promote_types(q_feat.dtype, k_feat.dtype), v.dtype)
    q_feat, k_feat, v = q_feat.to(dtype), k_feat.to(dtype), v.to(dtype)
    if a is None:
        a = c = q_feat.new_ones(1, H, 1)
    a, c = a.to(dtype), c.to(dtype)
    kls = q_feat.new_zeros(B, H) if key_log_scale is None else key_log_scale.to(dtype)
    R2 = a.shape[-1]
    if state is None:
        state = RecurrentState(q_feat.new_zeros(B, H, R2, m * Dv), q_feat.new_zeros(B, H, R2, m), kls, 0)
    else:
        if not isinstance(state, RecurrentState):
            raise TypeError(f"state must be the RecurrentState of the previous step (or None), got {type(state).__name__}")
        check_state_tensors("RecurrentState", state, {"kv": (B, H, R2, m * Dv), "z": (B, H, R2, m), "level": (B, H)},
                            q_feat.device)
    level = torch.maximum(state.level, kls)
    keep = torch.exp(state.level - level)[..., None, None]
    kf = k_feat * torch.exp(kls - level).unsqueeze(-1)  # [B, H, m]
    ck = c.unsqueeze(-1)  # [B, H, 2R, 1]
    kv = state.kv * keep + ck * (kf.unsqueeze(-1) * v.unsqueeze(-2)).flatten(-2).unsqueeze(-2)
    z = state.z * keep + ck * kf.unsqueeze(-2)
    t = (a.unsqueeze(-2) @ kv).squeeze(-2).unflatten(-1, (m, Dv))  # [B, H, m, Dv]
    num = (q_feat.unsqueeze(-1) * t).sum(dim=-2)
    den = ((a.unsqueeze(-2) @ z).squeeze(-2) * q_feat).sum(dim=-1, keepdim=True)
    return safe_divide(num, den), RecurrentState(kv, z, level, state.position + 1)
