"""Per-layer fidelity (flt.train.fidelity): each attention layer's fast output against its
exact() on the hidden states the model feeds it."""

from __future__ import annotations

import math

import pytest
import torch

from flt.models.block import Trunk
from flt.train.fidelity import attention_layers, format_fidelity, layer_fidelity

pytestmark = pytest.mark.usefixtures("one_thread")


def _trunk(attention: str, options: dict, depth: int = 2) -> Trunk:
    return Trunk(16, depth, 2, attention=attention, attention_options=options, pos_dim=3, causal=False, mlp_ratio=2.0,
                 dropout=0.0)


def _flt(num_frequencies: int) -> Trunk:
    # Deterministic kernel features: only the mask f is estimated, by num_frequencies draws.
    torch.manual_seed(0)
    return _trunk("flt", {"spectrum": "gaussian", "coupling": "multiplicative", "feature_map": "hedgehog",
                          "num_features": 8, "num_frequencies": num_frequencies, "length_scale": 3.0})


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 12, 16, generator=g), 2 * torch.randn(3, 12, 3, generator=g)) for _ in range(2)]


def _run(model, batch):
    return model(*batch)


def test_many_frequencies_give_almost_no_error_and_few_a_large_one():
    many = layer_fidelity(_flt(65536), _batches(), _run)
    few = layer_fidelity(_flt(4), _batches(), _run)
    assert [r["layer"] for r in many] == ["blocks.0.attn", "blocks.1.attn"]
    assert all(r["attention"] == "FLTAttention" and r["tokens"] == 2 * 3 * 12 for r in many)
    assert max(r["relative_error"] for r in many) < 0.03
    assert min(r["relative_error"] for r in few) > 0.3


def test_exact_attention_has_zero_error_on_every_layer():
    rows = layer_fidelity(_trunk("softmax", {}), _batches(), _run)
    assert len(rows) == 2 and all(r["relative_error"] < 1e-6 for r in rows)


def test_exact_sees_the_inputs_the_model_gives_each_layer_and_the_output_is_unchanged():
    model = _flt(64)
    batch = _batches()[0]
    expected_out = model(*batch)
    block_inputs, exact_inputs = [], []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda mod, args: block_inputs.append(mod.norm1(args[0])))
        original = block.attn.exact

        def recording(x, pos=None, key_padding_mask=None, original=original):
            exact_inputs.append((x, pos))
            return original(x, pos, key_padding_mask)

        block.attn.exact = recording
    outputs = []
    layer_fidelity(model, [batch], lambda m, b: outputs.append(m(*b)))
    assert len(exact_inputs) == len(block_inputs) == 2
    for (x, pos), h in zip(exact_inputs, block_inputs):
        torch.testing.assert_close(x, h, rtol=0, atol=0)
        assert torch.equal(pos, batch[1])
    torch.testing.assert_close(outputs[0], expected_out, rtol=0, atol=0)  # the hooks change nothing
    assert all(not h for b in model.blocks for h in (b.attn._forward_hooks, b.attn._forward_hooks_with_kwargs))


def test_padded_queries_are_left_out():
    x, pos = _batches()[0]
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[0, 8:] = True
    rows = layer_fidelity(_flt(64), [(x, pos, pad)], _run)
    assert all(r["tokens"] == 3 * 12 - 4 and math.isfinite(r["relative_error"]) for r in rows)


def test_layers_are_listed_in_model_order_and_the_table_names_them():
    model = _flt(16)
    assert [name for name, _ in attention_layers(model)] == ["blocks.0.attn", "blocks.1.attn"]
    table = format_fidelity(layer_fidelity(model, _batches(), _run))
    assert "blocks.1.attn" in table and "FLTAttention" in table and len(table.splitlines()) == 3
    with pytest.raises(ValueError, match="no attention layers"):
        layer_fidelity(torch.nn.Linear(2, 2), [], _run)
