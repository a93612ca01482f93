"""The ``offsets`` task: deterministic generation, targets against a brute-force float64
formula, the target as one attention layer with the true relative term, the splits and
options, and a smoke run that reports test metrics and evaluates at another length."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from flt.data.offsets import generate_offsets, offset_logits, offset_targets
from flt.layers.flt import FLTAttention
from flt.layers.softmax import SoftmaxAttention
from flt.relative.spectra import GaussianMixtureSpectrum
from flt.relative.spectra.base import inverse_positive
from flt.tasks import get_preset, load_task
from flt.tasks.base import Task
from flt.tasks.offsets import OffsetsTask

TINY = {"num_train": 3, "num_valid": 2, "num_test": 2, "length": 40, "vocab_size": 5, "value_dim": 2,
        "centers": [6.0, 15.0], "width": 2.0, "amplitude": 4.0}


def brute_force_targets(tokens, values, centers, width, amplitude):
    """``y_i = sum_{j<=i} e^{f(i-j)} v(x_j) / sum_{j<=i} e^{f(i-j)}``, loop by loop in float64."""
    S, N = tokens.shape
    out = torch.zeros(S, N, values.shape[1], dtype=torch.float64)
    for s in range(S):
        for i in range(N):
            num, den = torch.zeros(values.shape[1], dtype=torch.float64), 0.0
            for j in range(i + 1):
                f = sum(amplitude * math.exp(-((i - j - c) ** 2) / (2 * width**2)) for c in centers)
                num += math.exp(f) * values[tokens[s, j]]
                den += math.exp(f)
            out[s, i] = num / den
    return out


def true_spectrum(centers, width, amplitude, shift_scale=64.0) -> GaussianMixtureSpectrum:
    """One head whose mask is the task's ``f``: a component of height ``amplitude`` per
    centre, no oscillation (``mu = 0``), length ``width``, shifted to the centre."""
    C = len(centers)
    spec = GaussianMixtureSpectrum(1, 1, 2 * C, components=C, amplitude=amplitude * C, shift=True,
                                   shift_scale=shift_scale, dtype=torch.float64)
    with torch.no_grad():
        spec.log_scale.copy_(inverse_positive(1 / (2 * math.pi * width), shape=spec.log_scale.shape, dtype=torch.float64))
        spec.shift.copy_(torch.tensor(centers, dtype=torch.float64).view(1, C, 1) / shift_scale)
    return spec


def test_generation_is_deterministic_and_splits_differ():
    a, b = generate_offsets(**TINY, seed=3), generate_offsets(**TINY, seed=3)
    for name in ("train", "valid", "test"):
        assert torch.equal(getattr(a, name).tokens, getattr(b, name).tokens)
        assert torch.equal(getattr(a, name).targets, getattr(b, name).targets)
    assert not torch.equal(a.valid.tokens, a.test.tokens)
    assert not torch.equal(a.values, generate_offsets(**TINY, seed=4).values)


def test_targets_equal_brute_force_float64():
    data = generate_offsets(**TINY, seed=1)
    tokens = torch.cat([data.train.tokens, data.test.tokens])
    logits = offset_logits(torch.arange(40), TINY["centers"], TINY["width"], TINY["amplitude"])
    got = offset_targets(tokens, data.values, logits, chunk=2)  # several chunks
    want = brute_force_targets(tokens, data.values, TINY["centers"], TINY["width"], TINY["amplitude"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(data.test.targets, want[3:].float())


def test_eval_length_lengthens_valid_and_test_only():
    data = generate_offsets(**{**TINY, "eval_length": 64}, seed=1)
    assert data.train.tokens.shape == (3, 40) and data.valid.tokens.shape == (2, 64) == data.test.tokens.shape


def test_true_spectrum_is_the_task_logit():
    spec = true_spectrum(TINY["centers"], TINY["width"], TINY["amplitude"])
    d = torch.arange(0, 60, dtype=torch.float64).unsqueeze(-1)
    want = offset_logits(d[:, 0], TINY["centers"], TINY["width"], TINY["amplitude"])
    torch.testing.assert_close(spec.mask(d)[:, 0], want, rtol=1e-12, atol=1e-12)


def _identity_attention(layer, dim: int) -> None:
    """q = k = 0 (no content term), v and the output projection the identity."""
    with torch.no_grad():
        layer.to_qkv.weight.zero_()
        layer.to_qkv.weight[2 * dim :].copy_(torch.eye(dim, dtype=layer.to_qkv.weight.dtype))
        layer.to_out.weight.copy_(torch.eye(dim, dtype=layer.to_out.weight.dtype))
        layer.to_out.bias.zero_()


@pytest.mark.parametrize("mechanism", ["softmax", "flt-exact"])
def test_one_layer_with_the_true_term_computes_the_target(mechanism):
    """The reference of the comparison (softmax with FLT's relative term) and FLT's exact
    form, given the true ``f`` and no content term, give the target to float64 precision:
    the task is exactly one attention layer with a relative mask."""
    data = generate_offsets(**TINY, seed=2)
    k = TINY["value_dim"]
    spec = true_spectrum(TINY["centers"], TINY["width"], TINY["amplitude"])
    if mechanism == "softmax":
        layer = SoftmaxAttention.from_options(k, 1, causal=True, relative_bias=spec, backend="reference", dtype=torch.float64)
        run = layer
    else:
        layer = FLTAttention.from_options(k, 1, causal=True, spectrum="gaussian_mixture", components=2, num_frequencies=4,
                             shift=True, shift_scale=64.0, qk_norm=False, dtype=torch.float64)
        layer.spectrum.load_state_dict(spec.state_dict())
        run = layer.exact
    _identity_attention(layer, k)
    x = data.values[data.train.tokens]
    torch.testing.assert_close(run(x).double(), data.train.targets.double(), rtol=1e-5, atol=1e-6)


def test_toeplitz_spectrum_term_equals_pairwise():
    """Softmax's spectrum term on token indices (gathered from the 2N - 1 offsets) is the
    pairwise term, values and gradients."""
    layer = SoftmaxAttention.from_options(8, 2, causal=True, relative_bias="spectrum", spectrum="gaussian_mixture", shift=True,
                             amplitude=1.0, mean_scale=0.1, dtype=torch.float64)
    pos = (torch.arange(37, dtype=torch.float64) + 5).view(1, -1, 1)
    fast = layer.core.positional_term(pos, torch.float64)
    slow = layer.relative.pairwise(pos, pos)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-13)
    g = torch.randn_like(slow)
    grads = [torch.autograd.grad((t * g).sum(), list(layer.relative.parameters())) for t in
             (layer.core.positional_term(pos, torch.float64), layer.relative.pairwise(pos, pos))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options, match", [
    ({"centers": []}, "centers must be a non-empty list"),
    ({"centers": [10, -3]}, r"centers\[\] must be a positive"),
    ({"width": 0}, "width must be a positive"),
    ({"length": 100}, r"score_from \(328"),
    ({"score_from": 50, "eval_length": 40}, r"score_from \(50"),
    ({"eval_length": 0}, "eval_length"),
    ({"seed": -1}, "seed must be"),
])
def test_data_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        load_task("offsets", {"num_train": 2, "num_valid": 1, "num_test": 1, **options})


def test_unknown_data_option_is_refused():
    with pytest.raises(ValueError, match="unknown data options for 'offsets'"):
        load_task("offsets", {"lenght": 10})


def test_tasks_without_a_test_split_say_so():
    from flt.tasks.base import has_test_split

    class Bare(Task):
        name = "bare"

    assert not has_test_split(Bare.__new__(Bare))
    assert has_test_split(OffsetsTask.__new__(OffsetsTask))
    with pytest.raises(NotImplementedError, match="no test split"):
        Bare.__new__(Bare).test_batches(4, None, 0, 1)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    from flt.train import train

    out = str(tmp_path_factory.mktemp("offsets") / "run")
    torch.manual_seed(0)
    summary = train(get_preset("offsets", "smoke"), out, progress=False, plots=False)
    return out, summary


def test_smoke_preset_reports_valid_and_test(smoke_run):
    out, summary = smoke_run
    with open(os.path.join(out, "summary.json")) as f:
        saved = json.load(f)
    for split in ("final", "test"):
        assert set(saved[split]) == {"loss", "rel_mse"}
        assert 0 < saved[split]["rel_mse"] < 2
    assert saved["test"] != saved["final"]  # another split, not the validation numbers again
    assert saved["test"] == summary["test"]


def test_eval_length_through_flt_evaluate(smoke_run):
    from flt.commands.evaluate import evaluate_run

    out, summary = smoke_run
    same = evaluate_run(out, draws=0, exact=False, max_batches=None)
    assert same["own"] == pytest.approx(summary["final"]["rel_mse"], rel=1e-6)
    longer = evaluate_run(out, draws=0, exact=False, data_options={"eval_length": 320})
    assert longer["data"] == {"eval_length": 320} and math.isfinite(longer["own"]) and longer["own"] != same["own"]
    test = evaluate_run(out, draws=0, exact=False, split="test", max_batches=None)
    assert test["own"] == pytest.approx(summary["test"]["rel_mse"], rel=1e-6)


def _softmax_layers(spec: str, *flags: str) -> list[SoftmaxAttention]:
    """The softmax layers of the ``small`` model that ``flt train offsets --attention spec``
    builds."""
    from flt.cli import build_parser
    from flt.commands.train import preset_from_args
    from flt.options import parse_attention

    args = build_parser().parse_args(["train", "offsets", "--preset", "small", "--attention", spec, *flags])
    model = OffsetsTask.build_model(preset_from_args(args, *parse_attention(args.attention)).model)
    return [m for m in model.modules() if isinstance(m, SoftmaxAttention)]


def test_softmax_with_another_relative_term_drops_the_spectrum_defaults():
    from flt.relative.tables import T5Bias
    from flt.search.mixed import parse_candidates

    (default,) = _softmax_layers("softmax")
    assert default.core.relative_bias == "spectrum" and default.spectrum.shift is not None  # row 7: the task's spectrum
    (t5,) = _softmax_layers("softmax:relative_bias=t5")
    assert isinstance(t5.relative, T5Bias) and t5.spectrum is None
    (rope,) = _softmax_layers("softmax:relative_bias=none:rope=true")
    assert rope.relative is None and rope.core.rope
    (by_flag,) = _softmax_layers("softmax", "--attn-opt", "relative_bias=alibi")
    assert by_flag.core.relative_bias == "alibi"
    with pytest.raises(ValueError, match="spectrum options need relative_bias='spectrum'"):
        _softmax_layers("softmax:relative_bias=t5:components=2")  # chosen, not inherited: still refused
    candidates = {c.label: c.options for c in parse_candidates("softmax,softmax:relative_bias=t5", OffsetsTask)}
    assert candidates["softmax:relative_bias=t5"] == {"relative_bias": "t5"}
    assert candidates["softmax"]["components"] == 4
