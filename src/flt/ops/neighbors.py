"""Exact weights on each query's k nearest keys in position space, FAVOR+ on the rest.

The banded estimator (:mod:`flt.ops.band`) keeps a strong local bias exact inside a window
of the token order. Sets of atoms or patches have no meaningful order: their near field is
a neighbourhood in space. Here the near set ``K(i)`` of query ``i`` is the ``k`` keys
nearest to ``r_i`` (Euclidean, in ``P`` dimensions):

    w_ij = exp(x_i.y_j + b_ij)             if j in K(i)       (exact)
    w_ij = qf_i.kf_j exp(s_j)              otherwise          (FAVOR+ estimate)
    out_i = sum_j w_ij v_j / sum_j w_ij

Every weight is nonnegative and the near ones are exact, so row sums stay positive.

The multiplicative coupling (the FLT paper's mask ``f(r_i - r_j) exp(x_i.y_j)``, given by
``a``, ``c`` and ``near_mask``) uses the same split:

    w_ij = m_ij exp(x_i.y_j)                           if j in K(i)       (exact)
    w_ij = qf_i.kf_j exp(s_j) a_i.c_j                  otherwise          (Kronecker estimate)

with ``m_ij`` the exact mask on the near pairs. That is the FAVOR+ form (``near_kernel="exp"``):
the near pairs get the exact softmax kernel ``exp(x_i.y_j)`` the FAVOR+ features estimate.
Deterministic or learned feature maps (``hedgehog``, ``elu``, ``taylor``; ``relu``'s random
features) estimate no exponential, so with ``near_kernel="features"`` the near pairs keep
the features' own kernel and only the mask becomes exact:

    w_ij = m_ij qf_i.kf_j exp(s_j)                     if j in K(i)       (exact mask)
    w_ij = qf_i.kf_j exp(s_j) a_i.c_j                  otherwise          (Kronecker estimate)

so the near set differs from the far field only in the mask (exact ``m_ij`` instead of its
random-feature estimate ``a_i.c_j``), not in the kernel. A local mask is large only on the near set,
which is now exact; the far estimate is signed, but it is an estimate of a mask close to 0
there, so it no longer cancels the row's mass (without the near set the estimate of a
strong local mask is signed where the mass is, and row sums can vanish).

The near set (:func:`nearest_keys`): the query's own key first whatever the positions,
then the keys in increasing distance, ties broken by the lower key index; padded keys are
never chosen unless fewer than ``k`` valid keys exist (the op then ignores those slots). It
is an integer index, so no gradient flows through the choice; gradients reach the positions
through the bias ``b_ij`` only.

Cost. From ``SPATIAL_FROM = 1024`` points in up to 3 dimensions the search uses cell lists
(:func:`_spatial_search`): each query is compared with the keys of the ``3^P`` grid cells
around it, ``O(N k)`` for evenly spread points, and the queries those cells cannot settle
fall back to the full comparison. Otherwise (and as the reference the cell lists are
tested against) it compares every query with every key: ``O(N^2 P)`` time, in chunks of
queries so memory is ``O(chunk N)``. A batch whose positions are shared (one ``[1, N, P]``
tensor, no padding) is searched once. The attention itself (:func:`neighbor_attention`) is
linear: the estimate over all keys, ``qf_i . sum_j kf_j [v_j, 1]``, minus the estimate on the
near set, plus the exact near weights, ``O(N k (D + m + Dv) + N m Dv)`` time; the products
with the near keys' rows are sparse kernels over the listed pairs (:mod:`flt.ops.pairs`),
never gathered into an ``[N, k, E]`` tensor, and their number of operations does not grow
with ``N``. Short sets (``N <= dense_below``, default 128: molecules, small patch
grids) use their ``[N, N]`` weights instead, ``O(N^2 (D + m + Dv))``: the same sums, but
matrix products beat gathering ``k`` rows per query there.

Stabilisation (as in :mod:`flt.ops.band`): weights of row ``i`` are taken relative to
``exp(sq_i + L + c_i)``, ``sq_i`` the query's feature shift, ``L`` the largest valid key log
scale and ``c_i >= 0`` the largest exact near exponent of the row above that level; every
exponent is then ``<= 0`` and the common factor cancels. Bidirectional only: sets have no
causal order, and ``causal=True`` is rejected.
"""

from __future__ import annotations

import math

import torch

from flt._checks import check_positive_int, check_tensor
from flt._dtype import compute_dtype
from flt.ops._common import safe_divide
from flt.ops.linear import DEFAULT_CHUNK_SIZE, _read, _write, full_precision
from flt.ops.pairs import flat_index, gather_sum, pair_dots

#: Queries per chunk of the neighbour search: the distances of one chunk take ``chunk x N``.
SEARCH_CHUNK = 256


def _check_key_mask(key_mask: torch.Tensor | None, B: int, N: int) -> None:
    if key_mask is not None and (
        not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, N)
    ):
        shape = tuple(key_mask.shape) if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
        dtype = key_mask.dtype if isinstance(key_mask, torch.Tensor) else ""
        raise ValueError(f"key_mask must be a bool tensor [B, N] = {(B, N)} (True = a valid key), got {dtype} {shape}")


def nearest_keys(pos: torch.Tensor, k: int, *, key_mask: torch.Tensor | None = None, chunk_size: int = SEARCH_CHUNK,
                 spatial: bool | None = None) -> torch.Tensor:
    """Indices of the ``k`` keys nearest to each query, self first (module docstring).

    Args:
        pos: ``[B or 1, N, P]`` positions of the tokens (queries and keys alike).
        k: ``1 <= k <= N``.
        key_mask: optional ``[B, N]`` bool, True marks a valid key; padded keys come after
            every valid one.
        chunk_size: queries per chunk of the ``O(N^2)`` search.
        spatial: search only the keys near each query (:func:`_spatial_search`, for
            thousands of points in up to 3 dimensions); the same sets as the ``O(N^2)``
            search. None (default): spatial for ``P <= 3``, ``N >= SPATIAL_FROM`` and finite
            positions; False: always the ``O(N^2)`` search (the reference).

    Returns:
        ``[B or 1, N, k]`` int64 (batch 1 only when ``pos`` has batch 1 and there is no
        ``key_mask``), distinct keys per row, sorted by distance.
    """
    check_tensor("pos", pos, ndim=3, layout="[B, N, P]")
    check_positive_int("k", k)
    check_positive_int("chunk_size", chunk_size)
    N = pos.shape[1]
    if k > N:
        raise ValueError(f"k ({k}) must be at most the number of keys N = {N}")
    if spatial not in (None, True, False):
        raise ValueError(f"spatial must be None (choose from the shapes), True or False, got {spatial!r}")
    if key_mask is not None:
        _check_key_mask(key_mask, key_mask.shape[0] if isinstance(key_mask, torch.Tensor) else 1, N)
        if pos.shape[0] not in (1, key_mask.shape[0]):
            raise ValueError(f"pos has batch {pos.shape[0]} but key_mask has batch {key_mask.shape[0]}")
        pos = pos.expand(key_mask.shape[0], -1, -1)
    with torch.no_grad():
        pos = pos.detach().to(compute_dtype(pos))
        if spatial is None:
            spatial = pos.shape[-1] <= 3 and N >= SPATIAL_FROM and bool(torch.isfinite(pos).all())
        if spatial:
            return _spatial_search(pos, k, key_mask, chunk_size)
        keys = torch.arange(N, device=pos.device)
        out = []
        for start in range(0, N, chunk_size):
            q = pos[:, start:start + chunk_size]  # [B, C, P]
            d = (q.unsqueeze(2) - pos.unsqueeze(1)).square().sum(-1)  # [B, C, N], exact for equal offsets
            rows = keys[start:start + chunk_size]
            d = torch.where(rows.view(-1, 1) == keys.view(1, -1), torch.full_like(d, -1.0), d)  # self first
            if key_mask is not None:
                d = d.masked_fill(~key_mask[:, None, :], float("inf"))
            out.append(_select(d, keys.expand(d.shape[0], 1, N), k)[0])
        return torch.cat(out, dim=1)


def _select(d, cand, k):
    """The ``k`` nearest of candidate keys: ``d [..., Q, L]`` squared distances (self -1,
    padded keys inf), ``cand [..., 1 or Q, L]`` their key indices in increasing order (slots
    that hold no key: indices >= N, distance inf). Returns ``[..., Q, k]`` key indices sorted
    by (distance, index), and the k-th smallest distance ``[..., Q]``.

    The k-th smallest distance t; keys below it are in, keys at it fill the rest by lower
    index (ties are common on grids). Then the k chosen keys are ordered by (distance,
    index) with a stable sort of k entries, on every device alike.
    """
    L = d.shape[-1]
    t = torch.topk(d, k, dim=-1, largest=False, sorted=True).values[..., -1:]  # the k-th smallest
    at = d == t
    chosen = (d < t) | (at & (at.cumsum(-1) <= k - (d < t).sum(-1, keepdim=True)))
    # The chosen slots in ascending order, without a host synchronisation (nonzero would
    # need one): the k smallest of distinct scores.
    slots = torch.arange(L, device=d.device)
    ind = torch.topk(torch.where(chosen, slots, slots + L), k, dim=-1, largest=False, sorted=True).indices
    order = torch.sort(d.gather(-1, ind), dim=-1, stable=True).indices
    return cand.expand(*d.shape).gather(-1, ind.gather(-1, order)), t.squeeze(-1)


#: ``nearest_keys`` searches spatially from this many points on (in up to 3 dimensions).
SPATIAL_FROM = 1024
#: Candidate distances per group of queries of the spatial search (bounds its memory).
_SPATIAL_GROUP = 1 << 22


def _brute_force_rows(pos, rows, k, key_mask, chunk_size):
    """The ``O(N^2)`` search for some queries only: ``rows [R]`` indices into ``pos``'s
    flattened ``[B N]`` tokens; returns ``[R, k]`` key indices."""
    _, N, _ = pos.shape
    keys = torch.arange(N, device=pos.device)
    out = []
    for start in range(0, rows.numel(), chunk_size):
        r = rows[start:start + chunk_size]
        b, i = r // N, r % N
        d = (pos[b, i].unsqueeze(1) - pos[b]).square().sum(-1)  # [C, N], as in nearest_keys
        d = torch.where(i.view(-1, 1) == keys.view(1, -1), torch.full_like(d, -1.0), d)
        if key_mask is not None:
            d = d.masked_fill(~key_mask[b], float("inf"))
        out.append(_select(d, keys.expand(1, N), k)[0])
    return torch.cat(out, dim=0)


def _spatial_search(pos, k, key_mask, chunk_size):
    """The near sets of :func:`nearest_keys` from cell lists: ``O(N L)`` for ``L`` candidates
    per query instead of ``O(N^2)``.

    A uniform grid of cells of side ``s``, chosen so that a ball of radius ``s`` holds about
    ``3k`` points on average; a query's candidates are the keys of its own cell and the
    ``3^P - 1`` around it (lists padded to the fullest cell, sorted by key index), and the
    selection among them is the ``O(N^2)`` search's (:func:`_select`: the same distances,
    tie rules and order). Every key outside those cells is farther from the query than
    ``s`` plus its distance to its own cell's nearest face; a query whose ``k``-th nearest
    candidate is closer than that has its exact set. The others (sparse regions, fewer than
    ``k`` valid keys nearby) are searched over all keys. Host synchronisations fix the grid,
    the list length and the queries left over; a grid that would not pay (more cells than
    ``8 N``, or lists longer than ``N``) falls back to the
    ``O(N^2)`` search, which gives the same sets.
    """
    B, N, P = pos.shape
    dev = pos.device
    unit_ball = (2.0, math.pi, 4 * math.pi / 3)[P - 1]
    lo = pos.amin(1)  # [B, P]
    extent = torch.sort(pos.amax(1) - lo, dim=-1).values.clamp_min(torch.finfo(pos.dtype).tiny)  # [B, P]
    # Side s: s^P = (3k / (V_P N)) prod_d max(extent_d, s), so that points spread over fewer
    # dimensions (a plane in 3-D) still get about 3k within s. With the q flattest dimensions
    # below s, s = (3k / (V_P N) prod_(d >= q) extent_d)^(1 / (P - q)); the largest is the answer.
    density = 3 * k / (unit_ball * N)
    side = torch.stack([(density * extent[:, q:].prod(-1)) ** (1 / (P - q)) for q in range(P)]).amax(0)  # [B]
    cell = ((pos - lo.unsqueeze(1)) / side.view(B, 1, 1)).floor().long()  # [B, N, P]
    shape = (cell.amax(1).amax(0) + 1).tolist()
    n_cells = math.prod(shape)
    if n_cells * B > 8 * N * B:
        return _brute_force_rows(pos, torch.arange(B * N, device=dev), k, key_mask, chunk_size).view(B, N, k)
    strides = torch.tensor([math.prod(shape[d + 1:]) for d in range(P)], device=dev)
    cid = (cell * strides).sum(-1) + n_cells * torch.arange(B, device=dev).view(B, 1)  # [B, N]
    counts = torch.bincount(cid.flatten(), minlength=B * n_cells)
    cap = int(counts.max())
    if cap * 3 ** P > N:
        return _brute_force_rows(pos, torch.arange(B * N, device=dev), k, key_mask, chunk_size).view(B, N, k)
    # Cell lists [B * cells, cap] of key indices, ascending within a cell (stable sort), -1 empty.
    sorted_cid, order = torch.sort(cid.flatten(), stable=True)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(B * N, device=dev) - first[sorted_cid]
    table = torch.full((B * n_cells, cap), -1, dtype=torch.long, device=dev)
    table[sorted_cid, rank] = order % N
    # The candidates of every cell: the keys of the 3^P cells around it, by index, then the
    # empty slots (index N), cut to the longest list.
    offsets = torch.cartesian_prod(*[torch.arange(-1, 2, device=dev)] * P).view(-1, P)  # [3^P, P]
    coords = torch.stack(torch.unravel_index(torch.arange(n_cells, device=dev), tuple(shape)), -1)  # [cells, P]
    near = coords.unsqueeze(1) + offsets  # [cells, 3^P, P]
    inside = ((near >= 0) & (near < torch.tensor(shape, device=dev))).all(-1)
    rows = torch.where(inside, (near.clamp_min(0) * strides).sum(-1), -1)
    rows = torch.where(rows >= 0, rows + n_cells * torch.arange(B, device=dev).view(B, 1, 1), -1).flatten(0, 1)  # [B cells, 3^P]
    lists = torch.where(rows.unsqueeze(-1) >= 0, table[rows.clamp_min(0)], -1).flatten(1)  # [B cells, 3^P cap]
    lists, _ = torch.sort(torch.where(lists < 0, N, lists), dim=-1)
    L = max(k, int((lists < N).sum(-1).max()))
    lists = lists[:, :L] if lists.shape[1] >= L else torch.cat([lists, lists.new_full((lists.shape[0], L - lists.shape[1]), N)], 1)
    keys = torch.arange(N, device=dev)
    found = torch.empty(B, N, k, dtype=torch.long, device=dev)
    failed = []
    group = max(1, _SPATIAL_GROUP // L)
    for start in range(0, N, group):
        q = slice(start, start + group)
        cand = lists[cid[:, q]]  # [B, G, L]
        real = cand < N
        safe = cand.clamp_max(N - 1)
        cpos = pos.gather(1, safe.flatten(1).unsqueeze(-1).expand(-1, -1, P)).view(*safe.shape, P)
        qpos = pos[:, q]
        d = (qpos.unsqueeze(2) - cpos).square().sum(-1)  # [B, G, L], as the O(N^2) search
        d = torch.where(keys[q].view(1, -1, 1) == cand, torch.full_like(d, -1.0), d)  # self first
        valid = real if key_mask is None else real & key_mask.gather(1, safe.flatten(1)).view_as(real)
        d = d.masked_fill(~valid, float("inf"))
        found[:, q], kth = _select(d, cand, k)
        # Exact when the k-th candidate is nearer than every key outside the searched cells.
        within = (qpos - lo.unsqueeze(1)) / side.view(B, 1, 1) - cell[:, q]  # in [0, 1) per dimension
        margin = side.view(B, 1) * (1 + torch.minimum(within, 1 - within).clamp(0, 1).amin(-1))
        failed.append(~(kth < margin.square() * (1 - 1e-6)))
    missed = torch.cat(failed, dim=1).flatten().nonzero().squeeze(-1)
    if missed.numel():
        found.view(B * N, k)[missed] = _brute_force_rows(pos, missed, k, key_mask, chunk_size)
    return found


def near_offsets(pos: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``r_i - r_j`` for the near keys ``j = idx[i, t]``: ``pos [B|1, N, P]``, ``idx
    [B|1, N, k] -> [B', N, k, P]`` (differentiable in ``pos``)."""
    B = max(pos.shape[0], idx.shape[0])
    pos = pos.expand(B, -1, -1)
    nb = torch.gather(pos.unsqueeze(1).expand(B, idx.shape[1], -1, -1), 2,
                      idx.expand(B, -1, -1).unsqueeze(-1).expand(-1, -1, -1, pos.shape[-1]))
    return pos.unsqueeze(2) - nb


#: The near pairs' kernel in the multiplicative form (module docstring).
NEAR_KERNELS = ("exp", "features")


def _check(xq, xk, v, qf, kf, q_shift, key_log_scale, idx, near_bias, key_mask, causal, a=None, c=None, near_mask=None,
           near_kernel="exp"):
    check_tensor("xq", xq, ndim=4, layout="[B, H, N, D]")
    check_tensor("xk", xk, ndim=4, layout="[B, H, N, D]")
    check_tensor("v", v, ndim=4, layout="[B, H, N, Dv]")
    check_tensor("q_feat", qf, ndim=4, layout="[B, H, N, m]")
    check_tensor("k_feat", kf, ndim=4, layout="[B, H, N, m]")
    if causal:
        raise ValueError("neighbor_attention is bidirectional (a set has no causal order); causal=True is not supported")
    B, H, N, _ = xq.shape
    for name, t in (("xk", xk), ("v", v), ("q_feat", qf), ("k_feat", kf)):
        if t.shape[:3] != (B, H, N):
            raise ValueError(f"{name} must share [B, H, N] = {(B, H, N)} with xq, got {tuple(t.shape)}")
    if xk.shape[-1] != xq.shape[-1] or kf.shape[-1] != qf.shape[-1]:
        raise ValueError(f"xq/xk and q_feat/k_feat must have equal last sizes, got {xq.shape[-1]}/{xk.shape[-1]} and {qf.shape[-1]}/{kf.shape[-1]}")
    for name, t in (("q_shift", q_shift), ("key_log_scale", key_log_scale)):
        if t is None:  # features without a log scale (hedgehog, elu, relu, taylor)
            continue
        check_tensor(name, t, ndim=3, layout="[B, H, N]")
        if t.shape != (B, H, N):
            raise ValueError(f"{name} must be [B, H, N] = {(B, H, N)}, got {tuple(t.shape)}")
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.ndim != 3:
        got = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise TypeError(f"idx must be an int64 tensor [B or 1, N, k] (from nearest_keys), got {got}")
    k = idx.shape[-1]
    if idx.shape[0] not in (1, B) or idx.shape[1] != N or not 1 <= k <= N:
        raise ValueError(f"idx must be [B or 1, N, k] = [{B} or 1, {N}, k] with 1 <= k <= N, got {tuple(idx.shape)}")
    multiplicative = a is not None or c is not None or near_mask is not None
    if near_kernel not in NEAR_KERNELS:
        raise ValueError(f"near_kernel must be one of {NEAR_KERNELS}, got {near_kernel!r}")
    if near_kernel == "features" and not multiplicative:
        raise ValueError("near_kernel='features' is the multiplicative form's (a, c, near_mask); the logit form's "
                         "near bias needs the exponential kernel")
    if multiplicative:
        if a is None or c is None or near_mask is None or near_bias is not None:
            raise ValueError("the multiplicative form takes a, c and near_mask together and near_bias=None; "
                             "the logit form takes near_bias and none of a, c, near_mask")
        for name, t in (("a", a), ("c", c)):
            check_tensor(name, t, ndim=4, layout="[B or 1, H, N, 2R]")
            if t.shape[0] not in (1, B) or t.shape[1:3] != (H, N) or t.shape[-1] != a.shape[-1]:
                raise ValueError(f"{name} must be [B or 1, H, N, 2R] = [{B} or 1, {H}, {N}, {a.shape[-1]}], got {tuple(t.shape)}")
    name, bias = ("near_mask", near_mask) if multiplicative else ("near_bias", near_bias)
    check_tensor(name, bias, ndim=4, layout="[B or 1, H, N, k]")
    if bias.shape[0] not in (1, B) or bias.shape[1:] != (H, N, k):
        raise ValueError(f"{name} must be [B or 1, H, N, k] = [{B} or 1, {H}, {N}, {k}], got {tuple(bias.shape)}")
    _check_key_mask(key_mask, B, N)


def neighbor_attention_reference(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, q_shift: torch.Tensor, key_log_scale: torch.Tensor, idx: torch.Tensor,
                                 near_bias: torch.Tensor | None, *, key_mask: torch.Tensor | None = None, causal: bool = False, a: torch.Tensor | None = None,
                                 c: torch.Tensor | None = None, near_mask: torch.Tensor | None = None, near_kernel: str = "exp") -> torch.Tensor:
    """The O(N^2) formula of :func:`neighbor_attention`, for tests. Args as there."""
    _check(xq, xk, v, qf, kf, q_shift, key_log_scale, idx, near_bias, key_mask, causal, a, c, near_mask, near_kernel)
    q_shift, key_log_scale = _shifts(q_shift, key_log_scale, qf)
    _, H, N, _ = xq.shape
    cdt = compute_dtype(xq, qf, v)
    Bi = idx.shape[0]
    near = torch.zeros(Bi, N, N, dtype=torch.bool, device=xq.device).scatter(-1, idx, True)[:, None]  # [B|1, 1, N, N]
    given = near_bias if near_mask is None else near_mask
    assert given is not None  # one of the two is given (_check)
    full = torch.zeros(max(Bi, given.shape[0]), H, N, N, dtype=cdt, device=xq.device)
    full = full.scatter(-1, idx[:, None].expand(full.shape[0], H, N, -1), given.to(cdt).expand(full.shape[0], H, N, -1))
    logits = xq.to(cdt) @ xk.to(cdt).transpose(-1, -2)
    kernel = (qf.to(cdt) @ kf.to(cdt).transpose(-1, -2)) * torch.exp(q_shift.to(cdt)).unsqueeze(-1) * torch.exp(key_log_scale.to(cdt)).unsqueeze(-2)
    if near_mask is None:
        exact = torch.exp(logits + full)
    else:
        exact = full * (torch.exp(logits) if near_kernel == "exp" else kernel)
    est = kernel
    if a is not None:
        assert c is not None  # given together with a (_check)
        est = est * (a.to(cdt) @ c.to(cdt).transpose(-1, -2))
    w = torch.where(near, exact, est)
    if key_mask is not None:
        w = torch.where(key_mask[:, None, None, :], w, torch.zeros_like(w))
    return safe_divide(w @ v.to(cdt), w.sum(-1, keepdim=True))


def neighbor_attention(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, q_shift: torch.Tensor, key_log_scale: torch.Tensor, idx: torch.Tensor, near_bias: torch.Tensor | None, *,
                       key_mask: torch.Tensor | None = None, causal: bool = False, a: torch.Tensor | None = None, c: torch.Tensor | None = None,
                       near_mask: torch.Tensor | None = None, near_kernel: str = "exp", dense_below: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Attention with exact weights on each query's near set and random-feature estimates on
    every other pair (module docstring), linear in ``N`` for a fixed ``k``.

    Args:
        xq, xk: ``[B, H, N, D]`` scaled queries and keys: the exact kernel is ``exp(xq.xk)``
            (unused with ``near_kernel="features"`` beyond their shapes).
        v: ``[B, H, N, Dv]``.
        qf, kf: ``[B, H, N, m]`` kernel features, with true features ``qf * exp(q_shift)``
            and ``kf * exp(key_log_scale)``.
        q_shift, key_log_scale: ``[B, H, N]``, the features' log scales (detached), or None
            for features without one (``hedgehog``, ``elu``, ``relu``, ``taylor``: zeros).
        idx: ``[B or 1, N, k]`` int64, the near keys of every query, distinct per row
            (:func:`nearest_keys`).
        near_bias: ``[B or 1, H, N, k]``, the exact logit bias ``b_ij`` for ``j = idx[i, t]``
            (logit form), or ``None`` for the multiplicative form.
        key_mask: optional ``[B, N]`` bool, True marks a valid key; padded keys get no
            weight, near or far.
        causal: must be False (module docstring).
        a, c: multiplicative form only: ``[B or 1, H, N, 2R]`` spectral features, the far
            estimate is ``qf_i.kf_j a_i.c_j`` (Kronecker, ``O(N m 2R Dv)``).
        near_mask: multiplicative form only: ``[B or 1, H, N, k]``, the exact mask ``m_ij``
            (any sign) of the near pairs.
        near_kernel: multiplicative form only: the near pairs' kernel, ``"exp"`` (default)
            the exact ``exp(xq.xk)`` (FAVOR+ features), ``"features"`` the features' own
            ``qf.kf`` times their scales, the far field's kernel (any feature map).
        dense_below: sets of at most this many tokens (molecules, small patch grids) are
            computed from their ``[N, N]`` weights, ``O(N^2 (D + m + Dv))``: the same sums,
            cheaper there than gathering ``k`` rows per query. ``0`` always gathers.

    Returns:
        ``[B, H, N, Dv]`` in the promoted dtype (float32 or better). Rows without any valid
        key return zeros.
    """
    _check(xq, xk, v, qf, kf, q_shift, key_log_scale, idx, near_bias, key_mask, causal, a, c, near_mask, near_kernel)
    q_shift, key_log_scale = _shifts(q_shift, key_log_scale, qf)
    # No float16 products (the sums over keys overflow it), and none in bfloat16 for the
    # multiplicative form, whose signed row sums cancel (flt.ops.linear.full_precision).
    with full_precision(xq, near_mask is not None):
        return _neighbors(xq, xk, v, qf, kf, q_shift, key_log_scale, idx, near_bias, key_mask, a, c, near_mask,
                          near_kernel, dense_below)


def _shifts(q_shift, key_log_scale, qf):
    """The features' log scales, zeros where a feature map has none (``[B, H, N]``)."""
    zero = qf.new_zeros(qf.shape[:3])
    return (zero if q_shift is None else q_shift), (zero if key_log_scale is None else key_log_scale)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, E] -> [B H N, E]``: the rows the pair products of :mod:`flt.ops.pairs` index."""
    return t.reshape(-1, t.shape[-1])


def _near_dots(x: torch.Tensor, y: torch.Tensor, flat: torch.Tensor, k: int) -> torch.Tensor:
    """``x_i . y_j`` for the ``k`` near keys ``j`` of every query ``i``: ``[B, H, N, E]`` twice
    and ``flat [B H N, k]`` (:func:`flt.ops.pairs.flat_index`) -> ``[B, H, N, k]``."""
    return pair_dots(_rows(x), _rows(y), flat).view(*x.shape[:-1], k)


def _neighbors(xq, xk, v, qf, kf, q_shift, key_log_scale, idx, near_bias, key_mask, a, c, near_mask, near_kernel,
               dense_below):
    if near_mask is not None and near_kernel == "features":
        return _neighbors_features(qf, kf, v, q_shift, key_log_scale, idx, key_mask, a, c, near_mask, dense_below)
    B, H, N, _ = xq.shape
    k = idx.shape[-1]
    cdt = compute_dtype(xq, qf, v)
    xq, xk, qf, kf = (t.to(cdt) for t in (xq, xk, qf, kf))
    multiplicative = near_mask is not None
    given = (near_mask if multiplicative else near_bias).to(cdt)
    if multiplicative:
        a, c = a.to(cdt).expand(B, -1, -1, -1), c.to(cdt).expand(B, -1, -1, -1)
    vaug = torch.cat([v.to(cdt), v.new_ones(*v.shape[:-1], 1).to(cdt)], dim=-1)
    sq, sk = q_shift.to(cdt), key_log_scale.to(cdt)
    valid = torch.ones(B, N, dtype=torch.bool, device=xq.device) if key_mask is None else key_mask
    # The level: the largest valid key log scale (a padded key never sets it).
    level = sk.detach().masked_fill(~valid[:, None, :], -float("inf")).amax(-1, keepdim=True)
    level = torch.where(torch.isinf(level), torch.zeros_like(level), level)  # no valid key at all
    kw = torch.exp((sk - level).masked_fill(~valid[:, None, :], -float("inf")))  # [B, H, N], <= 1, 0 if padded
    kfw = kf * kw.unsqueeze(-1)
    vaug = vaug * valid[:, None, :, None].to(cdt)
    row = (sq + level).unsqueeze(-1)  # [B, H, N, 1]

    def near_weights(expo, top, given):
        # Exact near weights relative to the row's common factor exp(row + top).
        return torch.exp(expo - top) if not multiplicative else given * torch.exp(expo - top)

    if N <= dense_below:
        near = torch.zeros(idx.shape[0], 1, N, N, dtype=torch.bool, device=xq.device).scatter(-1, idx.unsqueeze(1), True)
        near = near & valid[:, None, None, :]
        full = torch.zeros(max(idx.shape[0], given.shape[0]), H, N, N, dtype=cdt, device=xq.device)
        full = full.scatter(-1, idx.unsqueeze(1).expand(full.shape[0], H, N, k), given.expand(full.shape[0], H, N, k))
        expo = xq @ xk.transpose(-1, -2) - row + (0.0 if multiplicative else full)
        expo = expo.masked_fill(~near, -float("inf"))
        top = expo.detach().amax(-1, keepdim=True).clamp_min(0.0)  # a common factor of the row: it cancels
        est = qf @ kfw.transpose(-1, -2)
        if multiplicative:
            est = est * (a @ c.transpose(-1, -2))
        w = torch.where(near, near_weights(expo, top, full), est * torch.exp(-top))
        out = w @ vaug
        return safe_divide(out[..., :-1], out[..., -1:])
    # Products of the listed pairs (flt.ops.pairs): the near keys' rows are never gathered
    # into a [B, H, N, k, E] tensor, in the forward or the backward.
    flat = flat_index(idx, B, H)  # [B H N, k]

    def dots(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _near_dots(x, y, flat, k)

    near_valid = valid.gather(1, idx.expand(B, N, k).reshape(B, N * k)).view(B, 1, N, k)
    expo = dots(xq, xk) - row + (0.0 if multiplicative else given)
    expo = expo.masked_fill(~near_valid, -float("inf"))
    top = expo.detach().amax(-1, keepdim=True).clamp_min(0.0)  # a common factor of the row: it cancels
    est = dots(qf, kfw)  # zero for padded keys (kfw is)
    if multiplicative:
        est = est * dots(a, c)
    weights = near_weights(expo, top, given) - est * torch.exp(-top)
    # Far field = the estimate over all keys minus its near part; near weights replace it.
    total = _write(kfw, c, vaug)  # [B, H, m, Dv + 1], or its Kronecker form
    out = gather_sum(_rows(weights), _rows(vaug), flat).view(B, H, N, -1) + _read(qf, a, total) * torch.exp(-top)
    return safe_divide(out[..., :-1], out[..., -1:])


def _neighbors_features(qf, kf, v, q_shift, key_log_scale, idx, key_mask, a, c, near_mask, dense_below):
    """The multiplicative form with the features' kernel on the near pairs too
    (``near_kernel="features"``): ``w_ij = qf_i.kf_j exp(s_j) (m_ij if near else a_i.c_j)``.

    Every weight carries the same kernel, so no exact exponent needs a row level: weights
    are taken relative to ``exp(sq_i + L)`` only (``L`` the largest valid key log scale),
    and the near pairs correct the Kronecker estimate over all keys by ``kernel (m - a.c)``.
    """
    B, H, N, _ = qf.shape
    k = idx.shape[-1]
    cdt = compute_dtype(qf, v, a)
    qf, kf, given = qf.to(cdt), kf.to(cdt), near_mask.to(cdt)
    a, c = a.to(cdt).expand(B, -1, -1, -1), c.to(cdt).expand(B, -1, -1, -1)
    valid = torch.ones(B, N, dtype=torch.bool, device=qf.device) if key_mask is None else key_mask
    sk = key_log_scale.to(cdt)
    level = sk.detach().masked_fill(~valid[:, None, :], -float("inf")).amax(-1, keepdim=True)
    level = torch.where(torch.isinf(level), torch.zeros_like(level), level)  # no valid key at all
    kw = torch.exp((sk - level).masked_fill(~valid[:, None, :], -float("inf")))  # [B, H, N], 0 if padded
    kfw = kf * kw.unsqueeze(-1)  # the query's factor exp(sq_i + L) cancels in the row
    vaug = torch.cat([v.to(cdt), v.new_ones(*v.shape[:-1], 1).to(cdt)], dim=-1) * valid[:, None, :, None].to(cdt)
    if N <= dense_below:
        near = torch.zeros(idx.shape[0], 1, N, N, dtype=torch.bool, device=qf.device).scatter(-1, idx.unsqueeze(1), True)
        full = torch.zeros(max(idx.shape[0], given.shape[0]), H, N, N, dtype=cdt, device=qf.device)
        full = full.scatter(-1, idx.unsqueeze(1).expand(full.shape[0], H, N, k), given.expand(full.shape[0], H, N, k))
        w = (qf @ kfw.transpose(-1, -2)) * torch.where(near, full, a @ c.transpose(-1, -2))
        out = w @ vaug
        return safe_divide(out[..., :-1], out[..., -1:])
    flat = flat_index(idx, B, H)  # [B H N, k]

    def dots(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _near_dots(x, y, flat, k)

    # Far field = the estimate over all keys; on the near pairs its mask a.c is replaced by m.
    weights = dots(qf, kfw) * (given - dots(a, c))  # zero for padded keys (kfw is)
    out = gather_sum(_rows(weights), _rows(vaug), flat).view(B, H, N, -1) + _read(qf, a, _write(kfw, c, vaug))
    return safe_divide(out[..., :-1], out[..., -1:])
