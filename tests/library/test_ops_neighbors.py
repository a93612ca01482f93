"""The nearest-neighbour estimator (exact weights on each query's k nearest keys in
position space, FAVOR+ elsewhere) against its O(N^2) formula, the banded op and exact
softmax."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import assert_close
from flt.ops import favor_plus_features, gaussian_orthogonal_random_matrix
from flt.ops.band import band_attention
from flt.ops import neighbors
from flt.ops.neighbors import near_offsets, nearest_keys, neighbor_attention, neighbor_attention_reference

F64 = torch.float64


def inputs(B=2, H=2, N=29, D=4, Dv=3, dtype=F64, scale=0.5):
    xq = (torch.randn(B, H, N, D, dtype=dtype) * scale).requires_grad_()
    xk = (torch.randn(B, H, N, D, dtype=dtype) * scale).requires_grad_()
    v = torch.randn(B, H, N, Dv, dtype=dtype).requires_grad_()
    return xq, xk, v


def run(fn, xq, xk, v, idx, bias, proj, **kw):
    qf, sq = favor_plus_features(xq, proj)
    kf, sk = favor_plus_features(xk, proj)
    return fn(xq, xk, v, qf, kf, sq, sk, idx, bias, **kw)


def brute_force_near(pos, k, key_mask=None):
    """Near sets by an argsort of (padded, not self, distance, index) per row, in Python."""
    B, N, _ = pos.shape
    out = torch.empty(B, N, k, dtype=torch.long)
    for b in range(B):
        for i in range(N):
            d = (pos[b, i] - pos[b]).square().sum(-1).tolist()
            padded = [False] * N if key_mask is None else (~key_mask[b]).tolist()
            order = sorted(range(N), key=lambda j: (padded[j], j != i, d[j], j))
            out[b, i] = torch.tensor(order[:k])
    return out


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("N, k", [(1, 1), (7, 7), (29, 1), (29, 5), (37, 12)])
@pytest.mark.parametrize("dense_below", [0, 128])  # gathered near rows; [N, N] weights
def test_neighbor_attention_equals_reference_forward_and_backward(P, padded, N, k, dense_below):
    B, H = 3, 2
    xq, xk, v = inputs(B=B, H=H, N=N)
    pos = torch.randn(B, N, P, dtype=F64)  # different positions per item
    key_mask = (torch.rand(B, N) > 0.3) if padded else None
    if padded:
        key_mask[:, 0] = True
    idx = nearest_keys(pos, k, key_mask=key_mask, chunk_size=5)
    bias = (torch.randn(B, H, N, k, dtype=F64) * 2).requires_grad_()
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    out = run(neighbor_attention, xq, xk, v, idx, bias, proj, key_mask=key_mask, dense_below=dense_below)
    ref = run(neighbor_attention_reference, xq, xk, v, idx, bias, proj, key_mask=key_mask)
    assert_close(out, ref)
    up = torch.randn_like(out)
    g_out = torch.autograd.grad((out * up).sum(), (xq, xk, v, bias), retain_graph=True)
    g_ref = torch.autograd.grad((ref * up).sum(), (xq, xk, v, bias))
    for a, b in zip(g_out, g_ref):
        assert_close(a, b)


def spectral(B, H, N, R2=6, dtype=F64):
    a = (torch.randn(B, H, N, R2, dtype=dtype) * 0.7).requires_grad_()
    c = (torch.randn(B, H, N, R2, dtype=dtype) * 0.7).requires_grad_()
    return a, c


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("N, k", [(1, 1), (7, 7), (29, 5), (37, 12)])
@pytest.mark.parametrize("dense_below", [0, 128])
@pytest.mark.parametrize("shared", [False, True])  # a, c, near mask per item or shared by the batch
def test_multiplicative_form_equals_reference_forward_and_backward(padded, N, k, dense_below, shared):
    B, H = 3, 2
    xq, xk, v = inputs(B=B, H=H, N=N)
    pos = torch.randn(B, N, 3, dtype=F64)
    key_mask = (torch.rand(B, N) > 0.3) if padded else None
    if padded:
        key_mask[:, 0] = True
    idx = nearest_keys(pos, k, key_mask=key_mask)
    a, c = spectral(1 if shared else B, H, N)
    mask = torch.randn(1 if shared else B, H, N, k, dtype=F64).requires_grad_()  # any sign
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    kw = dict(key_mask=key_mask, a=a, c=c, near_mask=mask)
    out = run(neighbor_attention, xq, xk, v, idx, None, proj, dense_below=dense_below, **kw)
    ref = run(neighbor_attention_reference, xq, xk, v, idx, None, proj, **kw)
    assert_close(out, ref)
    up = torch.randn_like(out)
    leaves = (xq, xk, v, a, c, mask)
    g_out = torch.autograd.grad((out * up).sum(), leaves, retain_graph=True)
    g_ref = torch.autograd.grad((ref * up).sum(), leaves)
    for x, y in zip(g_out, g_ref):
        assert_close(x, y)


@pytest.mark.parametrize("padded", [False, True])
def test_multiplicative_form_with_k_equal_to_n_is_the_exact_masked_attention(padded):
    B, H, N = 2, 2, 13
    xq, xk, v = inputs(B=B, H=H, N=N)
    pos = torch.randn(B, N, 3, dtype=F64)
    key_mask = torch.ones(B, N, dtype=torch.bool)
    if padded:
        key_mask[1, -4:] = False
    idx = nearest_keys(pos, N, key_mask=key_mask if padded else None)
    full = torch.rand(B, H, N, N, dtype=F64) + 0.1
    mask = full.gather(-1, idx.unsqueeze(1).expand(B, H, N, N))
    w = (full * torch.exp(xq @ xk.transpose(-1, -2))).masked_fill(~key_mask[:, None, None, :], 0.0)
    expected = (w @ v) / w.sum(-1, keepdim=True)
    a, c = spectral(B, H, N)
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    for dense_below in (0, 128):
        got = run(neighbor_attention, xq, xk, v, idx, None, proj, key_mask=key_mask if padded else None,
                  a=a, c=c, near_mask=mask, dense_below=dense_below)
        assert_close(got, expected)


def test_multiplicative_far_weights_are_unbiased():
    # A far pair's weight is FAVOR+'s estimate of exp(xq.xk) times the random-frequency
    # estimate a.c of the mask f, from independent draws: its mean over draws is f exp(xq.xk).
    from flt.relative.spectra import SPECTRA

    torch.manual_seed(0)
    H, N, D = 2, 6, 4
    xq, xk, _ = inputs(B=1, H=H, N=N, D=D, scale=0.4)
    xq, xk = xq.detach(), xk.detach()
    pos = torch.randn(1, N, 3, dtype=F64)
    spectrum = SPECTRA["gaussian"](heads=H, pos_dim=3, num_frequencies=4, amplitude=1.5, length_scale=1.0).double()
    gen = torch.Generator().manual_seed(1)
    draws = []
    for _ in range(3000):
        proj = gaussian_orthogonal_random_matrix(4, D, dtype=F64, generator=gen)
        spectrum.redraw_frequencies(gen)
        qf, sq = favor_plus_features(xq, proj)
        kf, sk = favor_plus_features(xk, proj)
        a, c = spectrum.features(pos)
        with torch.no_grad():
            w = (qf @ kf.transpose(-1, -2)) * torch.exp(sq).unsqueeze(-1) * torch.exp(sk).unsqueeze(-2)
            draws.append(w * (a @ c.transpose(-1, -2)))
    draws = torch.stack(draws)
    delta = pos.unsqueeze(2) - pos.unsqueeze(1)
    with torch.no_grad():
        exact = spectrum.mask(delta).permute(0, 3, 1, 2) * torch.exp(xq @ xk.transpose(-1, -2))
    z = (draws.mean(0) - exact) / (draws.std(0) / len(draws) ** 0.5)
    assert z.abs().max() < 5.0, z.abs().max()
    assert (draws.std(0) > 0).all()  # the estimate does vary: the check can fail


def test_gradcheck_small():
    xq, xk, v = inputs(B=2, N=6)
    pos = torch.randn(2, 6, 3, dtype=F64)
    key_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    idx = nearest_keys(pos, 3, key_mask=key_mask)
    bias = torch.randn(2, 2, 6, 3, dtype=F64, requires_grad=True)
    proj = gaussian_orthogonal_random_matrix(5, 4, dtype=F64)
    for dense_below in (0, 128):
        fn = lambda *t: run(neighbor_attention, *t[:3], idx, t[3], proj, key_mask=key_mask, dense_below=dense_below)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (xq, xk, v, bias))


def test_batch_shared_near_sets_and_bias_broadcast():
    xq, xk, v = inputs(B=3, N=16)
    grid = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(1, 16, 2).to(F64)
    idx = nearest_keys(grid, 5)
    assert idx.shape == (1, 16, 5)  # searched once for the whole batch
    bias = torch.randn(1, 2, 16, 5, dtype=F64)
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    out = run(neighbor_attention, xq, xk, v, idx, bias, proj)
    per_item = run(neighbor_attention, xq, xk, v, idx.expand(3, -1, -1), bias.expand(3, -1, -1, -1), proj, dense_below=0)
    assert_close(out, per_item)
    assert_close(out, run(neighbor_attention_reference, xq, xk, v, idx, bias, proj))


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_near_sets_match_a_brute_force_argsort(P, padded):
    B, N, k = 2, 41, 9
    pos = torch.randint(0, 4, (B, N, P)).to(F64)  # many exact ties
    key_mask = (torch.rand(B, N) > 0.5) if padded else None
    idx = nearest_keys(pos, k, key_mask=key_mask, chunk_size=7)
    assert torch.equal(idx, brute_force_near(pos, k, key_mask))
    own = torch.arange(N).expand(B, N)
    valid = torch.ones(B, N, dtype=torch.bool) if key_mask is None else key_mask
    assert torch.equal(idx[..., 0][valid], own[valid])  # self first, even among equal positions
    assert torch.equal(nearest_keys(pos, k, key_mask=key_mask, chunk_size=1000), idx)
    # float32 positions search in float32 and give the same sets for these integer positions
    assert torch.equal(nearest_keys(pos.float(), k, key_mask=key_mask), idx)


def test_near_offsets_are_differentiable_position_differences():
    pos = torch.randn(2, 7, 3, dtype=F64, requires_grad=True)
    idx = nearest_keys(pos, 4)
    delta = near_offsets(pos, idx)
    assert delta.shape == (2, 7, 4, 3)
    for b in range(2):
        for i in range(7):
            for t in range(4):
                assert torch.equal(delta[b, i, t], pos[b, i] - pos[b, idx[b, i, t]])
    delta.sum().backward()
    assert pos.grad is not None


def test_token_positions_with_k_2w_plus_1_equal_the_band_op_away_from_the_ends():
    # On positions 0..N-1 the 2w + 1 nearest keys of a query at least w from both ends are
    # exactly its band |i - j| <= w; near the ends the k nearest reach further on one side.
    N, w = 40, 3
    xq, xk, v = inputs(N=N)
    pos = torch.arange(N, dtype=F64).view(1, N, 1)
    idx = nearest_keys(pos, 2 * w + 1)
    band_bias = torch.randn(1, 2, N, 2 * w + 1, dtype=F64)
    offsets = idx - torch.arange(N).view(1, N, 1)  # j - i
    interior = slice(w, N - w)
    assert (offsets[:, interior].abs() <= w).all()
    near_bias = band_bias.gather(-1, (offsets.clamp(-w, w) + w).unsqueeze(1).expand(1, 2, N, 2 * w + 1))
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    qf, sq = favor_plus_features(xq, proj)
    kf, sk = favor_plus_features(xk, proj)
    band = band_attention(xq, xk, v, qf, kf, sq, sk, band_bias, width=w)
    for dense_below in (0, 128):
        ours = neighbor_attention(xq, xk, v, qf, kf, sq, sk, idx, near_bias, dense_below=dense_below)
        assert_close(ours[:, :, interior], band[:, :, interior])
        assert not torch.allclose(ours[:, :, 0], band[:, :, 0])


@pytest.mark.parametrize("padded", [False, True])
def test_k_equal_to_n_is_exact_softmax_with_the_bias(padded):
    B, H, N, P = 2, 2, 13, 3
    xq, xk, v = inputs(B=B, H=H, N=N)
    pos = torch.randn(B, N, P, dtype=F64)
    key_mask = torch.ones(B, N, dtype=torch.bool)
    if padded:
        key_mask[1, -4:] = False
    idx = nearest_keys(pos, N, key_mask=key_mask if padded else None)
    full = torch.randn(B, H, N, N, dtype=F64)
    bias = full.gather(-1, idx.unsqueeze(1).expand(B, H, N, N))
    logits = (xq @ xk.transpose(-1, -2) + full).masked_fill(~key_mask[:, None, None, :], -float("inf"))
    expected = torch.softmax(logits, dim=-1) @ v
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    for dense_below in (0, 128):
        got = run(neighbor_attention, xq, xk, v, idx, bias, proj, key_mask=key_mask if padded else None, dense_below=dense_below)
        assert_close(got, expected)


def test_row_sums_stay_positive_with_a_huge_bias():
    # Exact near weights are positive and far weights are FAVOR+ (nonnegative): no cancellation.
    xq, xk, v = inputs(N=50, dtype=torch.float32)
    pos = torch.randn(2, 50, 3)
    idx = nearest_keys(pos, 6)
    proj = gaussian_orthogonal_random_matrix(8, 4)
    with torch.no_grad():
        for value, dense_below in itertools.product((60.0, -60.0), (0, 128)):
            bias = torch.full((2, 2, 50, 6), value)
            out = run(neighbor_attention, xq, xk, torch.ones_like(v), idx, bias, proj, dense_below=dense_below)
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out, torch.ones_like(out))  # values of 1 average to 1


def test_far_field_converges_to_exact_softmax_with_many_features():
    B, H, N = 1, 2, 11
    xq, xk, v = inputs(B=B, H=H, N=N)
    pos = torch.randn(B, N, 2, dtype=F64)
    idx = nearest_keys(pos, 3)
    bias = torch.randn(B, H, N, 3, dtype=F64)
    near = torch.zeros(B, N, N, dtype=torch.bool).scatter(-1, idx, True)[:, None]
    full = torch.zeros(B, H, N, N, dtype=F64).scatter(-1, idx[:, None].expand(B, H, N, 3), bias)
    expected = torch.softmax(xq @ xk.transpose(-1, -2) + torch.where(near, full, torch.zeros(())), dim=-1) @ v
    # FAVOR+'s own error on exp(xq.xk) at this m and seed is about 0.05; the near set adds none.
    proj = gaussian_orthogonal_random_matrix(200_000, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    got = run(neighbor_attention, xq, xk, v, idx, bias, proj)
    assert ((got - expected).norm() / expected.norm()).item() < 0.05


@pytest.mark.parametrize("bad, match", [
    (dict(k=0), "k must be a positive integer"),
    (dict(k=6), r"k \(6\) must be at most"),
    (dict(pos=torch.zeros(2, 5, 2, dtype=torch.long)), "pos must have a floating-point dtype"),
    (dict(pos=torch.zeros(5, 2)), "pos must have rank 3"),
    (dict(key_mask=torch.ones(2, 5)), "key_mask"),
])
def test_nearest_keys_rejects_bad_arguments(bad, match):
    kw = dict(pos=torch.zeros(2, 5, 2), k=2)
    kw.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        nearest_keys(kw.pop("pos"), kw.pop("k"), **kw)


@pytest.mark.parametrize("bad, match", [
    (dict(idx=torch.zeros(2, 5, 2, dtype=torch.int32)), "idx must be an int64"),
    (dict(idx=torch.zeros(2, 4, 2, dtype=torch.long)), r"idx must be \[B or 1, N, k\]"),
    (dict(bias=torch.zeros(2, 2, 5, 3, dtype=F64)), "near_bias must be"),
    (dict(key_mask=torch.ones(2, 5)), "key_mask"),
    (dict(causal=True), "causal=True is not supported"),
    (dict(near_mask=torch.zeros(2, 2, 5, 2, dtype=F64)), "takes a, c and near_mask together"),
    (dict(xq=torch.zeros(2, 2, 5, 4, dtype=torch.long)), "xq must have a floating-point dtype"),
])
def test_neighbor_attention_rejects_bad_arguments(bad, match):
    xq, xk, v = inputs(N=5)
    kw = dict(xq=xq, idx=nearest_keys(torch.randn(2, 5, 2), 2), bias=torch.zeros(2, 2, 5, 2, dtype=F64))
    kw.update(bad)
    proj = gaussian_orthogonal_random_matrix(8, 4, dtype=F64)
    qf, sq = favor_plus_features(xq, proj)
    kf, sk = favor_plus_features(xk, proj)
    extra = {k: kw[k] for k in ("key_mask", "causal", "near_mask") if k in kw}
    with pytest.raises((ValueError, TypeError), match=match):
        neighbor_attention(kw["xq"], xk, v, qf, kf, sq, sk, kw["idx"], kw["bias"], **extra)


def spatial_cases():
    g = torch.Generator().manual_seed(3)
    uniform = torch.rand(2, 700, 3, generator=g, dtype=F64) * 10
    grid = torch.randint(0, 9, (1, 700, 3), generator=g).to(F64)  # many exact ties, repeated points
    plane = torch.cat([torch.rand(1, 500, 2, generator=g, dtype=F64), torch.zeros(1, 500, 1, dtype=F64)], -1)
    clusters = torch.cat([torch.randn(1, 500, 3, generator=g, dtype=F64) * 0.01,
                          torch.randn(1, 60, 3, generator=g, dtype=F64) * 50], 1)  # dense cluster, sparse halo
    line = torch.rand(1, 400, 1, generator=g, dtype=F64)
    square = torch.randint(0, 20, (2, 400, 2), generator=g).to(F64)
    return [("uniform", uniform, 8), ("grid", grid, 16), ("plane", plane, 5), ("clusters", clusters, 8),
            ("line", line, 7), ("square", square, 9), ("uniform k=1", uniform, 1)]


@pytest.mark.parametrize("name, pos, k", spatial_cases(), ids=lambda c: c if isinstance(c, str) else "")
@pytest.mark.parametrize("padded", [False, True])
def test_spatial_search_gives_the_sets_of_the_quadratic_search(name, pos, k, padded, monkeypatch):
    left_over = []
    search_rows = neighbors._brute_force_rows
    monkeypatch.setattr(neighbors, "_brute_force_rows", lambda pos, rows, *a: left_over.append(rows.numel()) or search_rows(pos, rows, *a))
    key_mask = (torch.rand(pos.shape[0], pos.shape[1], generator=torch.Generator().manual_seed(1)) > 0.3) if padded else None
    fast = nearest_keys(pos, k, key_mask=key_mask, spatial=True)
    if name in ("uniform", "uniform k=1", "plane", "line"):  # evenly spread: the cell lists answered most queries
        assert sum(left_over) < pos.shape[0] * pos.shape[1] / 4
    assert torch.equal(fast, nearest_keys(pos, k, key_mask=key_mask, spatial=False))
    assert torch.equal(nearest_keys(pos.float(), k, key_mask=key_mask, spatial=True),
                       nearest_keys(pos.float(), k, key_mask=key_mask, spatial=False))


def test_spatial_search_is_the_default_for_thousands_of_points_and_agrees_with_a_python_argsort():
    pos = torch.randint(0, 9, (1, 1100, 3)).to(F64)
    key_mask = torch.rand(1, 1100) > 0.5
    idx = nearest_keys(pos, 6, key_mask=key_mask)  # spatial by default (N >= SPATIAL_FROM, P <= 3)
    rows = torch.randperm(1100)[:60]
    expected = brute_force_near(pos, 6, key_mask)
    assert torch.equal(idx[0, rows], expected[0, rows])
    with pytest.raises(ValueError, match="spatial must be None"):
        nearest_keys(pos, 6, spatial="yes")


def written_out_features_form(qf, kf, v, sq, sk, idx, mask, a, c, key_mask):
    """``w_ij = qf_i.kf_j exp(sq_i + sk_j) (m_ij if j in K(i) else a_i.c_j)``, pair by pair."""
    B, H, N, _ = qf.shape
    out = torch.zeros(B, H, N, v.shape[-1], dtype=F64)
    for b, h, i in itertools.product(range(B), range(H), range(N)):
        num, den = torch.zeros(v.shape[-1], dtype=F64), torch.zeros((), dtype=F64)
        near = idx[min(b, idx.shape[0] - 1), i].tolist()
        for j in range(N):
            if key_mask is not None and not key_mask[b, j]:
                continue
            kernel = (qf[b, h, i] @ kf[b, h, j]) * torch.exp(sq[b, h, i] + sk[b, h, j])
            bm = min(b, a.shape[0] - 1)
            m = mask[min(b, mask.shape[0] - 1), h, i, near.index(j)] if j in near else a[bm, h, i] @ c[bm, h, j]
            num, den = num + kernel * m * v[b, h, j], den + kernel * m
        out[b, h, i] = num / den
    return out


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("N, k", [(1, 1), (9, 9), (23, 5)])
@pytest.mark.parametrize("dense_below", [0, 128])
@pytest.mark.parametrize("scaled", [False, True])  # log scales as FAVOR+ gives them, or none (hedgehog, elu, ...)
def test_features_kernel_on_the_near_set_equals_the_written_out_sum(padded, N, k, dense_below, scaled):
    # near_kernel="features": the near pairs keep the far field's kernel qf.kf and get the
    # exact mask, the far pairs its Kronecker estimate a.c (any feature map).
    torch.manual_seed(N + k + dense_below + 7 * padded + 3 * scaled)
    B, H, m = 2, 2, 5
    xq, xk, v = inputs(B=B, H=H, N=N)
    qf = torch.rand(B, H, N, m, dtype=F64).requires_grad_()  # nonnegative, as hedgehog's
    kf = torch.rand(B, H, N, m, dtype=F64).requires_grad_()
    sq = torch.randn(B, H, N, dtype=F64) if scaled else None
    sk = torch.randn(B, H, N, dtype=F64) * 3 if scaled else None
    pos = torch.randn(B, N, 3, dtype=F64)
    key_mask = (torch.rand(B, N) > 0.3) if padded else None
    if padded:
        key_mask[:, 0] = True
    idx = nearest_keys(pos, k, key_mask=key_mask)
    a, c = spectral(B, H, N)
    mask = (torch.rand(B, H, N, k, dtype=F64) + 0.5).requires_grad_()
    kw = dict(key_mask=key_mask, a=a, c=c, near_mask=mask, near_kernel="features")
    out = neighbor_attention(xq, xk, v, qf, kf, sq, sk, idx, None, dense_below=dense_below, **kw)
    ref = neighbor_attention_reference(xq, xk, v, qf, kf, sq, sk, idx, None, **kw)
    zero = torch.zeros(B, H, N, dtype=F64)
    written = written_out_features_form(qf, kf, v, zero if sq is None else sq, zero if sk is None else sk, idx, mask, a, c,
                                        key_mask)
    assert_close(out, written)
    assert_close(ref, written)
    up = torch.randn_like(out)
    leaves = (qf, kf, v, a, c, mask)
    g_out = torch.autograd.grad((out * up).sum(), leaves, retain_graph=True, allow_unused=True)
    g_ref = torch.autograd.grad((written * up).sum(), leaves, allow_unused=True)  # a, c unused when every key is near
    for leaf, x, y in zip(leaves, g_out, g_ref):
        assert_close(torch.zeros_like(leaf) if x is None else x, torch.zeros_like(leaf) if y is None else y)
    # xq, xk carry no weight in this form: their exponential kernel is not used.
    assert torch.autograd.grad(out.sum(), (xq, xk), allow_unused=True) == (None, None)


def test_features_kernel_differs_from_the_exp_kernel_only_on_the_near_set():
    # With FAVOR+ features the two near kernels differ (exact exp vs its estimate); with
    # a, c = 0 and k = N everything is near, so the features' form is exact masked attention
    # with the features' kernel.
    B, H, N, m = 1, 2, 11, 6
    xq, xk, v = inputs(B=B, H=H, N=N)
    qf, kf = torch.rand(B, H, N, m, dtype=F64), torch.rand(B, H, N, m, dtype=F64)
    idx = nearest_keys(torch.randn(B, N, 3, dtype=F64), N)
    full = torch.rand(B, H, N, N, dtype=F64) + 0.1
    mask = full.gather(-1, idx.unsqueeze(1).expand(B, H, N, N))
    a, c = torch.zeros(B, H, N, 4, dtype=F64), torch.zeros(B, H, N, 4, dtype=F64)
    w = full * (qf @ kf.transpose(-1, -2))
    got = neighbor_attention(xq, xk, v, qf, kf, None, None, idx, None, a=a, c=c, near_mask=mask, near_kernel="features")
    assert_close(got, (w @ v) / w.sum(-1, keepdim=True))
    exp_form = neighbor_attention(xq, xk, v, qf, kf, None, None, idx, None, a=a, c=c, near_mask=mask)
    assert (exp_form - got).abs().max() > 1e-3


def test_features_kernel_needs_the_multiplicative_form():
    xq, xk, v = inputs(B=1, H=1, N=5)
    qf = torch.rand(1, 1, 5, 3, dtype=F64)
    idx = nearest_keys(torch.randn(1, 5, 2, dtype=F64), 2)
    with pytest.raises(ValueError, match="multiplicative form"):
        neighbor_attention(xq, xk, v, qf, qf, None, None, idx, torch.zeros(1, 1, 5, 2, dtype=F64), near_kernel="features")
    with pytest.raises(ValueError, match="near_kernel must be one of"):
        neighbor_attention(xq, xk, v, qf, qf, None, None, idx, torch.zeros(1, 1, 5, 2, dtype=F64), near_kernel="hedgehog")
