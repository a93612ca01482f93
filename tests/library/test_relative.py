"""The relative-position family: every registered term honours the interface, and every
attention layer takes its term by name or as a module."""

from __future__ import annotations

import importlib
import re
import warnings

import pytest
import torch

from conftest import assert_close
from flt.layers import FLTAttention, SoftmaxAttention, ToeplitzAttention
from flt.layers.upgrade import upgrade_state_dict
from flt.relative import RELATIVE, RelativeTerm, build_relative
from flt.relative.spectra import SPECTRA

F64 = torch.float64
ONE_D = {"t5", "clipped"}  # tables over integer offsets


def _build(name, pos_dim, **kw):
    options = {"num_frequencies": 8} if name in SPECTRA else {}
    if name in SPECTRA:
        options["amplitude"] = 1.5
    term = build_relative(name, heads=3, pos_dim=pos_dim, dtype=F64, **options, **kw)
    with torch.no_grad():  # move every parameter off its neutral start so the checks see a real term
        for p in term.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return term


def _positions(name, pos_dim, n, batch=2):
    if name in ONE_D:
        return torch.randint(-20, 20, (batch, n, 1)).to(F64)
    return torch.randn(batch, n, pos_dim, dtype=F64)


@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_every_term_gives_its_bias_from_its_offsets(name):
    torch.manual_seed(0)
    P = 1 if name in ONE_D else 2
    term = _build(name, P)
    assert isinstance(term, RelativeTerm)
    pq, pk = _positions(name, P, 5), _positions(name, P, 7)
    bias = term.bias(pq, pk)
    assert bias.shape == (2, 3, 5, 7)
    assert bias.dtype == F64
    delta = pq.unsqueeze(2) - pk.unsqueeze(1)  # [B, N, Nk, P], query - key
    assert_close(bias, term.of_offsets(delta).permute(0, 3, 1, 2))
    shift = torch.full((1, 1, P), 3.0, dtype=F64)  # relative: a common shift changes nothing
    assert_close(term.bias(pq + shift, pk + shift), bias)
    assert float(bias.detach().abs().max()) > 0  # a real term, not zeros


@pytest.mark.parametrize("name", sorted(n for n in RELATIVE if RELATIVE[n].linear))
def test_linear_terms_factorise_into_their_estimate(name):
    torch.manual_seed(1)
    term = _build(name, 2)
    pos = torch.randn(1, 6, 2, dtype=F64)
    a, c = term.features(pos)
    approx = a @ c.transpose(-1, -2)  # [1, H, N, N]
    delta = pos.unsqueeze(2) - pos.unsqueeze(1)
    assert_close(approx, term.estimate(delta).permute(0, 3, 1, 2))


@pytest.mark.parametrize("name", sorted(n for n in RELATIVE if not RELATIVE[n].linear))
def test_terms_without_features_say_so(name):
    term = _build(name, 1)
    with pytest.raises(NotImplementedError, match="no linear-time features"):
        term.features(torch.zeros(1, 3, 1, dtype=F64))


@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_softmax_layer_adds_the_term_it_is_given_as_a_module(name):
    torch.manual_seed(2)
    P = 1 if name in ONE_D else 2
    term = _build(name, P)
    layer = SoftmaxAttention.from_options(12, 3, pos_dim=P, relative_bias=term, backend="reference").double()
    x, pos = torch.randn(2, 5, 12, dtype=F64), _positions(name, P, 5)
    q, k, v = layer.to_qkv(x).view(2, 5, 3, 3, 4).permute(2, 0, 3, 1, 4)
    logits = q @ k.transpose(-1, -2) / 2.0 + term.bias(pos)
    expected = torch.softmax(logits, -1) @ v
    assert_close(layer(x, pos), layer.to_out(expected.transpose(1, 2).reshape(2, 5, 12)))
    assert layer.relative is term


def test_a_term_registered_beyond_the_built_ins_reaches_softmax_by_name_with_its_options(monkeypatch):
    class Dipole(RelativeTerm):
        """A toy term: ``strength_h * (delta_0)``."""

        def __init__(self, heads, *, pos_dim=1, strength=1.0, device=None, dtype=None):
            super().__init__()
            self.strength = torch.nn.Parameter(torch.full((heads,), strength, dtype=dtype))

        def of_offsets(self, delta):
            return delta[..., :1] * self.strength

    monkeypatch.setitem(RELATIVE, "dipole", Dipole)
    layer = SoftmaxAttention.from_options(8, 2, relative_bias="dipole", relative_options={"strength": 0.5}).double()
    pos = torch.arange(4, dtype=F64).view(1, 4, 1)
    assert_close(layer.core.positional_term(pos, F64)[0, 1], 0.5 * (pos[0] - pos[0].T))
    with pytest.raises(ValueError, match="relative_bias must be one of"):
        SoftmaxAttention.from_options(8, 2, relative_bias="dipol")


def test_relative_options_are_refused_for_the_built_in_terms():
    with pytest.raises(ValueError, match="relative_options"):
        SoftmaxAttention.from_options(8, 2, relative_bias="t5", relative_options={"max_distance": 4})


def test_softmax_state_dicts_from_before_the_registry_load(tmp_path):
    torch.manual_seed(3)
    lay = SoftmaxAttention.from_options(8, 2, relative_bias="t5").double()
    with torch.no_grad():
        lay.relative.table.normal_()
    old = {k.replace("relative.", "table."): v for k, v in lay.state_dict().items()}
    fresh = SoftmaxAttention.from_options(8, 2, relative_bias="t5").double()
    fresh.load_state_dict(old)
    x = torch.randn(1, 6, 8, dtype=F64)
    assert_close(fresh(x), lay(x))
    alibi = SoftmaxAttention.from_options(8, 2, relative_bias="alibi", alibi_learnable=True).double()
    fresh = SoftmaxAttention.from_options(8, 2, relative_bias="alibi", alibi_learnable=True).double()
    with torch.no_grad():
        alibi.relative.log_slopes.add_(0.3)
    old = {"log_slopes" if k == "core.relative.log_slopes" else k: v for k, v in alibi.state_dict().items()}
    fresh.load_state_dict(upgrade_state_dict(fresh, old))
    assert_close(fresh(x), alibi(x))


def test_flt_takes_a_spectrum_module_and_its_exact_path_uses_the_terms_bias():
    torch.manual_seed(4)
    lay = FLTAttention.from_options(8, 2, num_features=16, num_frequencies=4, spectrum="gaussian", amplitude=1.0).double()
    x, pos = torch.randn(1, 5, 8, dtype=F64), torch.randn(1, 5, 1, dtype=F64)
    p = lay.prepare(x, pos, None)
    xq, xk = lay.core.scaled_qk(p.q, p.k, p.pos)
    w = torch.softmax(xq @ xk.transpose(-1, -2) + lay.spectrum.bias(pos), -1) @ p.v
    assert_close(lay.exact(x, pos), lay.finish(w, x))


def test_gaussian_bias_on_many_dimensional_positions_uses_the_matmul_form_exactly():
    torch.manual_seed(5)
    term = build_relative("gaussian", heads=2, pos_dim=16, num_frequencies=4, amplitude=2.0, length_scale=1.5, dtype=F64)
    pos = torch.randn(2, 9, 16, dtype=F64)
    direct = term.of_offsets(pos.unsqueeze(2) - pos.unsqueeze(1)).permute(0, 3, 1, 2)
    assert_close(term.bias(pos), direct)


def test_gaussian_mixture_bias_by_component_equals_its_mask_with_means_and_shifts():
    torch.manual_seed(6)
    for shift in (False, True):
        term = build_relative("gaussian_mixture", heads=2, pos_dim=3, num_frequencies=8, components=4, mean_scale=0.4,
                              length_scale=0.7, shift=shift, dtype=F64)
        pq, pk = torch.randn(2, 6, 3, dtype=F64) * 3, torch.randn(2, 5, 3, dtype=F64) * 3
        direct = term.of_offsets(pq.unsqueeze(2) - pk.unsqueeze(1)).permute(0, 3, 1, 2)
        assert_close(term.bias(pq, pk), direct)


@pytest.mark.parametrize("causal", [False, True])
def test_toeplitz_exact_is_softmax_with_the_same_clipped_table(causal):
    torch.manual_seed(6)
    kw = {"max_distance": 3, "causal": causal}
    toe = ToeplitzAttention.from_options(8, 2, qk_norm=False, num_features=8, **kw).double()
    soft = SoftmaxAttention.from_options(8, 2, relative_bias="clipped", backend="reference", **kw).double()
    with torch.no_grad():
        toe.table.table.normal_()
    soft.load_state_dict({k.replace("table.", "relative."): v for k, v in toe.state_dict().items() if not k.startswith(("core.feature_map", "core.scaling"))})
    x = torch.randn(2, 7, 8, dtype=F64)
    assert_close(toe.exact(x), soft(x))


def test_term_rejects_positions_of_the_wrong_dimension_by_name():
    term = build_relative("gaussian", heads=2, pos_dim=3, num_frequencies=4)
    with pytest.raises(ValueError, match="P = 3, got P = 2"):
        term.bias(torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="pos_q contains 1 non-finite"):
        term.bias(torch.tensor([[[0.0, 0.0, float("nan")]]]))


def test_every_registered_term_lives_in_the_relative_package():
    for name, cls in RELATIVE.items():
        assert cls.__module__.startswith("flt.relative."), (name, cls.__module__)


def test_the_old_import_paths_are_aliases_of_the_relative_package():
    import flt.posenc
    import flt.relative.alibi
    import flt.relative.spectra
    import flt.relative.tables

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import flt.posenc.bias
        import flt.spectra

    assert flt.spectra.SPECTRA is SPECTRA
    assert flt.spectra.__all__ == flt.relative.spectra.__all__
    assert all(getattr(flt.spectra, name) is getattr(flt.relative.spectra, name) for name in flt.spectra.__all__)
    assert flt.posenc.bias.alibi_bias is flt.relative.alibi.alibi_bias
    assert flt.posenc.bias.RelativeBiasTable is flt.relative.tables.RelativeBiasTable
    assert flt.posenc.alibi_slopes is flt.relative.alibi.alibi_slopes


@pytest.mark.parametrize(("alias", "new"), [("flt.spectra", "flt.relative.spectra"), ("flt.posenc.bias", "flt.relative")])
def test_importing_an_old_path_warns_that_it_goes_and_names_the_new_one(alias: str, new: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(alias)  # imported once already, it would not warn again
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(alias)} is deprecated and is removed in 0\.3\.0; import {re.escape(new)}"):
        importlib.reload(module)


@pytest.mark.parametrize("module", ["flt.relative.tables", "flt.relative.alibi", "flt.relative.spectra", "flt.relative.shortest_path"])
def test_each_relative_module_imports_first_in_a_fresh_interpreter(module):
    # The package had an import loop (posenc.bias -> relative -> registry -> posenc.bias);
    # each module must now import on its own, whichever comes first.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", f"import {module}; from flt.relative import RELATIVE; print(len(RELATIVE))"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(RELATIVE)
