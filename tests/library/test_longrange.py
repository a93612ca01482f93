"""The long-range block (flt.layers.longrange) against its float64 O(N^2) reference, and its identities."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close, assert_same_gradients, random_rotation

from flt._limits import MemoryLimitError
from flt.layers.longrange import (
    CONTENT,
    FREQUENCIES,
    LongRangeBlock,
    RadialFrequencies,
    build_frequencies,
    check_block_options,
    coulomb_tail,
    coulomb_tail_quadrature,
    feature_sum,
    radial_profile,
    tail_reach,
)
from flt.relative.spectra.radial import gauss_legendre, sphere_quadrature

DIM, HEADS = 8, 2


def make_block(frequencies: str, *, content: str = "none", normalised: bool = False, dtype=torch.float64, **options) -> LongRangeBlock:
    """A float64 block with every parameter moved off its start (``W_o`` starts at zero)."""
    torch.manual_seed(1)
    block = LongRangeBlock(DIM, heads=HEADS, frequencies=frequencies, content=content, normalised=normalised,
                           feature_seed=0, dtype=dtype, **options)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return block


def inputs(B: int = 2, N: int = 7, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.randn(B, N, DIM, dtype=dtype, requires_grad=True)
    pos = (2 * torch.randn(B, N, 3, dtype=dtype)).requires_grad_()
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[B - 1, N - 2:] = B > 1  # with two sets, the second has two padded points
    return h, pos, pad


@pytest.mark.parametrize("content", CONTENT)
@pytest.mark.parametrize("normalised", [False, True])
@pytest.mark.parametrize("frequencies", list(FREQUENCIES))
def test_fast_path_is_the_dense_sum_forward_and_backward(frequencies, normalised, content):
    """Odd N, one padded set: output and the gradients of h, pos and every parameter match
    the pair-by-pair float64 sum of the same kernel (FAVOR+: the same draw)."""
    block = make_block(frequencies, content=content, normalised=normalised)
    h, pos, pad = inputs()
    out = block(h, pos, pad)
    ref = block.reference(h, pos, pad)
    params = [p for p in block.parameters() if p.requires_grad]
    grads = assert_same_gradients(out, ref, [h, pos, *params])
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads[:2]), "h and pos must get gradients"


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("normalised", [False, True])
def test_feature_sum_backward_is_autograds_of_the_written_out_sum(groups, normalised):
    """The hand-written backward of the cosine sum against autograd through the plain
    expression ``sum_r w_hr (cos_ir cos_jr + sin_ir sin_jr)`` summed over keys, float64:
    phases, weights and values, heads with their own phases (groups = heads) and heads
    sharing one set (groups = 1), a padded key."""
    torch.manual_seed(0)
    B, H, N, R, D = 2, 3, 5, 4, 2
    phase = (3 * torch.randn(B, groups, N, R, dtype=torch.float64)).requires_grad_()
    w = torch.randn(H, R, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, -1] = False
    out = feature_sum(phase, w, v, keep=keep, normalised=normalised)
    t = phase.expand(-1, H, -1, -1)
    f = (torch.cos(t[..., :, None, :] - t[..., None, :, :]) * w[None, :, None, None, :]).sum(-1)  # [B, H, N, N]
    f = f * keep[:, None, None, :].to(f.dtype)
    ref = f @ v
    if normalised:
        ref = ref / f.sum(-1, keepdim=True)
    assert_same_gradients(out, ref, [phase, w, v])
    assert torch.autograd.gradcheck(lambda p, w_, v_: feature_sum(p, w_, v_, keep=keep, normalised=normalised),
                                    (phase, w, v))


@pytest.mark.parametrize(("phase", "w", "v", "message"), [
    ((2, 3, 5, 4), (3, 4), (2, 3, 5), "v must have rank 4"),
    ((2, 2, 5, 4), (3, 4), (2, 3, 5, 2), "G dividing H"),
    ((2, 1, 6, 4), (3, 4), (2, 3, 5, 2), "share B and N"),
    ((2, 1, 5, 4), (3, 5), (2, 3, 5, 2), r"w must be \[H, R\] = \[3, 4\]"),
])
def test_feature_sum_refuses_shapes_that_do_not_fit(phase, w, v, message):
    with pytest.raises(ValueError, match=message):
        feature_sum(torch.zeros(phase), torch.zeros(w), torch.zeros(v))
    with pytest.raises(TypeError, match="phase must have a floating-point dtype"):
        feature_sum(torch.zeros(2, 3, 5, 4, dtype=torch.long), torch.zeros(3, 4), torch.zeros(2, 3, 5, 2))
    with pytest.raises(TypeError, match="w must be a torch.Tensor"):
        feature_sum(torch.zeros(2, 3, 5, 4), [[1.0] * 4] * 3, torch.zeros(2, 3, 5, 2))


@pytest.mark.parametrize("content", CONTENT)
def test_shared_radii_are_one_feature_set_and_match_the_dense_sum(content):
    """shared=True: one row of radii for all heads, each head its own weights; forward and
    gradients match the pair-by-pair float64 sum, and the sinc path too."""
    block = make_block("radial", content=content, shared=True)
    assert block.kernel.theta.shape == (1, 8) and block.kernel.beta.shape == (HEADS, 8)
    phase, w = block.kernel.phase_features(torch.randn(2, 7, 3, dtype=torch.float64))
    assert phase.shape[1] == 1 and w.shape[0] == HEADS
    h, pos, pad = inputs()
    out = block(h, pos, pad)
    assert_same_gradients(out, block.reference(h, pos, pad), [h, pos, *block.parameters()])
    near = pos.detach() / 3
    f = block.pair_kernel(near, kernel="exact")
    assert float((f[:, 0] - f[:, 1]).abs().max()) > 1e-3  # the heads' kernels differ by their weights
    rho, w = (t.detach() for t in block.kernel.radii())
    assert float(rho.max() * (near[:, :, None] - near[:, None, :]).norm(dim=-1).max()) <= 1.0
    # the order-8 rule's documented error at rho |r| <= 1: 1e-5 per unit of sum |w|
    assert float((block.pair_kernel(near) - f).abs().max()) <= 1e-5 * float(w.abs().sum(-1).max())


@pytest.mark.parametrize("frequencies", list(FREQUENCIES))
def test_the_plain_sum_is_the_formula(frequencies):
    """Unnormalised, no content, no LayerNorm: ``h_i + W_o sum_j f(r_i - r_j) W_v h_j`` with f
    from the set's own mask, written out here."""
    block = make_block(frequencies, prenorm=False)
    h, pos, _ = inputs(B=1, N=5)
    f = block.kernel.mask(pos[0, :, None] - pos[0, None, :])  # [N, N, H]
    v = block.value(h[0]).view(5, HEADS, DIM // HEADS)
    msg = torch.einsum("ijh,jhd->ihd", f, v).reshape(5, DIM)
    assert_close(block(h, pos)[0], h[0] + block.out(msg))


def test_a_fresh_block_is_the_identity():
    block = LongRangeBlock(DIM, heads=HEADS, dtype=torch.float64)
    h, pos, pad = inputs()
    assert torch.equal(block(h, pos, pad), h)


@pytest.mark.parametrize("frequencies", list(FREQUENCIES))
def test_padding_neither_sends_nor_receives(frequencies):
    """Padded points (any features, NaN positions) change no real point's output and come back unchanged."""
    block = make_block(frequencies, content="elu", normalised=True)
    h, pos, _ = inputs(B=1, N=5)
    out = block(h, pos)
    h2 = torch.cat([h, torch.randn(1, 3, DIM, dtype=h.dtype)], dim=1)
    pos2 = torch.cat([pos, torch.full((1, 3, 3), float("nan"), dtype=pos.dtype)], dim=1)
    pad = torch.tensor([[False] * 5 + [True] * 3])
    out2 = block(h2, pos2, pad)
    assert_close(out2[:, :5], out)
    assert torch.equal(out2[:, 5:], h2[:, 5:])
    assert_close(block.reference(h2, pos2, pad)[:, :5], out)


@pytest.mark.parametrize("frequencies", list(FREQUENCIES))
def test_translation_invariance_and_permutation_equivariance(frequencies):
    block = make_block(frequencies, content="elu")
    h, pos, pad = inputs()
    out = block(h, pos, pad)
    assert_close(block(h, pos + torch.tensor([3.0, -7.5, 11.0], dtype=pos.dtype), pad), out)
    perm = torch.randperm(h.shape[1])
    assert_close(block(h[:, perm], pos[:, perm], pad[:, perm]), out[:, perm])


def test_radial_fast_path_is_rotation_invariant_to_the_quadrature_error_and_exact_path_exactly():
    """Order 8 at |r| rho <= 1: the fast path moves by at most twice the stated 1e-5 per
    unit of sum |w| (times |W_o W_v h| sums); the exact sinc path does not move."""
    block = make_block("radial", length_scale=2.0)
    h, pos, pad = inputs(B=1, N=6)
    with torch.no_grad():
        block.kernel.theta.clamp_(0.0, 1.0)
        pos = pos.detach() / pos.detach().norm(dim=-1).max() * 1.5  # |r_i - r_j| <= 3, rho <= 1/(4 pi)
    rot = random_rotation()
    rho_r = float(block.kernel.radii()[0].detach().abs().max()) * 3.0
    assert rho_r <= 1.0
    exact, exact_rot = block(h, pos, pad, exact=True), block(h, pos @ rot.T, pad, exact=True)
    assert_close(exact_rot, exact)
    with torch.no_grad():
        fast, fast_rot = block(h, pos, pad), block(h, pos @ rot.T, pad)
    assert float((fast_rot - fast).abs().max()) < 1e-3
    with torch.no_grad():
        f, f_rot, f_exact = block.pair_kernel(pos), block.pair_kernel(pos @ rot.T), block.pair_kernel(pos, kernel="exact")
    w = float(block.kernel.radii()[1].detach().abs().sum(-1).max())
    assert float((f - f_rot).abs().max()) <= 2 * 1e-5 * w
    assert float((f - f_exact).abs().max()) <= 1e-5 * w
    # At rho |r| <= 1.5 the rule is visibly not invariant, and within its stated 3e-3 bound.
    with torch.no_grad():
        far = pos * (1.5 / rho_r)  # the largest rho |r_i - r_j| becomes 1.5
        f, f_rot = block.pair_kernel(far), block.pair_kernel(far @ rot.T)
    assert 1e-9 < float((f - f_rot).abs().max()) <= 2 * 3e-3 * w


@pytest.mark.parametrize(("order", "reach", "bound"), [(8, 1.0, 1e-5), (8, 1.6, 3e-3), (12, 1.6, 1e-7), (12, 2.0, 1e-5)])
def test_sphere_quadrature_error_and_rotation_error_are_the_documented_bounds(order, reach, bound):
    """The average of cos(2 pi u.r) over the rule against sinc(2 |r|), and the rule at a
    rotated r against the rule at r, over 2,000 random directions and 0 < |r| <= reach."""
    u, q = sphere_quadrature(order)
    assert u.shape == (order * order, 3) and bool(torch.allclose(q.sum(), torch.tensor(1.0, dtype=q.dtype)))
    assert_close(u.norm(dim=-1), torch.ones(len(u), dtype=u.dtype))
    d = torch.randn(2000, 3, dtype=torch.float64)
    r = d / d.norm(dim=-1, keepdim=True) * torch.linspace(0.01, reach, 2000, dtype=torch.float64)[:, None]
    rule = (torch.cos(2 * math.pi * r @ u.T) * q).sum(-1)
    assert float((rule - torch.sinc(2 * r.norm(dim=-1))).abs().max()) <= bound
    rotated = (torch.cos(2 * math.pi * (r @ random_rotation().T) @ u.T) * q).sum(-1)
    assert float((rotated - rule).abs().max()) <= 2 * bound


def test_sphere_quadrature_integrates_even_harmonics_below_its_degree():
    """Exact (float64) for x^a y^b z^c of even total degree below 2 order, zero above it fails."""
    u, q = sphere_quadrature(6)
    x, y, z = u.unbind(-1)
    assert_close((q * z**10).sum(), torch.tensor(1 / 11, dtype=u.dtype))  # mean of z^n is 1/(n+1)
    assert_close((q * x**4 * y**2 * z**4).sum(), torch.tensor(3 * 1 * 3 / (11 * 9 * 7 * 5 * 3), dtype=u.dtype))
    assert abs(float((q * z**12).sum()) - 1 / 13) > 1e-8


def test_grid_frequencies_are_a_half_grid_within_the_cutoff_and_f_is_periodic():
    kern = build_frequencies("grid", 2, 3, frequency_cutoff=0.25, grid_spacing=0.0625, dtype=torch.float64)
    xi, w = kern.frequencies()
    m = torch.cartesian_prod(*[torch.arange(-4, 5)] * 3)
    inside = int(((m * m).sum(-1) <= 16).sum())  # integer vectors within radius 4: 257
    R = (inside + 1) // 2  # m = 0 and one of each pair +-m
    assert xi.shape == (2, R, 3) and w.shape == (2, R)
    assert float(xi.norm(dim=-1).max()) <= 0.25 + 1e-12
    both = torch.cat([xi[0], -xi[0]])
    assert len(torch.unique(both, dim=0)) == 2 * R - 1  # no frequency appears with its negative
    with torch.no_grad():
        kern.beta.normal_()
    delta = torch.randn(10, 3, dtype=torch.float64)
    assert_close(kern.mask(delta + torch.tensor([16.0, 0.0, -32.0], dtype=torch.float64)), kern.mask(delta))


def test_random_frequencies_are_the_discrete_start_frozen():
    options = {"num_frequencies": 16, "components": 4, "seed": 3}
    discrete = build_frequencies("discrete", 2, 3, dtype=torch.float64, **options)
    random = build_frequencies("random", 2, 3, dtype=torch.float64, **options)
    delta = torch.randn(5, 3, dtype=torch.float64)
    assert_close(random.mask(delta), discrete.mask(delta))
    assert [n for n, _ in random.named_parameters()] == ["beta"]
    assert "xi" in random.state_dict()


def test_float32_block_matches_its_float64_copy():
    block = make_block("discrete", content="favor+")
    h, pos, pad = inputs()
    ref = block(h, pos, pad)
    out = block.float()(h.float(), pos.float(), pad)
    assert out.dtype == torch.float32
    assert_close(out, ref, dtype=torch.float32, scale=10)


@pytest.mark.parametrize(("call", "message"), [
    (lambda b, h, p, m: b(h[0], p, m), r"h must have rank 3 \[B, N, d\]"),
    (lambda b, h, p, m: b(h, p[..., :2], m), r"pos must be \[B, N, P\] = \[2, 7, 3\]"),
    (lambda b, h, p, m: b(h[..., :4], p, m), r"h must be \[B, N, d\] with d = 8"),
    (lambda b, h, p, m: b(h, p.long(), m), r"pos must have a floating-point dtype"),
    (lambda b, h, p, m: b(h, p, m.float()), r"key_padding_mask must be a bool tensor \[B, N\]"),
    (lambda b, h, p, m: b(h, p, m[:, :3]), r"key_padding_mask must be a bool tensor \[B, N\]"),
    (lambda b, h, p, m: b(h, p.detach().index_fill(1, torch.tensor([0]), float("nan")), m), r"pos contains 6 non-finite"),
])
def test_bad_inputs_are_refused_naming_the_argument(call, message):
    block = make_block("discrete")
    h, pos, pad = inputs()
    with pytest.raises((ValueError, TypeError), match=message):
        call(block, h, pos, pad)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"frequencies": "fourier"}, "frequencies"),
    ({"frequencies": "radial", "pos_dim": 2}, "pos_dim must be 3"),
    ({"frequencies": "grid", "num_frequencies": 8}, "frequencies='grid' takes heads, .*frequency_cutoff"),
    ({"frequencies": "radial", "quadrature": 7}, "order must be even"),
    ({"content": "softmax"}, "content"),
    ({"normalised": 1}, "normalised must be a bool"),
    ({"frequencies": "grid", "grid_spacing": 0.0}, "grid_spacing must be a positive finite number"),
    ({"frequencies": "coulomb", "pos_dim": 2}, "pos_dim must be 3"),
    ({"frequencies": "coulomb", "alpha": -1.0}, "alpha must be a finite number > 0"),
    ({"frequencies": "coulomb", "reach": float("inf")}, "reach must be a finite number > 0"),
    ({"frequencies": "coulomb", "alpha": 5.0, "reach": 100.0}, "alpha \\* reach = 500 needs more than"),
    ({"frequencies": "coulomb", "num_radii": -1}, "num_radii must be a nonnegative int"),
    ({"frequencies": "coulomb", "tail_amplitude": float("nan")}, "tail_amplitude must be a finite number"),
    ({"frequencies": "radial", "width": -0.1}, "width must be a finite number >= 0"),
    ({"frequencies": "radial", "width": 0.05, "width_nodes": 4}, "width_nodes must be an odd number >= 3"),
    ({"frequencies": "coulomb", "width": float("nan")}, "width must be a finite number >= 0"),
])
def test_bad_options_are_refused_with_their_name(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LongRangeBlock(DIM, heads=HEADS, **kwargs)


@pytest.mark.parametrize(("options", "message"), [
    ({"frequencies": "grid", "num_frequencies": 8}, r"frequencies='grid' takes heads, .*frequency_cutoff.*got unknown num_frequencies"),
    ({"frequencies": "waves"}, "frequencies"),
    ({"content": "relu"}, "content"),
    ({"radius": 3}, "got unknown radius"),
])
def test_block_options_are_checked_before_anything_is_built(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        check_block_options(options)
    with pytest.raises((ValueError, TypeError), match=message):
        LongRangeBlock(DIM, heads=HEADS, **options)


def test_every_documented_option_passes_the_check():
    for name in FREQUENCIES:
        check_block_options({"frequencies": name, "heads": 2, "normalised": True, "content": "favor+", "exact": True})
    check_block_options({"frequencies": "radial", "num_radii": 4, "quadrature": 6, "length_scale": 2.0})
    check_block_options({"frequencies": "grid", "frequency_cutoff": 0.5, "grid_spacing": 0.05})


@pytest.mark.parametrize("pos_dim", [1, 2])
@pytest.mark.parametrize("frequencies", ["discrete", "grid", "random"])
def test_any_number_of_coordinates(frequencies, pos_dim):
    torch.manual_seed(1)
    options = {"frequency_cutoff": 0.5, "grid_spacing": 0.05} if frequencies == "grid" else {}
    block = LongRangeBlock(DIM, heads=HEADS, pos_dim=pos_dim, frequencies=frequencies, dtype=torch.float64, **options)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))
    h = torch.randn(2, 9, DIM, dtype=torch.float64, requires_grad=True)
    pos = (3 * torch.randn(2, 9, pos_dim, dtype=torch.float64)).requires_grad_()
    assert_same_gradients(block(h, pos), block.reference(h, pos), [h, pos])


def test_phases_stay_in_float32_under_bfloat16_autocast():
    """Far from the origin (|r| ~ 1e3) the bfloat16 matmuls of autocast round the values, not
    the phases: the output stays within bfloat16's tolerance of the float32 block's."""
    block = make_block("discrete", dtype=torch.float32)
    h = torch.randn(2, 7, DIM)
    pos = torch.randn(2, 7, 3) * 3 + 1000.0
    ref = block(h, pos)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(h, pos)
    assert_close(out.float(), ref, dtype=torch.bfloat16)
    a, c = block.kernel.features(pos)
    assert a.dtype == c.dtype == torch.float32


@pytest.mark.parametrize(("alpha", "reach"), [(0.15, 12.0), (0.15, 30.0), (0.25, 12.0), (0.5, 6.0), (0.1, 30.0)])
def test_coulomb_tail_quadrature_is_erf_over_r_within_its_reach(alpha, reach):
    """The tail's cosine sum against erf(alpha r) / r, over |r| <= reach in random
    directions, within the documented 5e-5 f(0); and it is no such thing far past reach."""
    xi, w = coulomb_tail_quadrature(alpha, reach)
    torch.manual_seed(0)
    r = torch.cat([torch.linspace(0, reach, 1500, dtype=torch.float64), reach * torch.rand(500, dtype=torch.float64)])
    d = torch.randn(len(r), 3, dtype=torch.float64)
    delta = d / d.norm(dim=-1, keepdim=True) * r[:, None]
    f0 = 2 * alpha / math.sqrt(math.pi)
    rule = (torch.cos(2 * math.pi * delta @ xi.T) * w).sum(-1)
    assert float((rule - coulomb_tail(r, alpha)).abs().max()) <= 5e-5 * f0
    rotated = (torch.cos(2 * math.pi * (delta @ random_rotation().T) @ xi.T) * w).sum(-1)
    assert float((rotated - rule).abs().max()) <= 1e-4 * f0
    far = delta * 4
    assert float(((torch.cos(2 * math.pi * far @ xi.T) * w).sum(-1) - coulomb_tail(4 * r, alpha)).abs().max()) > 1e-3 * f0


def test_coulomb_tail_is_erf_over_r_with_its_limit_and_gradient_at_zero():
    r = torch.tensor([0.0, 1e-5, 1e-3, 0.5, 3.0, 40.0], dtype=torch.float64, requires_grad=True)
    alpha = 0.3
    value = coulomb_tail(r, alpha)
    expected = torch.tensor([2 * alpha / math.sqrt(math.pi)] + [math.erf(alpha * x) / x for x in r.tolist()[1:]],
                            dtype=torch.float64)
    assert_close(value, expected)
    (grad,) = torch.autograd.grad(value.sum(), r)
    assert bool(torch.isfinite(grad).all()) and float(grad[0]) == 0.0
    # d/dr erf(a r)/r = 2 a exp(-a^2 r^2) / (sqrt(pi) r) - erf(a r) / r^2, away from 0
    x = r.detach()[3:]
    assert_close(grad[3:], 2 * alpha * torch.exp(-(alpha * x) ** 2) / (math.sqrt(math.pi) * x) - torch.erf(alpha * x) / x**2)
    assert float(value.detach()[-1] * 40.0) == pytest.approx(1.0, abs=1e-12)  # 1 / r far out


def test_gauss_legendre_integrates_polynomials_below_twice_its_nodes():
    x, w = gauss_legendre(5, 0.0, 2.0)
    assert_close((w * x**9).sum(), torch.tensor(2.0**10 / 10, dtype=torch.float64))
    assert abs(float((w * x**10).sum()) - 2.0**11 / 11) > 1e-6


def test_coulomb_block_sums_q_over_r_and_its_exact_path_is_the_formula():
    """With the corrections off, one head and the projections set by hand, the exact path is
    h_i + a sum_j erf(alpha r_ij) / r_ij h_j (j = i included, at its limit), and the fast
    path matches it to the quadrature's bound at offsets within reach."""
    block = LongRangeBlock(1, heads=1, frequencies="coulomb", alpha=0.2, reach=12.0, num_radii=0, tail_amplitude=0.7,
                           prenorm=False, dtype=torch.float64)
    with torch.no_grad():
        for lin in (block.value, block.out):
            lin.weight.fill_(1.0)
            lin.bias.zero_()
    torch.manual_seed(2)
    pos = torch.rand(1, 40, 3, dtype=torch.float64) * 6.9  # offsets up to 6.9 sqrt(3) < 12
    q = torch.randn(1, 40, 1, dtype=torch.float64)
    r = (pos[0, :, None] - pos[0, None]).norm(dim=-1)
    expected = q[0, :, 0] + 0.7 * (coulomb_tail(r, 0.2) @ q[0, :, 0])
    assert_close(block(q, pos, exact=True)[0, :, 0], expected)
    with torch.no_grad():
        fast = block(q, pos)[0, :, 0]
    assert float((fast - expected).abs().max()) <= 5e-5 * 0.7 * float(q.abs().sum()) * 2 * 0.2 / math.sqrt(math.pi)
    assert [n for n, p in block.named_parameters() if n.startswith("kernel.")] == ["kernel.tail"]


def test_tail_reach_is_the_smallest_rung_covering_the_offsets():
    assert tail_reach(0.0) == 4.0 and tail_reach(4.0) == 4.0
    assert tail_reach(4.01) == pytest.approx(4 * math.sqrt(2))
    assert tail_reach(30.0) == pytest.approx(32.0) and tail_reach(32.0) == pytest.approx(32.0)


@pytest.mark.parametrize("spread", [3.0, 40.0])
def test_coulomb_reach_per_call_follows_the_set_and_matches_the_formula(spread):
    """reach=None: one block, a small set and a set spread over ``spread`` units far from the
    origin; both match the exact formula (float64) to the tail's bound, gradients included."""
    block = make_block("coulomb", alpha=0.3, num_radii=2, quadrature=6, length_scale=8.0)
    torch.manual_seed(3)
    h = torch.randn(1, 9, DIM, dtype=torch.float64, requires_grad=True)
    pos = (spread * torch.rand(1, 9, 3, dtype=torch.float64) + 500.0).requires_grad_()
    out, exact = block(h, pos), block(h, pos, exact=True)
    scale = float(exact.detach().abs().max())
    assert float((out - exact).detach().abs().max()) <= 1e-3 * scale
    assert_same_gradients(out, block.reference(h, pos), [h, pos])
    used = max(reach for reach, _, _ in block.kernel._tails)
    assert used == tail_reach(float(2 * (pos - pos.mean(1, keepdim=True)).norm(dim=-1).max()))


@pytest.mark.parametrize("frequencies", ["discrete", "coulomb"])
def test_a_neutral_block_sums_only_how_values_differ(frequencies):
    """neutral=True: matches its O(N^2) reference (padding included, gradients too), and a
    constant added to every value (the value projection's bias) changes nothing; without
    neutral it does."""
    block = make_block(frequencies, neutral=True)
    h, pos, pad = inputs()
    out = block(h, pos, pad)
    assert_same_gradients(out, block.reference(h, pos, pad), [h, pos])
    with torch.no_grad():
        block.value.bias.add_(3.0)
        assert_close(block(h, pos, pad), out)
        block.neutral = False
        assert float((block(h, pos, pad) - out).abs().max()) > 1e-3


@pytest.mark.parametrize("frequencies", ["radial", "coulomb"])
def test_radial_quadrature_per_call_follows_the_sinc_on_a_large_set(frequencies):
    """quadrature=None: on points spread over 60 units (rho |r| up to about 10) the order-8
    rule is far from the sinc, the per-call rule matches it (float64), gradients included."""
    options = {"num_radii": 3, "length_scale": 1.0}
    if frequencies == "coulomb":
        options.update(alpha=0.5, reach=8.0, tail_amplitude=0.0)  # the corrections only
    torch.manual_seed(4)
    per_call = make_block(frequencies, quadrature=None, **options)
    fixed = make_block(frequencies, quadrature=8, **options)
    fixed.load_state_dict(per_call.state_dict())
    h = torch.randn(1, 12, DIM, dtype=torch.float64, requires_grad=True)
    pos = (60 * torch.rand(1, 12, 3, dtype=torch.float64)).requires_grad_()
    with torch.no_grad():
        if frequencies == "coulomb":
            per_call.kernel.tail.zero_()
            fixed.kernel.tail.zero_()
        exact = per_call(h, pos, exact=True)
        scale = float((exact - h).abs().max())
        assert float((fixed(h, pos) - exact).abs().max()) > 1e-2 * scale
    out = per_call(h, pos)
    assert float((out - exact).detach().abs().max()) <= 1e-5 * scale
    assert_same_gradients(out, per_call.reference(h, pos), [h, pos])


@pytest.mark.parametrize("shared", [False, True])
def test_the_per_call_rule_gives_each_radius_its_own_order(shared):
    """quadrature=None: each radius gets the order its own rho * reach asks for (the largest
    over the heads), not the largest radius's; the frequencies are each radius's rule, so
    the cosine sum equals the sincs to the rule's error at every offset within reach."""
    torch.manual_seed(5)
    kernel = RadialFrequencies(HEADS, 3, num_radii=4, quadrature=None, shared=shared, dtype=torch.float64)
    with torch.no_grad():
        kernel.theta.copy_(torch.tensor([0.02, 0.3, 0.6, 1.0], dtype=torch.float64).expand_as(kernel.theta))
        kernel.theta[..., 1] += torch.arange(kernel.theta.shape[0]) * 0.05  # heads differ when not shared
        kernel.beta.uniform_(0.5, 1.5)
    reach = 64.0
    rho = kernel.rho_max * kernel.theta.detach().amax(0)
    orders = kernel.orders_for(reach)
    assert orders == [max(8, 2 * math.ceil((math.pi * float(r) * reach + 4) / 2)) for r in rho]
    assert orders[0] == 8 and orders[0] < orders[1] < orders[2] < orders[3]
    xi, w = kernel.frequencies(reach=reach)
    assert xi.shape == (kernel.theta.shape[0], sum(o * o for o in orders), 3) and w.shape == (HEADS, xi.shape[1])
    # every frequency lies on one of its group's shells, with the radius's weight spread over its rule
    radii, weights = kernel.radii()
    norms = xi.norm(dim=-1)
    for k, order in enumerate(orders):
        on_shell = (norms - radii[:, k : k + 1]).abs() < 1e-12
        assert int(on_shell[0].sum()) == order * order
        assert_close(w[:, on_shell[0]].sum(-1), weights[:, k])
    delta = torch.randn(200, 3, dtype=torch.float64)
    delta = delta / delta.norm(dim=-1, keepdim=True) * torch.linspace(0, reach, 200, dtype=torch.float64)[:, None]
    def error(xi, w):
        fast = (torch.cos(2 * math.pi * torch.einsum("grp,np->ngr", xi, delta)) * w).sum(-1)
        return float((fast - kernel.exact_mask(delta)).abs().max()) / float(weights.abs().sum(-1).max())

    # each radius at the edge of its rule (pi rho reach + 4 = order) near |r| = reach: the
    # rule's error there is at most 6e-3 per unit weight (order 36), far less inside
    assert error(xi, w) < 1e-3
    assert error(*kernel.frequencies()) > 1e-2  # the constructor's order-8 rule cannot follow the sincs out there
    for bad in (float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match="reach"):
            kernel.frequencies(reach=bad)


@pytest.mark.parametrize(("frequencies", "shared"), [("radial", False), ("radial", True), ("coulomb", False)])
def test_profiled_shells_match_the_dense_sum_forward_and_backward(frequencies, shared):
    """width > 0: the fast path against the pair-by-pair float64 sum of the same cosines,
    gradients of h, pos and every parameter included, and the exact path against the
    written-out sum of sincs over every radius of the profiles."""
    options = {"width": 0.05, "width_nodes": 5, "quadrature": 6}
    if frequencies == "radial":
        options["shared"] = shared
    block = make_block(frequencies, **options)
    h, pos, pad = inputs()
    out = block(h, pos, pad)
    params = [p for p in block.parameters() if p.requires_grad]
    assert_same_gradients(out, block.reference(h, pos, pad), [h, pos, *params])
    radial = block.kernel if frequencies == "radial" else block.kernel.corrections
    rho, w = radial.radii()
    z, weights = radial_profile(0.05, 5)
    delta = torch.randn(4, 3, 3, dtype=torch.float64) * 3
    r = delta.norm(dim=-1)[..., None, None, None]
    nodes = rho[:, :, None] + 0.05 * z  # [G, K, M]
    written = (torch.sinc(2 * nodes * r) * weights * w[:, :, None]).sum((-1, -2))  # [..., H]
    got = radial.exact_mask(delta)
    assert_close(got, written)


def test_radial_profile_is_a_normalised_symmetric_gaussian_and_thin_shells_without_width():
    z, h = radial_profile(0.03, 9)
    assert_close(h.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.equal(z, -z.flip(0)) and torch.equal(h, h.flip(0))
    assert float(z[0]) == -3.0 and float(z[-1]) == 3.0
    assert_close(h / h[4], torch.exp(-z * z / 2))
    z0, h0 = radial_profile(0.0, 9)
    assert z0.tolist() == [0.0] and h0.tolist() == [1.0]
    thin = make_block("radial")
    zero = make_block("radial", width=0.0, width_nodes=9)
    delta = torch.randn(5, 3, dtype=torch.float64) * 4
    assert torch.equal(zero.kernel.exact_mask(delta), thin.kernel.exact_mask(delta))
    assert thin.kernel.frequencies()[0].shape == zero.kernel.frequencies()[0].shape


def test_profiled_shells_fall_off_like_the_gaussian_and_stay_small_until_the_profile_aliases():
    """For radii well above the width, each profiled shell is its thin sinc times
    exp(-2 pi^2 width^2 r^2) (to 5% of the thin sinc's size: the profile spans 6% of the
    radius, over which the sinc's 1 / rho changes), and past 1.5 / (pi width), where that
    Gaussian is e^-4.5, it stays below 2% of the thin shell's envelope up to half the
    profile's period 1 / (width dz), where the thin sinc is still at full size."""
    width, nodes = 0.03, 9
    kernel = build_frequencies("radial", 1, 3, num_radii=1, width=width, width_nodes=nodes, dtype=torch.float64)
    thin = build_frequencies("radial", 1, 3, num_radii=1, dtype=torch.float64)
    with torch.no_grad():
        for k in (kernel, thin):
            k.theta.fill_(0.5 / k.rho_max)  # rho = 0.5 cycles per unit, 17 widths
    period = 1 / (width * 6 / (nodes - 1))
    r = torch.linspace(0.5, period / 2, 400, dtype=torch.float64)
    delta = torch.stack([r, torch.zeros_like(r), torch.zeros_like(r)], dim=-1)
    with torch.no_grad():
        profiled, sinc = kernel.exact_mask(delta)[:, 0], thin.exact_mask(delta)[:, 0]
    envelope = 1 / (2 * math.pi * 0.5 * r)  # the thin sinc's size at r
    damped = sinc * torch.exp(-2 * math.pi ** 2 * width ** 2 * r ** 2)
    assert float(((profiled - damped).abs() / envelope).max()) < 0.05
    far = r > 1.5 / (math.pi * width)
    assert far.sum() > 50
    assert float((profiled[far].abs() / envelope[far]).max()) < 0.02
    assert float((sinc[far].abs() / envelope[far]).max()) > 0.9


@pytest.mark.parametrize("frequencies, options", [
    ("radial", {"quadrature": None, "num_radii": 4}), ("radial", {"quadrature": None, "num_radii": 4, "shared": True}),
    ("coulomb", {"num_radii": 2}), ("discrete", {"num_frequencies": 16}),
    ("radial", {"content": "elu", "normalised": True, "shared": True}), ("discrete", {"content": "favor+", "normalised": True}),
])
def test_evaluation_takes_the_batch_in_parts_that_fit_and_gets_the_same_result(frequencies, options, monkeypatch):
    """Without gradients the fast path splits the batch when its phases would pass half the
    memory limit; the parts share the call's frequencies (a rule chosen from the whole
    batch's extent), so the output is the one-pass output."""
    import flt.layers.longrange as longrange

    block = make_block(frequencies, **options)
    h, pos, pad = inputs(B=5, N=9)
    h, pos = h.detach(), pos.detach() * torch.tensor([1.0, 1.0, 1.0, 1.0, 6.0], dtype=torch.float64)[:, None, None]
    with torch.no_grad():
        whole = block(h, pos, pad)
        xi, _ = block.kernel.call_frequencies(block._inputs(h, pos, pad)[0])
        per_set = block.set_bytes(9, xi.shape[0], xi.shape[1], torch.float64, DIM // HEADS)
        calls = []
        monkeypatch.setattr(longrange, "feature_sum", lambda *a, **k: calls.append(a[2].shape[0]) or feature_sum(*a, **k))
        monkeypatch.setenv("FLT_MEMORY_LIMIT", str(4 * per_set + 1))
        parts = block(h, pos, pad)
    assert calls == [2, 2, 1]
    assert_close(parts, whole)
    with torch.no_grad(), pytest.raises(MemoryLimitError, match=r"long-range block's phases .* 9 points per set, 1 set"):
        monkeypatch.setenv("FLT_MEMORY_LIMIT", str(per_set // 2))
        block(h, pos, pad)


def test_training_refuses_phases_that_do_not_fit_before_allocating_them(monkeypatch):
    block = make_block("radial", quadrature=8, num_radii=4)
    h, pos, pad = inputs(B=3, N=9)
    per_set = block.set_bytes(9, HEADS, 4 * 64, torch.float64, DIM // HEADS)
    monkeypatch.setenv("FLT_MEMORY_LIMIT", str(2 * per_set))
    with pytest.raises(MemoryLimitError, match=r"256 frequencies .* 3 set\(s\), kept for the backward pass.*num_radii"):
        block(h, pos, pad)
    with torch.no_grad():
        block(h, pos, pad)  # evaluation fits, in parts
    for p in block.parameters():
        p.requires_grad_(False)
    block(h.detach(), pos.detach(), pad)  # nothing to differentiate: taken in parts like evaluation
    monkeypatch.setenv("FLT_MEMORY_LIMIT", str(3 * per_set))
    for p in block.parameters():
        p.requires_grad_(True)
    block(h, pos, pad).sum().backward()


@pytest.mark.parametrize("B, N", [(0, 5), (2, 0)])
def test_empty_batches_and_empty_sets_pass_through(B, N):
    block = make_block("radial", quadrature=None)
    h = torch.randn(B, N, DIM, dtype=torch.float64)
    out = block(h, torch.randn(B, N, 3, dtype=torch.float64))
    assert out.shape == (B, N, DIM)
