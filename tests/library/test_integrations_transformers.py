"""flt.integrations.transformers: a converted decoder keeps the original's projections and
rotary embedding (float64 logits equal when the core is exact softmax), trains, generates,
and round-trips save_pretrained / from_pretrained. Tiny random configurations, no download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from flt.integrations.transformers import FLTCache, convert, from_pretrained  # noqa: E402

VOCAB = 50
F64 = torch.float64


def tiny_llama(**overrides):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
                         pad_token_id=0, **overrides)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2():
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, attn_pdrop=0.0, resid_pdrop=0.0,
                        embd_pdrop=0.0, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def tiny_llama_family(config_class, model_class):
    """A tiny Qwen2 or Mistral: the Llama family's attention module under another name."""
    def build():
        config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
                              pad_token_id=0)
        return model_class(config).eval()
    return build


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
FAMILY = {
    **MODELS,
    "qwen2": tiny_llama_family(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": tiny_llama_family(transformers.MistralConfig, transformers.MistralForCausalLM),
}


#: The causal-LM class of each family, which a converted model's class derives from.
model_classes = {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(params=sorted(MODELS))
def build(request):
    return MODELS[request.param]


def tokens(batch=2, length=12):
    return torch.randint(1, VOCAB, (batch, length))


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_exact_core_with_zero_spectrum_reproduces_the_original_logits(name):
    """FLT's exact path with f = 0 (spectra start at amplitude 0) and qk_norm=False is
    softmax(q.k / sqrt(D)): any gap between the models would be the conversion's plumbing
    (projections and their biases, rotary embedding, grouped heads, scaling, causal mask)."""
    model = FAMILY[name]().to(F64)
    ids = tokens()
    original = model(ids).logits
    convert(model, "flt", path="exact", qk_norm=False)
    assert model.config._attn_implementation == "flt"
    torch.testing.assert_close(model(ids).logits, original, rtol=1e-12, atol=1e-12)


def test_the_converted_core_is_the_one_computing(build):
    """The identity above is not the model's own attention running: a nonzero spectrum changes the logits."""
    model = build().to(F64)
    ids = tokens()
    original = model(ids).logits
    convert(model, "flt", path="exact", qk_norm=False, amplitude=1.0)
    assert (model(ids).logits - original).abs().max() > 1e-3


def test_projection_weights_are_kept():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert(model, "flt", num_features=16, num_frequencies=4)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert sum(".flt_core." in k for k in after) > 0


def test_converted_model_trains(build):
    model = build().train()
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=0)
    ids = tokens()
    loss = model(ids, labels=ids).loss
    loss.backward()
    attn = model.model.layers[0].self_attn if hasattr(model, "model") else model.transformer.h[0].attn
    assert torch.isfinite(loss)
    assert attn.flt_core.attention.spectrum.mu.grad.abs().sum() > 0
    projection = attn.q_proj.weight if hasattr(attn, "q_proj") else attn.c_attn.weight
    assert projection.grad.abs().sum() > 0


def test_attention_dropout_in_training_is_refused():
    model = tiny_llama(attention_dropout=0.1).train()
    convert(model, "performer", num_features=8)
    with pytest.raises(ValueError, match="attention dropout"):
        model(tokens())


def test_save_and_load_keep_the_settings_and_the_cores(build, tmp_path):
    model = build()
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=3, near_field=2)
    with torch.no_grad():  # a trained spectrum, not the initial one
        for name, p in model.named_parameters():
            if "flt_core" in name:
                p.add_(0.1 * torch.randn_like(p))
    ids = tokens()
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path).eval()
    assert loaded.config.flt_attention == {"attention": "flt", "path": "forward", "num_features": 16, "num_frequencies": 4,
                                           "amplitude": 0.5, "seed": 3, "near_field": 2}
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_standard_loader_returns_the_converted_model(name, tmp_path):
    """``AutoModelForCausalLM.from_pretrained`` on a saved converted model: the converted
    class (its own model_type), every tensor loaded, the same logits. It used to return the
    softmax original with the cores' tensors listed as unexpected."""
    model = FAMILY[name]()
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=3, near_field=2)
    with torch.no_grad():  # a trained spectrum, not the one the settings would draw
        for param_name, p in model.named_parameters():
            if "flt_core" in param_name:
                p.add_(0.1 * torch.randn_like(p))
    ids = tokens()
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == f"flt_{name}" and saved["architectures"] == [f"FLT{model_classes[name].__name__}"]
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(loaded, model_classes[name]) and type(loaded).__name__.startswith("FLT")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(AutoConfig.from_pretrained(tmp_path)).model_type == f"flt_{name}"
    assert loaded.config._attn_implementation == "flt"
    torch.testing.assert_close(loaded.eval()(ids).logits, expected, rtol=0, atol=0)
    torch.testing.assert_close(from_pretrained(tmp_path).eval()(ids).logits, expected, rtol=0, atol=0)


def test_a_folder_saved_by_the_previous_version_still_loads_through_flt(tmp_path):
    """Folders saved before the converted model types (the original model_type plus
    flt_attention) load through flt's from_pretrained, as before, and save as the new type."""
    model = tiny_llama()
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=3)
    ids = tokens()
    expected = model(ids).logits
    model.save_pretrained(tmp_path / "old")
    config_file = tmp_path / "old" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])  # as the previous version wrote it
    config_file.write_text(json.dumps(config))
    loaded = from_pretrained(tmp_path / "old").eval()
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    loaded.save_pretrained(tmp_path / "new")
    assert json.loads((tmp_path / "new" / "config.json").read_text())["model_type"] == "flt_llama"
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "new").eval()(ids).logits, expected, rtol=0, atol=0)


def test_importing_the_integration_registers_the_converted_types(tmp_path):
    """A fresh process: the import alone makes the standard loader return the converted model."""
    import os
    import subprocess
    import sys

    model = tiny_gpt2()
    convert(model, "performer", num_features=8, seed=1)
    ids = tokens()
    model.save_pretrained(tmp_path)
    torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    script = f"""
import torch
import flt.integrations.transformers
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
expected = torch.load({str(tmp_path / "expected.pt")!r})
assert type(model).__name__ == "FLTGPT2LMHeadModel", type(model)
torch.testing.assert_close(model(expected["ids"]).logits, expected["logits"], rtol=0, atol=0)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=300, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_family_outside_the_table_is_registered_when_met(tmp_path):
    """A Llama-family model of a type the import does not register: convert() registers its
    classes; a folder of it loads through flt's from_pretrained (registering them) and,
    after that, through the standard loader."""
    config_class = getattr(transformers, "Qwen3Config", None)
    if config_class is None:
        pytest.skip("this transformers has no Qwen3")
    model = tiny_llama_family(config_class, transformers.Qwen3ForCausalLM)()
    convert(model, "flt", num_features=16, seed=2)
    ids = tokens()
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "flt_qwen3"
    torch.testing.assert_close(from_pretrained(tmp_path).eval()(ids).logits, expected, rtol=0, atol=0)
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits, expected, rtol=0, atol=0)


def test_from_pretrained_refuses_an_unconverted_model(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no flt settings"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("options", [{"path": "forward", "near_field": 2}, {"path": "forward"}])
def test_generate_matches_the_full_forward(build, options):
    """Greedy decoding through the model's cache (each token the last row of the causal
    core over the cached keys) picks the argmax of the uncached forward at every step."""
    model = build().to(F64)
    convert(model, "flt", num_features=32, num_frequencies=4, amplitude=0.5, seed=0, **options)
    prompt = tokens(1, 6)
    out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11)
    logits = model(out).logits
    assert torch.equal(logits[0, 5:-1].argmax(-1), out[0, 6:])


def test_left_padding_leaves_the_real_tokens_alone():
    model = tiny_llama().to(F64)
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=0)
    ids = tokens(1, 7)
    alone = model(ids).logits
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], 1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(padded, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(out[:, 3:], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [{"near_field": 2}, {}, {"coupling": "multiplicative", "amplitude": 1.0}])
def test_fltcache_decoding_equals_the_full_forward(build, options):
    """Prompt then token by token through FLTCache (flt's constant-size state) gives the
    logits of the uncached forward, and generate() with it the default cache's tokens."""
    model = build().to(F64)
    options = {"amplitude": 0.5, **options}
    convert(model, "flt", num_features=16, num_frequencies=4, seed=0, **options)
    ids = tokens(2, 9)
    full = model(ids).logits
    cache = FLTCache()
    rows = [model(ids[:, :5], cache=cache).logits]
    rows += [model(ids[:, t:t + 1], cache=cache).logits for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(rows, 1), full, rtol=1e-10, atol=1e-10)
    expected = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, cache=FLTCache()), expected)


def test_fltcache_state_does_not_grow_with_the_prompt(build):
    model = build()
    convert(model, "flt", num_features=16, num_frequencies=4, seed=0, near_field=2)
    sizes = []
    for length in (8, 64):
        cache = FLTCache()
        with torch.no_grad():
            model(tokens(1, length), cache=cache)
        sizes.append(cache.state_bytes())
    assert sizes[0] == sizes[1] > 0


def test_generate_from_fltcache_holds_the_same_bytes_after_a_short_and_a_long_prompt():
    """generate() through FLTCache (the path scripts/decode_state_size.py measures at 1k and
    8k tokens): prompts of 16 and 96 tokens, both longer than the band, leave states of the
    same size, while the default KV cache of the same model grows with the prompt."""
    model = tiny_llama()
    convert(model, "flt", num_features=16, num_frequencies=4, seed=0, near_field=3)
    flt_bytes, kv_bytes = [], []
    for length in (16, 96):
        prompt = tokens(1, length)
        cache = FLTCache()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=2, do_sample=False, cache=cache)
            default = model.generate(prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        assert out.shape == (1, length + 2)
        flt_bytes.append(cache.state_bytes())
        kv = default.past_key_values
        kv_bytes.append(sum(t.numel() * t.element_size() for layer in kv.layers for t in (layer.keys, layer.values)))
    assert flt_bytes[0] == flt_bytes[1] > 0
    assert kv_bytes[1] / kv_bytes[0] == pytest.approx((96 + 1) / (16 + 1))


def test_fltcache_rows_are_selected_and_repeated_with_their_states(build):
    """batch_select_indices and batch_repeat_interleave move whole rows of every layer's
    state: the next token then decodes as from the prompts those rows hold."""
    model = build().to(F64)
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=0, near_field=2)
    ids = tokens(2, 6)
    full = model(ids).logits[:, -1]
    selected = FLTCache()
    model(ids[:, :5], cache=selected)
    selected.batch_select_indices(torch.tensor([1]))
    torch.testing.assert_close(model(ids[1:, 5:], cache=selected).logits[:, -1], full[1:], rtol=1e-10, atol=1e-10)
    repeated = FLTCache()
    model(ids[:1, :5], cache=repeated)
    repeated.batch_repeat_interleave(2)
    torch.testing.assert_close(model(ids[:1, 5:].repeat(2, 1), cache=repeated).logits[:, -1], full[:1].expand(2, -1),
                               rtol=1e-10, atol=1e-10)


def test_fltcache_refuses_what_it_cannot_decode():
    model = tiny_llama()
    convert(model, "flt", path="exact", qk_norm=False)
    with pytest.raises(ValueError, match="path='forward'"):
        model(tokens(1, 4), cache=FLTCache())
    model = tiny_llama()
    convert(model, "flt", num_features=8, num_frequencies=4)
    cache = FLTCache()
    model(tokens(1, 4), cache=cache)
    with pytest.raises(ValueError, match="padding in the prompt only"):
        model(tokens(1, 1), attention_mask=torch.tensor([[1, 1, 1, 1, 0]]), cache=cache)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(1)


def left_padded(lengths):
    """Random prompts of ``lengths`` tokens and their batch padded on the left (token 0),
    with its attention mask: ``(prompts, ids [B, N], mask [B, N])``."""
    prompts = [tokens(1, n)[0] for n in lengths]
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, n - len(prompt):] = prompt
        mask[row, n - len(prompt):] = 1
    return prompts, ids, mask


CACHES = {"default": dict, "fltcache": lambda: {"cache": FLTCache()}}


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("options", [{"near_field": 2}, {}])
def test_left_padded_batch_generates_each_row_as_alone(build, cache, options):
    """Greedy generation from a left-padded batch (position ids from the attention mask,
    as generate() derives them) gives each row the tokens and logits of its prompt alone,
    computed without a cache. Prompts of 2, 9 and 5 tokens: with w = 2 the shortest row's
    band starts with padded slots and its far field holds only padding."""
    model = build().to(F64)
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=0, **options)
    prompts, ids, mask = left_padded([2, 9, 5])
    settings = {"max_new_tokens": 5, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    batch = model.generate(ids, attention_mask=mask, **settings, **CACHES[cache]())
    n = ids.shape[1]
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], use_cache=False, **settings)
        assert torch.equal(batch.sequences[row, n:], alone.sequences[0, len(prompt):])
        torch.testing.assert_close(torch.stack(batch.logits)[:, row], torch.stack(alone.logits)[:, 0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_right_padded_generation_is_refused(cache):
    model = tiny_llama()
    convert(model, "flt", num_features=8, num_frequencies=4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(tokens(2, 4), attention_mask=mask, max_new_tokens=2, do_sample=False, **CACHES[cache]())


def sharpened(model, factor=10.0):
    """``model`` with every weight matrix scaled by ``factor``: at the tiny initial weights
    the next-token distributions are nearly flat and the beams seldom change places, so a
    cache that did not follow them would go unnoticed."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(factor)
    return model


@pytest.mark.parametrize("options", [{"near_field": 2}, {}])
def test_beam_search_from_fltcache_equals_beam_search_without_a_cache(build, options):
    """num_beams=3 from FLTCache (its states reordered with the beams) finds the sequences
    and scores that beam search finds recomputing the whole forward at every step, here on
    a left-padded batch."""
    torch.manual_seed(0)
    model = sharpened(build().to(F64))
    convert(model, "flt", num_features=16, num_frequencies=4, amplitude=0.5, seed=0, **options)
    _, ids, mask = left_padded([4, 7])
    settings = {"max_new_tokens": 8, "num_beams": 3, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    expected = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    got = model.generate(ids, attention_mask=mask, cache=FLTCache(), **settings)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=1e-10, atol=1e-10)
    beams = expected.beam_indices  # the beam (row of the cache) each final sequence held at every step; -1 once done
    assert ((beams != beams[:, :1]) & (beams >= 0)).any(), "the beams never changed places: this test would not see a cache that ignored them"
