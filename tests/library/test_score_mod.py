"""Every relative term as a FlexAttention ``score_mod`` (:meth:`flt.relative.RelativeTerm.score_mod`)
equals its dense bias: evaluated on index grids (what FlexAttention does, by ``torch.vmap``),
through eager FlexAttention on CPU (forward only in torch 2.13), and in
``SoftmaxAttention(backend="flex")``, which no longer forms an ``[N, N]`` bias."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close
from flt.layers import SoftmaxAttention
from flt.ops.softmax import flex_attention_available
from flt.relative import RELATIVE, RelativeTerm, build_relative
from flt.relative.spectra import SPECTRA

F64 = torch.float64
ONE_D = {"t5", "clipped"}  # tables over integer offsets
H = 3
#: Terms with a per-score form (head_value) for positions that are not token indices.
POINTWISE = sorted(n for n in RELATIVE if RELATIVE[n].head_value is not RelativeTerm.head_value)


def _term(name, pos_dim, dtype=F64):
    options = {"num_frequencies": 8, "amplitude": 1.5} if name in SPECTRA else {}
    if name in ("gaussian_mixture", "local"):
        options["shift"] = True
    term = build_relative(name, heads=H, pos_dim=pos_dim, dtype=dtype, **options)
    with torch.no_grad():  # off the neutral start, so the term is not zero
        for p in term.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return term


def _cases(name):
    """(label, pos_q, pos_k): integer token indices (the offset table) and, for the terms with
    a per-score form, real-valued 2-D positions with a shift per component where the family
    has one."""
    cases = [
        ("tokens", torch.arange(9, dtype=F64).view(1, 9, 1) + 4, None),
        ("integer batch", torch.randint(-40, 40, (2, 9, 1)).to(F64), torch.randint(-40, 40, (2, 6, 1)).to(F64)),
    ]
    if name in POINTWISE:
        cases.append(("points", torch.randn(2, 9, 2, dtype=F64), torch.randn(1, 6, 2, dtype=F64)))
    return cases


def _on_grid(mod, B, N, Nk):
    """``mod(0, b, h, i, j)`` on the full index grid, by nested vmaps as FlexAttention does."""
    b, h, i, j = (torch.arange(n) for n in (B, H, N, Nk))
    fn = mod
    for dim in range(4):  # vmap over j, then i, h, b
        in_dims = [None] * 5
        in_dims[4 - dim] = 0
        fn = torch.vmap(fn, in_dims=tuple(in_dims))
    return fn(torch.zeros((), dtype=F64), b, h, i, j)


def _all_cases():
    return [(name, label) for name in sorted(RELATIVE) for label, *_ in _cases(name)]


@pytest.mark.parametrize("name,label", _all_cases())
def test_score_mod_is_the_bias_on_index_grids(name, label):
    torch.manual_seed(0)
    pq, pk = next((q, k) for lab, q, k in _cases(name) if lab == label)
    term = _term(name, pq.shape[-1])
    bias = term.bias(pq, pk)  # [B|1, H, N, Nk]
    nk = pq.shape[1] if pk is None else pk.shape[1]
    B = max(pq.shape[0], 1 if pk is None else pk.shape[0])
    grid = _on_grid(term.score_mod(pq, pk), B, pq.shape[1], nk)
    assert float(bias.detach().abs().max()) > 0
    assert_close(grid, bias.expand(B, H, pq.shape[1], nk))


@pytest.mark.parametrize("name", sorted(n for n in RELATIVE if n not in POINTWISE and n not in ONE_D))
def test_terms_without_a_per_score_form_refuse_real_positions(name):
    term = _term(name, 2)
    with pytest.raises(NotImplementedError, match="integer 1-D positions"):
        term.score_mod(torch.randn(5, 2, dtype=F64))


def test_score_mod_refuses_terms_without_an_offset_form():
    from flt.relative.base import RelativeTerm

    class Pairwise(RelativeTerm):
        def pairwise(self, pos_q, pos_k):
            return pos_q.sum(-1, keepdim=True).unsqueeze(1) * pos_k.sum(-1).unsqueeze(1).unsqueeze(1)

    with pytest.raises(NotImplementedError, match="integer 1-D positions"):
        Pairwise().score_mod(torch.randn(4, 2))


flex_forward = pytest.mark.skipif(not flex_attention_available("cpu", False)[0], reason="FlexAttention forward does not run on CPU here")


@flex_forward
@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_flex_attention_with_score_mod_matches_dense_bias(name):
    torch.manual_seed(1)
    label, pq, pk = _cases(name)[-1]  # real-valued points where the term has them, else integers
    term = _term(name, pq.shape[-1], dtype=torch.float32)
    pq, pk = pq.float(), pk.float()
    B, N, Nk, D = 2, pq.shape[1], pk.shape[1], 8
    q, k, v = torch.randn(B, H, N, D), torch.randn(B, H, Nk, D), torch.randn(B, H, Nk, D)
    from torch.nn.attention.flex_attention import flex_attention

    with torch.no_grad():
        out = flex_attention(q, k, v, score_mod=term.score_mod(pq, pk))
        ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + term.bias(pq, pk), dim=-1) @ v
    assert_close(out, ref)


@flex_forward
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("relative_bias", ["t5", "alibi", "spectrum"])
def test_softmax_flex_backend_matches_sdpa_without_a_dense_bias(relative_bias, causal, monkeypatch):
    torch.manual_seed(2)
    layer = SoftmaxAttention.from_options(24, H, causal=causal, relative_bias=relative_bias, backend="flex")
    with torch.no_grad():
        for p in layer.relative.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 11, 24)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, -3:] = True
    with torch.no_grad():
        p = layer.prepare(x, None, pad)
        ref = layer.finish(layer.core._attend(p.q, p.k, p.v, p.pos, p.pad, "sdpa")[0], x)
        # The flex backend must not ask the term for its [N, N] bias. Both belong to the
        # core, so they are patched there, on this instance: a class patch would outlive a
        # failed undo in every later test.
        core = layer.core
        monkeypatch.setattr(core.relative, "pairwise", lambda *a: pytest.fail("dense bias formed"))
        monkeypatch.setattr(core, "positional_term", lambda *a: pytest.fail("dense bias formed"))
        out = layer(x, key_padding_mask=pad)
    assert_close(out, ref)


@pytest.mark.slow
@pytest.mark.skipif(not flex_attention_available("cpu", False)[0], reason="FlexAttention forward does not run on CPU here")
@pytest.mark.parametrize("name", ["alibi", "discrete", "gaussian_mixture", "local", "t5"])
def test_compiled_flex_attention_with_score_mod_matches_dense_bias(name, one_thread):
    """torch.compile(flex_attention) lowers a score_mod to scalar code per score (where an
    operation on a whole captured tensor went wrong): the per-score form and the offset
    table give the dense bias's attention there too."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(3)
    label, pq, pk = _cases(name)[-1]
    term = _term(name, pq.shape[-1], dtype=torch.float32)
    pq, pk = pq.float(), pk.float()
    B, N, Nk, D = 2, pq.shape[1], pk.shape[1], 16
    q, k, v = torch.randn(B, H, N, D), torch.randn(B, H, Nk, D), torch.randn(B, H, Nk, D)
    with torch.no_grad():
        out = torch.compile(flex_attention)(q, k, v, score_mod=term.score_mod(pq, pk))
        ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + term.bias(pq, pk), dim=-1) @ v
    assert_close(out, ref)
