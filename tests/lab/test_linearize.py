"""flt linearize: a softmax decoder saved by ``save_pretrained`` is converted, its cores
trained to match the softmax layers (attention transfer), then fine-tuned, in a run
directory that resumes bit for bit. Tiny random Llama and GPT-2 checkpoints, built here."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from flt.cli import main
from flt.integrations.transformers import convert, from_pretrained
from flt.train.linearize import (
    LayerMatching,
    LinearizeConfig,
    LinearizeInterrupted,
    byte_ids,
    linearize,
    load_softmax_model,
    load_text,
    perplexity,
)
from flt.train.metrics import read_metrics

#: A small text: both stages and every evaluation read it in well under a second.
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(120))
BAND = {"near_field": 4, "qk_norm": False, "num_features": 16, "seed": 0}


def save_llama(directory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def save_gpt2(directory):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=256, eos_token_id=None,
                        bos_token_id=None, pad_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def save_sharp_llama(directory):
    """A random Llama whose attention is peaked (query and key weights scaled up), unlike a
    freshly initialised one's near-uniform attention, which any linear core matches already."""
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(save_llama(directory))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
    model.save_pretrained(directory)
    return directory


SAVERS = {"llama": save_llama, "gpt2": save_gpt2, "sharp": save_sharp_llama}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("softmax")
    return {name: save(root / name) for name, save in SAVERS.items()}


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "code.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def small_config(text_file, **changes) -> LinearizeConfig:
    base = {"data": str(text_file), "seq_len": 24, "batch_size": 2, "transfer_steps": 3, "finetune_steps": 3, "warmup_steps": 1,
            "eval_every": 2, "eval_batches": 2, "checkpoint_every": 2, "attention_options": BAND, "byte_tokens": True}
    return LinearizeConfig(**{**base, **changes})


@pytest.mark.cli
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cli_linearizes_a_checkpoint_into_a_run_directory(name, checkpoints, text_file, tmp_path, isolated_cli):
    out = tmp_path / "run"
    code = main(["linearize", str(checkpoints[name]), "--bytes", "--data", str(text_file), "--out-dir", str(out), "--seq-len", "24",
                 "--batch-size", "2", "--transfer-steps", "3", "--finetune-steps", "3", "--warmup-steps", "1",
                 "--eval-every", "2", "--eval-batches", "2", "--attention", "flt:near_field=4:qk_norm=false:num_features=16",
                 "--no-progress"])
    assert code == 0
    assert (out / "learning_curves.png").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == "bytes" and summary["steps"] == 6
    assert set(summary["ppl"]) == {"softmax", "converted", "transferred", "finetuned"}
    assert all(math.isfinite(v) and v > 1 for v in summary["ppl"].values())
    # The band of 4 covers most of 24 tokens and f starts at 0: the converted model starts near softmax.
    assert summary["ppl"]["converted"] == pytest.approx(summary["ppl"]["softmax"], rel=0.05)
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records if r["split"] == "transfer"] == [1, 2, 3]
    assert [r["step"] for r in records if r["split"] == "train"] == [4, 5, 6]
    assert len(records[[r["split"] for r in records].index("transfer")]["layers"]) == 2
    # The saved model is the linearised one: reloaded, it scores the summary's final perplexity.
    model = from_pretrained(out / "model")
    assert model.config.flt_attention["attention"] == "flt"
    valid = byte_ids(load_text(str(text_file))[1])
    again = perplexity(model, valid, seq_len=24, batch_size=2, max_batches=2)
    assert again["ppl"] == pytest.approx(summary["ppl"]["finetuned"], rel=1e-5)


def test_attention_transfer_reduces_every_layers_matching_error(checkpoints, text_file, tmp_path, one_thread):
    config = small_config(text_file, transfer_steps=12, finetune_steps=0, transfer_lr=1e-2, eval_every=12, checkpoint_every=12)
    summary = linearize(checkpoints["sharp"], str(tmp_path / "run"), config, progress=False, plots=False)
    before, after = summary["matching_error"]["before"], summary["matching_error"]["after"]
    assert len(before) == len(after) == 2
    for layer, (b, a) in enumerate(zip(before, after, strict=True)):
        assert a < 0.97 * b, f"layer {layer}: matching error {b:.3g} -> {a:.3g}"
    assert summary["ppl"]["finetuned"] is None and summary["ppl"]["transferred"] is not None


def test_transfer_trains_the_cores_only(checkpoints, text_file, tmp_path, one_thread):
    from safetensors.torch import load_file

    config = small_config(text_file, transfer_steps=2, finetune_steps=0, eval_every=2)
    linearize(checkpoints["gpt2"], str(tmp_path / "run"), config, progress=False, plots=False)
    original, trained = load_file(checkpoints["gpt2"] / "model.safetensors"), load_file(tmp_path / "run" / "model" / "model.safetensors")
    shared = set(original) & set(trained)
    assert shared and all(torch.equal(original[k], trained[k]) for k in shared)
    # What the model gained is the cores' parameters (the spectra of f and f_near), nothing else.
    fresh = {k for k in trained if ".flt_core." in k}
    assert fresh and fresh == set(trained) - set(original)


class _StopAt:
    """An ``on_step`` that presses Ctrl-C after ``step``."""

    def __init__(self, step):
        self.step = step

    def __call__(self, step):
        if step == self.step:
            raise KeyboardInterrupt


@pytest.mark.parametrize(("stop", "transfer"), [(2, "outputs"), (3, "outputs"), (5, "outputs"), (2, "both")])
def test_resume_continues_bit_for_bit(stop, transfer, checkpoints, text_file, tmp_path, one_thread):
    """Stopped inside transfer (2), at the stage boundary (3: fine-tuning starts with a fresh
    optimizer) or inside fine-tuning (5: its optimizer and GPT-2's dropout noise restored),
    then resumed, the run ends with the same records and weights as an uninterrupted one
    (matching outputs, or outputs and weights)."""
    from safetensors.torch import load_file

    config = small_config(text_file, checkpoint_every=1, transfer=transfer)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    linearize(checkpoints["gpt2"], str(whole), config, progress=False, plots=False)
    with pytest.raises(LinearizeInterrupted) as info:
        linearize(checkpoints["gpt2"], str(parts), config, progress=False, plots=False, on_step=_StopAt(stop))
    assert info.value.step == stop and info.value.checkpoint.endswith(f"step-{stop:08d}")
    linearize(checkpoints["gpt2"], str(parts), config, resume=True, progress=False, plots=False)
    assert read_metrics(str(parts / "metrics.jsonl")) == read_metrics(str(whole / "metrics.jsonl"))
    a, b = load_file(whole / "model" / "model.safetensors"), load_file(parts / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_continues_a_run_from_before_transfer_was_an_option(checkpoints, text_file, tmp_path, one_thread):
    """A checkpoint whose settings have no ``transfer`` matched outputs, and one without
    ``byte_tokens`` read bytes if its record says so: it resumes as such."""
    config = small_config(text_file, transfer_steps=2, finetune_steps=1, checkpoint_every=1)
    with pytest.raises(LinearizeInterrupted):
        linearize(checkpoints["llama"], str(tmp_path / "run"), config, progress=False, plots=False, on_step=_StopAt(1))
    meta_file = tmp_path / "run" / "checkpoints" / "step-00000001" / "config.json"
    meta = json.loads(meta_file.read_text())
    del meta["linearize"]["transfer"], meta["linearize"]["byte_tokens"]
    assert meta["tokens"] == "bytes"
    meta_file.write_text(json.dumps(meta))
    summary = linearize(checkpoints["llama"], str(tmp_path / "run"), config, resume=True, progress=False, plots=False)
    assert summary["transfer"] == "outputs" and summary["steps"] == 3
    with pytest.raises(ValueError, match="differ: transfer"):
        linearize(checkpoints["llama"], str(tmp_path / "run"), dataclasses.replace(config, transfer="weights"), resume=True,
                  progress=False, plots=False)


def test_resume_refuses_other_options(checkpoints, text_file, tmp_path, one_thread):
    config = small_config(text_file, transfer_steps=1, finetune_steps=0)
    linearize(checkpoints["llama"], str(tmp_path / "run"), config, progress=False, plots=False)
    with pytest.raises(ValueError, match="already holds a run"):
        linearize(checkpoints["llama"], str(tmp_path / "run"), config, progress=False, plots=False)
    with pytest.raises(ValueError, match="differ: transfer_lr"):
        linearize(checkpoints["llama"], str(tmp_path / "run"), dataclasses.replace(config, transfer_lr=0.5), resume=True,
                  progress=False, plots=False)


def test_resume_refuses_a_checkpoint_of_the_old_loop(checkpoints, text_file, tmp_path, one_thread):
    """A checkpoint written before linearize ran on the training loop (a trainer state of
    its own: one random state, no world size or logging window) is refused by name, with
    what to do, before anything in the run directory changes."""
    from flt.train.checkpoint import STATE_FILE, sha256_file

    config = small_config(text_file, checkpoint_every=1)
    run = tmp_path / "run"
    with pytest.raises(LinearizeInterrupted):
        linearize(checkpoints["llama"], str(run), config, progress=False, plots=False, on_step=_StopAt(2))
    ckpt = run / "checkpoints" / "step-00000002"
    state = torch.load(ckpt / STATE_FILE, weights_only=True)
    old = {"step": 2, "stage": "transfer", "optimizer": state["optimizer"], "rng": state["rng"][0], "step_times": state["step_times"]}
    torch.save(old, ckpt / STATE_FILE)
    meta = json.loads((ckpt / "config.json").read_text())
    meta["files"][STATE_FILE] = {"sha256": sha256_file(str(ckpt / STATE_FILE)), "bytes": (ckpt / STATE_FILE).stat().st_size}
    (ckpt / "config.json").write_text(json.dumps(meta))
    records = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=rf"^{ckpt} was written by an earlier version of flt linearize, whose checkpoints this "
                       "one does not resume; start the run again in another --out-dir$"):
        linearize(checkpoints["llama"], str(run), config, resume=True, progress=False, plots=False)
    assert (run / "metrics.jsonl").read_text() == records


@pytest.mark.parametrize("stage", ["transfer", "finetune"])
def test_a_diverging_stage_names_its_learning_rate(stage, checkpoints, text_file, tmp_path, one_thread, monkeypatch):
    """A non-finite loss stops the run, naming the step (of
    the stage's last), the last checkpoint (intact) and the flag of the stage's learning rate."""
    import flt.train.linearize.run as run_module
    from flt.train.loop import TrainingDiverged

    def nan(*args):
        return torch.tensor(float("nan"), requires_grad=True)

    monkeypatch.setattr(run_module, "transfer_loss" if stage == "transfer" else "next_token_loss", nan)
    config = small_config(text_file, transfer_steps=1, finetune_steps=2)
    run = tmp_path / "run"
    step, last, where = (1, 1, "no checkpoint was written yet") if stage == "transfer" else (
        2, 3, f"the last checkpoint, {run / 'checkpoints' / 'step-00000001'}, is intact")
    with pytest.raises(TrainingDiverged) as diverged:
        linearize(checkpoints["llama"], str(run), config, progress=False, plots=False)
    assert str(diverged.value) == f"the training loss is nan at step {step} of {last} in {run}; {where}; lower --{stage}-lr"


def _cli_error(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.cli
def test_bad_model_dir_is_one_line_error(checkpoints, tmp_path, capsys, isolated_cli):
    out = str(tmp_path / "run")
    assert "MODEL_DIR" in _cli_error(["linearize", str(tmp_path / "missing"), "--bytes", "--out-dir", out], capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "not a transformers checkpoint: it has no config.json" in _cli_error(["linearize", str(empty), "--bytes", "--out-dir", out], capsys)
    (empty / "config.json").write_text("{}")
    assert "has no model_type" in _cli_error(["linearize", str(empty), "--bytes", "--out-dir", out], capsys)
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "no loadable weights" in _cli_error(["linearize", str(empty), "--bytes", "--out-dir", out], capsys)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.cli
@pytest.mark.parametrize("attention, message", [
    ("flt:bogus=1", "unknown option 'bogus'"),
    ("nope", "attention must be one of"),
    ("flt:near_field", "options must be KEY=VALUE"),
    ("flt:causal=true", "causal is not an attention option"),
])
def test_bad_attention_is_refused_before_loading(attention, message, checkpoints, tmp_path, capsys, isolated_cli):
    err = _cli_error(["linearize", str(checkpoints["llama"]), "--bytes", "--out-dir", str(tmp_path / "run"), "--attention", attention], capsys)
    assert message in err and "Traceback" not in err


@pytest.mark.cli
def test_weights_transfer_refuses_the_multiplicative_coupling_before_loading(checkpoints, tmp_path, capsys, isolated_cli):
    err = _cli_error(["linearize", str(checkpoints["llama"]), "--bytes", "--out-dir", str(tmp_path / "run"), "--transfer", "weights",
                      "--attention", "flt:coupling=multiplicative:near_field=0"], capsys)
    assert "does not have (its signed mask" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_converted_model_is_not_linearized_again(checkpoints, text_file, tmp_path, one_thread):
    config = small_config(text_file, transfer_steps=1, finetune_steps=0)
    linearize(checkpoints["llama"], str(tmp_path / "run"), config, progress=False, plots=False)
    with pytest.raises(ValueError, match="converted by flt already"):
        linearize(tmp_path / "run" / "model", str(tmp_path / "again"), config, progress=False, plots=False)


@pytest.mark.cli
def test_cli_checks_the_attention_options_once(checkpoints, text_file, tmp_path, isolated_cli, attention_checks):
    """Once on the command line, before any model loads; linearize() and the cores of both
    layers take them as checked."""
    code = main(["linearize", str(checkpoints["llama"]), "--bytes", "--data", str(text_file), "--out-dir", str(tmp_path / "run"),
                 "--seq-len", "24", "--batch-size", "2", "--transfer-steps", "1", "--finetune-steps", "1", "--warmup-steps", "0",
                 "--eval-every", "2", "--eval-batches", "1", "--attention", "flt:near_field=4:qk_norm=false:num_features=16",
                 "--no-progress", "--no-plots"])
    assert code == 0
    assert attention_checks == [{**LinearizeConfig().attention_options, "near_field": 4, "qk_norm": False, "num_features": 16}]


def test_convert_checks_its_options_once_for_every_layer(checkpoints, one_thread, attention_checks):
    from flt.options import ATTENTION_ARGUMENTS, check_attention_options

    model = convert(load_softmax_model(checkpoints["llama"], "cpu"), "flt", near_field=4, num_features=16)
    assert len(model.model.layers) == 2 and attention_checks == [{"near_field": 4, "num_features": 16}]
    checked = check_attention_options("flt", {"near_field": 4, "num_features": 16}, reserved=ATTENTION_ARGUMENTS)
    attention_checks.clear()
    convert(load_softmax_model(checkpoints["llama"], "cpu"), "flt", attention_options=checked)
    assert attention_checks == []
    with pytest.raises(TypeError, match="not both"):
        convert(load_softmax_model(checkpoints["llama"], "cpu"), "flt", attention_options=checked, seed=1)


def test_cli_flt_options_override_the_defaults_one_by_one():
    from flt.cli import build_parser
    from flt.commands.linearize import config_from_args

    args = build_parser().parse_args(["linearize", "m", "--out-dir", "o", "--attention", "flt:near_field=8", "--attn-opt", "seed=3"])
    assert config_from_args(args).attention_options == {**LinearizeConfig().attention_options, "near_field": 8, "seed": 3}
    args = build_parser().parse_args(["linearize", "m", "--out-dir", "o", "--attention", "performer:num_features=32"])
    assert config_from_args(args).attention_options == {"num_features": 32}


def test_text_that_does_not_fit_the_model_is_refused(checkpoints, tmp_path, one_thread):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1") * 50)
    config = small_config(latin1, transfer_steps=1, finetune_steps=0)
    with pytest.raises(ValueError, match="not UTF-8"):
        linearize(checkpoints["llama"], str(tmp_path / "run"), config, progress=False, plots=False)
    small = tmp_path / "small-vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 eos_token_id=None, bos_token_id=None, pad_token_id=None)).save_pretrained(small)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    with pytest.raises(ValueError, match="has no tokenizer and its vocabulary"):
        linearize(small, str(tmp_path / "run2"), small_config(text), progress=False, plots=False)


@pytest.mark.cli
def test_a_folder_without_a_tokenizer_is_refused_unless_bytes_are_asked_for(checkpoints, text_file, tmp_path, capsys,
                                                                             isolated_cli):
    """A model trained on another tokenizer would train on bytes, ids that mean nothing to it,
    without a word: a folder without a tokenizer needs --bytes, checked before any model loads."""
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"has no tokenizer \(none of tokenizer.json.*pass --bytes"):
        linearize(checkpoints["llama"], str(out), small_config(text_file, byte_tokens=False), progress=False, plots=False)
    err = _cli_error(["linearize", str(checkpoints["llama"]), "--data", str(text_file), "--out-dir", str(out)], capsys)
    assert err.count("\n") == 1 and "has no tokenizer" in err and "pass --bytes" in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(ValueError, match="byte_tokens must be true or false"):
        small_config(text_file, byte_tokens="yes")


def test_bytes_are_refused_where_the_folder_has_a_tokenizer(tmp_path, text_file):
    directory = save_gpt2(tmp_path / "model")
    (directory / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"--bytes: MODEL_DIR .* has a tokenizer \(tokenizer.json\)"):
        linearize(directory, str(tmp_path / "run"), small_config(text_file), progress=False, plots=False)
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_with_a_tokenizer_is_read_with_it(tmp_path, one_thread):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    directory = save_gpt2(tmp_path / "model")
    tokenizer.save_pretrained(directory)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    config = small_config(text, seq_len=8, transfer_steps=1, finetune_steps=1, byte_tokens=False)
    summary = linearize(directory, str(tmp_path / "run"), config, progress=False, plots=False)
    assert summary["tokens"] != "bytes"
    # Word tokens: far fewer than the text's bytes.
    assert summary["eval_tokens"] < len(TEXT.encode()) * config.valid_fraction / 3


def test_a_core_without_learned_parts_has_nothing_to_transfer(checkpoints, text_file, tmp_path, one_thread):
    config = small_config(text_file, attention="softmax", attention_options={})
    with pytest.raises(ValueError, match="no learned parameters for attention transfer"):
        linearize(checkpoints["llama"], str(tmp_path / "run"), config, progress=False, plots=False)
    # Fine-tuning alone works: the control of a linearisation (the softmax model, trained as long).
    summary = linearize(checkpoints["llama"], str(tmp_path / "run2"), dataclasses.replace(config, transfer_steps=0),
                        progress=False, plots=False)
    assert summary["ppl"]["converted"] == pytest.approx(summary["ppl"]["softmax"], rel=1e-5)
    assert summary["ppl"]["transferred"] is None and summary["matching_error"]["after"] is None


def _values(module, hidden):
    """The values ``[B, H, N, D]`` a Llama or GPT-2 attention module computes from its input
    (repeated for grouped queries), written out from its projections."""
    B, N, _ = hidden.shape
    if hasattr(module, "v_proj"):
        v = module.v_proj(hidden).view(B, N, -1, module.head_dim).transpose(1, 2)
        return v.repeat_interleave(module.num_key_value_groups, dim=1)
    v = module.c_attn(hidden).split(module.embed_dim, dim=2)[2]
    return v.view(B, N, module.num_heads, module.head_dim).transpose(1, 2)


def _out_projection(module, heads):
    merged = heads.transpose(1, 2).flatten(2)
    return module.o_proj(merged) if hasattr(module, "o_proj") else module.c_proj(merged)


def _teacher_and_student(directory, **options):
    """The softmax model (float64, eager attention) and a converted copy."""
    from flt.integrations.transformers import convert

    teacher = (LlamaForCausalLM if "llama" in directory.name or "sharp" in directory.name else GPT2LMHeadModel).from_pretrained(directory)
    teacher = teacher.double().eval()
    student = convert(copy.deepcopy(teacher), "flt", **options)
    teacher.set_attn_implementation("eager")
    return teacher, student


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_teacher_weights_times_values_are_the_teacher_layers_output(name, checkpoints, one_thread):
    from flt.integrations.transformers import attention_modules

    teacher, student = _teacher_and_student(checkpoints[name], near_field=4, qk_norm=False, num_features=16, seed=0)
    matching = LayerMatching(teacher, student, weights=True)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    matching.losses(ids)
    for i, module in enumerate(attention_modules(teacher)):
        w = matching.target_weights[i]
        assert w.shape == (2, 4, 20, 20)
        with torch.no_grad():
            out = _out_projection(module, w @ _values(module, matching.inputs[i]))
        torch.testing.assert_close(out, matching.targets[i], rtol=0, atol=1e-10)
        # Llama's eager attention takes its softmax in float32 whatever the model's dtype.
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 20, dtype=torch.float64), rtol=0, atol=1e-6)
        assert torch.equal(w.triu(1), torch.zeros_like(w))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_weights_kl_is_zero_for_a_student_equal_to_the_teacher(name, checkpoints, one_thread):
    """FLT with f = 0, no query-key normalisation and a band over every causal pair is
    softmax itself: its weights' KL from the teacher's is 0; without the band it is not."""
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    teacher, student = _teacher_and_student(checkpoints[name], near_field=20, qk_norm=False, num_features=16, seed=0)
    losses = {k: v.detach() for k, v in LayerMatching(teacher, student, weights=True).losses(ids).items()}
    # 0 up to the float32 rounding of Llama's eager softmax (GPT-2's is in float64: 1e-16).
    assert losses["weights"].shape == (2,) and float(losses["weights"].abs().max()) < 1e-6
    assert float(losses["outputs"].max()) < 1e-10
    teacher, student = _teacher_and_student(checkpoints[name], qk_norm=False, num_features=16, seed=0)
    assert float(LayerMatching(teacher, student, weights=True).losses(ids)["weights"].detach().min()) > 1e-4


def test_matching_weights_needs_the_teachers_eager_attention(checkpoints):
    teacher, student = _teacher_and_student(checkpoints["llama"], near_field=4, qk_norm=False, num_features=16, seed=0)
    teacher.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="eager"):
        LayerMatching(teacher, student, weights=True)


@pytest.mark.parametrize("transfer", ["weights", "both"])
def test_weights_transfer_lowers_every_layers_kl(transfer, checkpoints, text_file, tmp_path, one_thread):
    config = small_config(text_file, transfer=transfer, transfer_steps=12, finetune_steps=0, eval_every=12, checkpoint_every=12)
    summary = linearize(checkpoints["sharp"], str(tmp_path / "run"), config, progress=False, plots=False)
    before, after = summary["weights_kl"]["before"], summary["weights_kl"]["after"]
    assert summary["transfer"] == transfer and len(before) == len(after) == 2
    for layer, (b, a) in enumerate(zip(before, after, strict=True)):
        assert a < 0.97 * b, f"layer {layer}: weights' KL {b:.3g} -> {a:.3g}"
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    steps = [r for r in records if r["split"] == "transfer"]
    assert len(steps) == 12 and all(len(r["kl"]) == len(r["layers"]) == 2 for r in steps)
    if transfer == "weights":  # the loss is the KL averaged over the layers
        assert all(r["loss"] == pytest.approx(sum(r["kl"]) / 2, rel=1e-6) for r in steps)


def test_outputs_transfer_records_no_kl(checkpoints, text_file, tmp_path, one_thread):
    summary = linearize(checkpoints["llama"], str(tmp_path / "run"), small_config(text_file, finetune_steps=0), progress=False,
                        plots=False)
    assert summary["transfer"] == "outputs" and summary["weights_kl"] == {"before": None, "after": None}
    assert not any("kl" in r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")))


@pytest.mark.cli
def test_cli_transfer_flag(checkpoints, text_file, tmp_path, capsys, isolated_cli):
    from flt.cli import build_parser
    from flt.commands.linearize import config_from_args

    assert config_from_args(build_parser().parse_args(["linearize", "m", "--out-dir", "o"])).transfer == "outputs"
    out = tmp_path / "run"
    code = main(["linearize", str(checkpoints["gpt2"]), "--bytes", "--data", str(text_file), "--out-dir", str(out), "--seq-len", "24",
                 "--batch-size", "2", "--transfer-steps", "2", "--finetune-steps", "1", "--warmup-steps", "1",
                 "--eval-every", "2", "--eval-batches", "1", "--transfer", "both", "--no-progress"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["transfer"] == "both" and len(summary["weights_kl"]["after"]) == 2
    assert (out / "learning_curves.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["linearize", "m", "--out-dir", "o", "--transfer", "attention"])
    assert "--transfer: invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="transfer must be one of"):
        LinearizeConfig(transfer="attention")


def test_stages_keep_parameters_the_core_froze_frozen(checkpoints):
    """A spectrum frozen at construction (``far_field=False``) stays frozen in every stage."""
    from flt.integrations.transformers import attention_modules, convert
    from flt.train.linearize import trainable_parameters

    model = convert(LlamaForCausalLM.from_pretrained(checkpoints["llama"]), attention="flt", **BAND, far_field=False)
    spectra = [p for m in attention_modules(model) for p in m.get_submodule("flt_core").attention.spectrum.parameters()]
    assert spectra and not any(p.requires_grad for p in spectra)
    for stage in ("cores", "all", "cores"):
        chosen = {id(p) for p in trainable_parameters(model, stage)}
        assert chosen and not any(id(p) in chosen or p.requires_grad for p in spectra)
