"""FLTAttention(near_neighbors=k): the spatial near field (exact weights on each query's k
nearest keys in position space) against its reference and a direct O(N^2) computation."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, assert_same_gradients
from flt import FLTAttention
from flt.ops.neighbors import nearest_keys

F64 = torch.float64


def strong_layer(k=6, P=3, spectrum="gaussian", amplitude=2.0, **kw):
    options = {"length_scale": 1.0} if spectrum == "gaussian" else {}
    layer = FLTAttention.from_options(32, 2, pos_dim=P, spectrum=spectrum, num_features=16, num_frequencies=8, near_neighbors=k,
                         **options, **kw).double()
    with torch.no_grad():
        for module in (layer.spectrum, layer.near_spectrum):
            for name, p in module.named_parameters():
                if name in ("amplitude", "alpha"):
                    p.add_(torch.rand_like(p) * amplitude / p.shape[-1])
    return layer


def direct(layer, x, pos, pad=None):
    """``softmax(x_q.x_k + f + f_near 1[j in K(i)])`` written out pair by pair."""
    p = layer.prepare(x, pos, pad)
    xq, xk = layer.core.scaled_qk(p.q, p.k, p.pos)
    B, H, N, _ = xq.shape
    pos = p.pos.expand(B, -1, -1)
    valid = torch.ones(B, N, dtype=torch.bool) if pad is None else ~pad
    out = torch.zeros_like(p.v)
    for b in range(B):
        d = (pos[b, :, None] - pos[b, None]).square().sum(-1)
        logits = xq[b] @ xk[b].transpose(-1, -2) + layer.spectrum.mask(pos[b, :, None] - pos[b, None]).permute(2, 0, 1)
        near = layer.near_spectrum.mask(pos[b, :, None] - pos[b, None]).permute(2, 0, 1)
        k = min(layer.near_neighbors, N)
        for i in range(N):
            order = sorted(range(N), key=lambda j: (not valid[b, j], j != i, d[i, j].item(), j))[:k]
            for j in order:
                logits[:, i, j] = logits[:, i, j] + near[:, i, j]
        logits = logits.masked_fill(~valid[b], -float("inf"))
        out[b] = torch.softmax(logits, -1) @ p.v[b]
    return layer.finish(out, x)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("spectrum", ["gaussian", "gaussian_mixture"])
def test_forward_equals_reference_forward_and_backward(P, spectrum):
    layer = strong_layer(k=5, P=P, spectrum=spectrum)
    x = torch.randn(3, 23, 32, dtype=F64, requires_grad=True)
    pos = torch.randn(3, 23, P, dtype=F64) * 2
    pad = torch.zeros(3, 23, dtype=torch.bool)
    pad[1, -6:] = True
    out, ref = layer(x, pos, key_padding_mask=pad), layer.reference(x, pos, key_padding_mask=pad)
    g_out = assert_same_gradients(out, ref, [x] + list(layer.parameters()))
    near = dict(zip([n for n, _ in [("x", x)] + list(layer.named_parameters())], g_out))
    assert any(g is not None and g.abs().sum() > 0 for n, g in near.items() if n.startswith("core.near_spectrum"))


@pytest.mark.parametrize("padded", [False, True])
def test_exact_is_the_direct_quadratic_formula(padded):
    layer = strong_layer(k=4, P=3)
    x = torch.randn(2, 11, 32, dtype=F64)
    pos = torch.randint(0, 3, (2, 11, 3)).to(F64)  # ties between distances
    pad = None
    if padded:
        pad = torch.zeros(2, 11, dtype=torch.bool)
        pad[0, 7:] = True
    with torch.no_grad():
        assert_close(layer.exact(x, pos, pad), direct(layer, x, pos, pad))


def test_k_at_least_n_is_exact_attention_and_converges_with_m():
    layer = strong_layer(k=40, P=2)
    x = torch.randn(2, 17, 32, dtype=F64)
    pos = torch.rand(2, 17, 2, dtype=F64)
    with torch.no_grad():
        assert_close(layer(x, pos), layer.exact(x, pos))  # every key is near: nothing estimated
        assert_close(layer.exact(x, pos), direct(layer, x, pos))


@pytest.mark.parametrize("coupling", ["logit", "multiplicative"])
def test_shifted_spectra_in_the_near_set_keep_the_sign_of_the_offsets(coupling):
    """Masks that are not even (shifted components, far and near): with every key near,
    the near-set path (offsets of query and key through ``near_offsets``) equals the exact
    attention over ``r_i - r_j`` and the direct formula, in both couplings."""
    layer = strong_layer(k=40, P=2, spectrum="gaussian_mixture", coupling=coupling, shift=True, shift_scale=0.5,
                         length_scale=1.0, length_spread=2.0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in (layer.spectrum, layer.near_spectrum):
            module.shift.copy_(2 * torch.randn(module.shift.shape, generator=gen, dtype=F64))
    x = torch.randn(2, 17, 32, dtype=F64)
    pos = torch.rand(2, 17, 2, dtype=F64) * 3
    d = pos[0, :, None] - pos[0, None]
    assert (layer.spectrum.mask(d) - layer.spectrum.mask(-d)).abs().max() > 0.1  # not even
    with torch.no_grad():
        assert_close(layer(x, pos), layer.exact(x, pos))
        if coupling == "logit":
            assert_close(layer.exact(x, pos), direct(layer, x, pos))


def test_batch_shared_positions_give_the_rows_of_each_sample():
    layer = strong_layer(k=5, P=2)
    grid = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(16, 2).to(F64)
    x = torch.randn(3, 16, 32, dtype=F64)
    with torch.no_grad():
        together = layer(x, grid.expand(3, 16, 2))
        alone = torch.cat([layer(x[i : i + 1], grid) for i in range(3)])
    assert_close(together, alone)


def test_strong_local_mask_in_the_near_spectrum_costs_no_variance():
    # A Gaussian bump of f(0) = 3.5 on 3-D points: in f (concatenated into FAVOR+) the
    # estimate is poor; in f_near on the 16 nearest keys it is FAVOR+'s error with f = 0.
    torch.manual_seed(0)
    N = 96
    pos = torch.rand(2, N, 3, dtype=F64) * N ** (1 / 3)  # unit density
    x = torch.randn(2, N, 32, dtype=F64)
    errs = {}
    for name, k in (("plain", 0), ("near", 16)):
        layer = FLTAttention.from_options(32, 2, pos_dim=3, spectrum="gaussian", length_scale=1.0, num_features=64, num_frequencies=16,
                             near_neighbors=k).double()
        with torch.no_grad():
            (layer.near_spectrum if k else layer.spectrum).amplitude.fill_(3.5)
            errs[name] = ((layer(x, pos) - layer.exact(x, pos)).norm() / layer.exact(x, pos).norm()).item()
    assert errs["near"] < 0.15 and errs["plain"] > 2 * errs["near"], errs


def multiplicative_direct(layer, x, pos, pad=None):
    """``(f + f_near 1[j in K(i)]) exp(x_q.x_k)``, normalised, written out pair by pair."""
    p = layer.prepare(x, pos, pad)
    xq, xk = layer.core.scaled_qk(p.q, p.k, p.pos)
    B, H, N, _ = xq.shape
    pos = p.pos.expand(B, -1, -1)
    valid = torch.ones(B, N, dtype=torch.bool) if pad is None else ~pad
    out = torch.zeros_like(p.v)
    for b in range(B):
        delta = pos[b, :, None] - pos[b, None]
        d = delta.square().sum(-1)
        mask = layer.spectrum.mask(delta).permute(2, 0, 1)
        near = layer.near_spectrum.mask(delta).permute(2, 0, 1)
        for i in range(N):
            order = sorted(range(N), key=lambda j: (not valid[b, j], j != i, d[i, j].item(), j))[:min(layer.near_neighbors, N)]
            for j in order:
                mask[:, i, j] = mask[:, i, j] + near[:, i, j]
        w = (mask * torch.exp(xq[b] @ xk[b].transpose(-1, -2))) * valid[b].to(x.dtype)
        out[b] = (w @ p.v[b]) / w.sum(-1, keepdim=True)
    return layer.finish(out, x)


@pytest.mark.parametrize("spectrum", ["gaussian", "gaussian_mixture"])
def test_multiplicative_coupling_forward_equals_reference_and_exact_is_direct(spectrum):
    layer = strong_layer(k=5, P=3, spectrum=spectrum, coupling="multiplicative")
    x = torch.randn(3, 23, 32, dtype=F64, requires_grad=True)
    pos = torch.randn(3, 23, 3, dtype=F64) * 2
    pad = torch.zeros(3, 23, dtype=torch.bool)
    pad[1, -6:] = True
    out, ref = layer(x, pos, key_padding_mask=pad), layer.reference(x, pos, key_padding_mask=pad)
    g_out = assert_same_gradients(out, ref, [x] + list(layer.parameters()))
    near = dict(zip([n for n, _ in layer.named_parameters()], g_out[1:]))
    assert any(g is not None and g.abs().sum() > 0 for n, g in near.items() if n.startswith("core.near_spectrum"))
    with torch.no_grad():
        assert_close(layer.exact(x, pos, pad), multiplicative_direct(layer, x, pos, pad))
        big = strong_layer(k=40, P=3, spectrum=spectrum, coupling="multiplicative")
        assert_close(big(x[:, :17], pos[:, :17]), big.exact(x[:, :17], pos[:, :17]))  # all keys near: nothing estimated


def test_multiplicative_near_set_makes_a_strong_local_mask_stable():
    # The FLT paper's coupling with a local Gaussian mask (f(0) = 3.5, length 1 at unit
    # density) in f: the Kronecker estimate's errors add up coherently over the keys and
    # the row sums drift (error >> 1). The same local mask in f_near on the 16 nearest keys,
    # exact there, with a broad f left to the estimate: about FAVOR+'s own error.
    errs = {"plain": [], "near": []}
    for seed in range(3):  # the plain error is heavy-tailed over draws: 0.5 to 20 here
        torch.manual_seed(seed)
        N = 96
        pos = torch.rand(2, N, 3, dtype=F64) * N ** (1 / 3)
        x = torch.randn(2, N, 32, dtype=F64)
        for name, k in (("plain", 0), ("near", 16)):
            layer = FLTAttention.from_options(32, 2, pos_dim=3, spectrum="gaussian", coupling="multiplicative", length_scale=1.0,
                                 num_features=64, num_frequencies=32, near_neighbors=k).double()
            with torch.no_grad():
                (layer.near_spectrum if k else layer.spectrum).amplitude.fill_(3.5)
                if k:
                    layer.spectrum.log_length.add_(torch.log(torch.tensor(3.0)))  # a broad far field
                exact = layer.exact(x, pos)
                errs[name].append(((layer(x, pos) - exact).norm() / exact.norm()).item())
    assert max(errs["near"]) < 0.15 and max(errs["plain"]) > 1.0, errs


def test_near_set_is_the_k_nearest_valid_keys():
    layer = strong_layer(k=3, P=2)
    pos = torch.tensor([[[0.0, 0.0], [5.0, 0.0], [0.1, 0.0], [0.0, 0.2], [0.05, 0.0]]], dtype=F64)
    pad = torch.tensor([[False, False, False, False, True]])
    idx = layer.near.keys(pos, ~pad)
    assert idx[0, 0].tolist() == [0, 2, 3]
    assert torch.equal(idx, nearest_keys(pos, 3, key_mask=~pad))


def test_option_errors():
    with pytest.raises(ValueError, match="near_neighbors must be a nonnegative int"):
        FLTAttention.from_options(32, 2, near_neighbors=-1)
    with pytest.raises((TypeError, ValueError), match="near_neighbors"):
        FLTAttention.from_options(32, 2, near_neighbors=2.5)
    with pytest.raises(ValueError, match="exclusive"):
        FLTAttention.from_options(32, 2, near_neighbors=4, near_field=4)
    with pytest.raises(ValueError, match="near_field needs coupling='logit'"):
        FLTAttention.from_options(32, 2, near_field=4, coupling="multiplicative")
    with pytest.raises(ValueError, match="causal=False"):
        FLTAttention.from_options(32, 2, near_neighbors=4, causal=True)
    layer = FLTAttention.from_options(32, 2, near_neighbors=4)
    assert layer.near_spectrum is not None and layer.near_spectrum.has_random_features is False


@pytest.mark.cli
def test_spatial_fidelity_sweep_and_cli(tmp_path, monkeypatch):
    # The measurement behind near_neighbors (flt approx --spatial), small.
    from flt.bench import approx
    from flt.cli import main as cli_main

    rows = approx.spatial_fidelity_errors((0.0, 3.5), ((64, 16),), point_sets=["3-D random, N=64"], seeds=(0,), dim=64,
                                          estimators=["concat (logit, no near set)", "k=16 nearest, mask in f_near"])
    err = {(r.estimator, r.amplitude): r for r in rows}
    plain, near = err[("concat (logit, no near set)", 3.5)], err[("k=16 nearest, mask in f_near", 3.5)]
    assert plain.rel_error == plain.full_mask_error
    assert near.rel_error <= 2 * err[("concat (logit, no near set)", 0.0)].rel_error
    assert plain.rel_error > 3 * near.rel_error
    assert near.rel_error <= near.full_mask_error < plain.rel_error  # truncating the bump costs less than estimating it
    sweep = approx.spatial_fidelity_errors
    monkeypatch.setattr(approx, "spatial_fidelity_errors", lambda a, s, **kw: sweep(a, s, point_sets=["2-D grid 16x16"], dim=32, estimators=["k=8 nearest, mask in f_near"], **kw))
    assert cli_main(["approx", "--spatial", "--quick", "--out-dir", str(tmp_path)]) == 0
    import json

    data = json.loads((tmp_path / "spatial.json").read_text())["spatial"]
    assert {r["estimator"] for r in data} == {"k=8 nearest, mask in f_near"} and len(data) == 2


def test_deterministic_kernel_features_leave_only_the_mask_to_estimate_on_point_sets():
    # flt approx --spatial's rows for the catalysis form: with elu or hedgehog features only
    # f is estimated (256 QMC frequencies, whatever the setting's R), and a bump of length 1
    # on 64 atoms is estimated far better than with FAVOR+ features in the same coupling.
    from flt.bench import approx

    names = ["multiplicative, gaussian f", "multiplicative, elu features, 256 QMC",
             "multiplicative, hedgehog features, 256 QMC"]
    rows = approx.spatial_fidelity_errors((3.5,), ((64, 16),), point_sets=["3-D random, N=64"], seeds=(0,), dim=64,
                                          estimators=names)
    err = {r.estimator: r for r in rows}
    assert err[names[0]].R == 16 and err[names[1]].R == 256 and err[names[2]].R == 256
    for name in names[1:]:
        assert err[name].rel_error < 0.15, (name, err[name].rel_error)
        assert err[name].rel_error * 4 < err[names[0]].rel_error


def features_direct(layer, x, pos, pad=None):
    """The multiplicative near set with any feature map, pair by pair: ``w_ij = phi(x_q,i).
    phi(x_k,j) (f + f_near)(r_i - r_j)`` on the ``k`` nearest valid keys, ``phi.phi a_i.c_j``
    (the random-feature estimate of ``f``, zero unless ``far_field=True``) beyond them."""
    p = layer.prepare(x, pos, pad)
    xq, xk = layer.core.scaled_qk(p.q, p.k, p.pos)
    qf, kf = layer.feature_map(xq)[0], layer.feature_map(xk)[0]
    a, c = layer.core.far_features(p.pos)
    B, H, N, _ = xq.shape
    pos = p.pos.expand(B, -1, -1)
    a, c = a.expand(B, -1, -1, -1), c.expand(B, -1, -1, -1)
    valid = torch.ones(B, N, dtype=torch.bool) if pad is None else ~pad
    k = min(layer.near_neighbors, N)
    rows = []
    for b in range(B):
        delta = pos[b, :, None] - pos[b, None]
        exact = (layer.core.far_mask(delta) + layer.near_spectrum.of_offsets(delta)).permute(2, 0, 1)  # [H, N, N]
        d = delta.square().sum(-1)
        for i in range(N):
            near = sorted(range(N), key=lambda j: (not valid[b, j], j != i, d[i, j].item(), j))[:k]
            w = []
            for j in range(N):
                kernel = (qf[b, :, i] * kf[b, :, j]).sum(-1)  # [H]
                mask = exact[:, i, j] if j in near else (a[b, :, i] * c[b, :, j]).sum(-1)
                w.append(kernel * mask * valid[b, j])
            w = torch.stack(w, -1)  # [H, N]
            rows.append((w.unsqueeze(-1) * p.v[b]).sum(-2) / w.sum(-1, keepdim=True))
    out = torch.stack(rows).view(B, N, H, -1).transpose(1, 2)
    return layer.finish(out, x)


@pytest.mark.parametrize("feature_map", ["hedgehog", "elu", "relu", "taylor"])
@pytest.mark.parametrize("far_field", [True, False, "near"])
@pytest.mark.parametrize("padded", [False, True])
def test_multiplicative_near_set_takes_any_feature_map_with_its_own_kernel(feature_map, far_field, padded):
    # The near pairs get the exact mask with the features' kernel (the far field's), the
    # far pairs the random-feature estimate: forward and backward against the pair-by-pair sum.
    torch.manual_seed(3)
    layer = FLTAttention.from_options(16, 2, pos_dim=3, spectrum="gaussian", coupling="multiplicative", feature_map=feature_map,
                                      num_features=8, num_frequencies=6, near_neighbors=4, far_field=far_field,
                                      length_scale=1.5).double()
    with torch.no_grad():
        for p in layer.near_spectrum.parameters():
            p.add_(torch.rand_like(p) * 0.5)  # f_near off its start at 0
    x = torch.randn(2, 11, 16, dtype=F64, requires_grad=True)
    pos = torch.randn(2, 11, 3, dtype=F64) * 1.5
    pad = torch.zeros(2, 11, dtype=torch.bool)
    if padded:
        pad[1, -4:] = True
    kp = pad if padded else None
    out, direct = layer(x, pos, key_padding_mask=kp), features_direct(layer, x, pos, kp)
    assert_same_gradients(out, direct, [x] + [p for p in layer.parameters() if p.requires_grad])
    assert_same_gradients(out, layer.reference(x, pos, key_padding_mask=kp), [x])
    if far_field is not True and feature_map != "relu":
        # Nothing beyond the near set and a deterministic kernel: the layer is its exact().
        with torch.no_grad():
            assert_close(out, layer.exact(x, pos, kp))


def test_favor_near_set_keeps_the_exact_exponential_kernel():
    # FAVOR+ features estimate exp(x_q.x_k), so its near pairs keep that exact kernel (not
    # the features' estimate): with every key near, the layer is its exact().
    layer = FLTAttention.from_options(16, 2, pos_dim=3, spectrum="gaussian", coupling="multiplicative", num_features=4,
                                      num_frequencies=4, near_neighbors=20, length_scale=1.5).double()
    x, pos = torch.randn(2, 9, 16, dtype=F64), torch.randn(2, 9, 3, dtype=F64)
    with torch.no_grad():
        assert_close(layer(x, pos), layer.exact(x, pos))


def test_the_approx_bench_compares_a_partial_near_set_with_the_bump_on_every_pair():
    """``full_mask_error``: with the bump in the near spectrum on the 8 nearest of 64 keys, the
    comparison with the bump on every pair adds the truncation (above the estimate's
    own error); for the concatenation, with no near set, it is the same comparison."""
    from flt.bench.approx import spatial_fidelity_errors

    near, plain = spatial_fidelity_errors((3.5,), ((16, 8),), point_sets=["3-D random, N=64"],
                                          estimators=["k=8 nearest, mask in f_near", "concat (logit, no near set)"],
                                          dim=16, seeds=(0,))
    assert near.full_mask_error is not None and near.full_mask_error > 1.2 * near.rel_error
    assert plain.full_mask_error == pytest.approx(plain.rel_error, rel=1e-12)
