"""The training loop: bit-for-bit resume, atomic and verified checkpoints, batches, configs."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from conftest import Killed, kill_at
from flt.models import LMConfig
from flt.train import CheckpointError, RunConfig, get_preset, load_checkpoint_model, load_task, train
from flt.train.checkpoint import find_checkpoint, read_checkpoint_config, save_checkpoint
from flt.train.config import Preset, preset_differences, preset_from_dict, preset_to_dict
from flt.train.metrics import MetricsLogger, read_metrics
from flt.train.presets import PRESETS


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_lm(steps=9, **run) -> Preset:
    """A few-second LM run: 2 layers of width 32 on 20 kB of the Python docs, with dropout
    (so the training RNG matters for resume)."""
    p = get_preset("lm", "smoke")
    model = dataclasses.replace(p.model, dim=32, dropout=0.1, max_len=32)
    run_cfg = dataclasses.replace(p.run, steps=steps, batch_size=4, eval_every=4, checkpoint_every=3, log_every=1, **run)
    return Preset("lm", model, run_cfg, {"max_bytes": 20_000})



def weights(path):
    model, _ = load_checkpoint_model(path)
    return model.state_dict()


def test_resume_continues_bit_for_bit(tmp_path):
    preset = tiny_lm()
    train(preset, str(tmp_path / "straight"), progress=False, plots=False)
    # Killed after step 7: the last checkpoint is step 6, steps 7's work is lost and redone.
    with pytest.raises(Killed):
        train(preset, str(tmp_path / "resumed"), progress=False, plots=False, on_step=kill_at(7))
    assert read_checkpoint_config(find_checkpoint(str(tmp_path / "resumed")))["step"] == 6
    summary = train(preset, str(tmp_path / "resumed"), resume=True, progress=False, plots=False)
    a, b = weights(str(tmp_path / "straight")), weights(str(tmp_path / "resumed"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The optimizer and the metrics log continue identically too.
    records = {(r["step"], r["split"]): r for r in read_metrics(str(tmp_path / "resumed" / "metrics.jsonl"))}
    straight = {(r["step"], r["split"]): r for r in read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))}
    assert records.keys() == straight.keys()
    assert all(records[k]["loss"] == straight[k]["loss"] for k in records)
    assert summary["final"] == json.loads((tmp_path / "straight" / "summary.json").read_text())["final"]


def test_resume_needs_same_configuration_and_a_checkpoint(tmp_path):
    preset = tiny_lm(steps=3)
    out = str(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        train(preset, out, resume=True, progress=False, plots=False)
    train(preset, out, progress=False, plots=False)
    with pytest.raises(ValueError, match="already holds a run"):
        train(preset, out, progress=False, plots=False)
    other = dataclasses.replace(preset, run=dataclasses.replace(preset.run, lr=1e-4))
    with pytest.raises(ValueError, match="run.lr"):
        train(other, out, resume=True, progress=False, plots=False)
    # Resuming a finished run re-evaluates and changes nothing.
    before = weights(out)
    train(preset, out, resume=True, progress=False, plots=False)
    after = weights(out)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _small_checkpoint(tmp_path):
    preset = tiny_lm(steps=3)
    out = str(tmp_path / "run")
    train(preset, out, progress=False, plots=False)
    return out, find_checkpoint(out)


def test_corrupt_or_missing_checkpoint_files_raise_clear_errors(tmp_path):
    out, ckpt = _small_checkpoint(tmp_path)
    model_file = os.path.join(ckpt, "model.safetensors")
    data = bytearray(open(model_file, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(model_file, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt"):
        load_checkpoint_model(out)
    open(model_file, "wb").write(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint_model(out)
    os.unlink(model_file)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint_model(out)
    open(os.path.join(ckpt, "config.json"), "w").write("{not json")
    with pytest.raises(CheckpointError, match="config.json is corrupt"):
        load_checkpoint_model(out)
    open(os.path.join(out, "checkpoints", "latest"), "w").write("../../etc\n")
    with pytest.raises(CheckpointError, match="latest is corrupt"):
        load_checkpoint_model(out)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint_model(str(tmp_path / "nowhere"))


def test_weights_that_do_not_fit_the_model_are_rejected(tmp_path):
    out, ckpt = _small_checkpoint(tmp_path)
    meta = json.loads(open(os.path.join(ckpt, "config.json")).read())
    meta["model"]["dim"] = 64
    open(os.path.join(ckpt, "config.json"), "w").write(json.dumps(meta))
    with pytest.raises(CheckpointError, match="do not fit"):
        load_checkpoint_model(ckpt)


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    out, ckpt = _small_checkpoint(tmp_path)
    model, meta = load_checkpoint_model(out)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(out, 99, model, config={"preset": meta["preset"]}, trainer_state={})
    assert find_checkpoint(out) == ckpt
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.endswith(".tmp")]
    load_checkpoint_model(out)


def test_checkpoints_are_pruned_and_trainer_state_loads_weights_only(tmp_path):
    out, ckpt = _small_checkpoint(tmp_path)
    names = sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step-"))
    assert names == ["step-00000003"]
    state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)
    assert state["step"] == 3 and state["world_size"] == 1 and "optimizer" in state


@pytest.mark.parametrize("task", ["lm", "image"])
def test_global_batches_are_a_function_of_seed_and_step_and_shard_exactly(task):
    data = {"lm": {"max_bytes": 20_000}, "image": {}}[task]
    t = load_task(task, data)
    t.configure(PRESETS[task]["smoke"]().model)
    full = t.train_batch(5, 8, 3, 0, 1)
    shards = [t.train_batch(5, 8, 3, r, 4) for r in range(4)]
    for i in range(2):
        assert torch.equal(torch.cat([s[i] for s in shards]), full[i])
        assert torch.equal(t.train_batch(5, 8, 3, 0, 1)[i], full[i])
    assert not torch.equal(t.train_batch(6, 8, 3, 0, 1)[0], full[0])
    with pytest.raises(ValueError, match="divisible"):
        t.train_batch(5, 8, 3, 0, 3)


def test_epochs_visit_every_training_sample_once():
    t = load_task("image", {})
    t.configure(PRESETS["image"]["smoke"]().model)
    n, bs = len(t.train), 64
    seen = torch.cat([t.train_batch(s, bs, 0, 0, 1)[1] for s in range(1, n // bs + 1)])
    labels = t.train.labels
    assert seen.numel() == (n // bs) * bs
    assert torch.equal(torch.bincount(seen, minlength=10) <= torch.bincount(labels, minlength=10), torch.ones(10, dtype=torch.bool))


def test_learning_rate_schedule():
    run = RunConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert run.lr_at(1) == pytest.approx(0.1) and run.lr_at(10) == pytest.approx(1.0)
    assert run.lr_at(100) == pytest.approx(0.1)
    lrs = [run.lr_at(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    with pytest.raises(ValueError, match="steps"):
        RunConfig(steps=0)


def test_presets_round_trip_and_report_differences():
    for task, presets in PRESETS.items():
        for name, fn in presets.items():
            p = fn()
            assert fn.__doc__ and "flt train" in fn.__doc__ and "About" in fn.__doc__, (task, name)
            assert preset_from_dict(json.loads(json.dumps(preset_to_dict(p)))) == p
    a = PRESETS["lm"]["smoke"]()
    b = dataclasses.replace(a, model=LMConfig(**{**dataclasses.asdict(a.model), "depth": 3}))
    assert preset_differences(a, b) == ["model.depth"]


def test_metrics_log_drops_records_after_the_resume_step_and_torn_lines(tmp_path):
    path = str(tmp_path / "m.jsonl")
    log = MetricsLogger(path)
    for s in range(1, 6):
        log.log(s, "train", loss=float(s))
    log.log(5, "valid", loss=float("nan"))
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "spl')  # killed mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 5]
    assert read_metrics(path)[-1]["loss"] is None
    MetricsLogger(path, resume_step=3).close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_data_errors_are_value_errors(tmp_path):
    from flt.data import DataError

    assert issubclass(DataError, ValueError)
    with pytest.raises(DataError):
        load_task("lm", {"path": str(tmp_path / "missing.txt")})
    with pytest.raises(ValueError, match=r"^unknown data options for 'lm': \['max_byte'\]"):
        load_task("lm", {"max_byte": 3})


@pytest.mark.slow  # inductor compiles the model: minutes on a 2-core CPU
def test_compile_switch_trains_the_same_model_and_saves_plain_checkpoints(tmp_path):
    """RunConfig.compile trains through torch.compile: the same losses and weights as eager
    to float32 rounding (without dropout, whose compiled random masks differ from eager's),
    and checkpoints of the module itself (no compile wrapper names)."""
    def preset(**run):
        p = tiny_lm(steps=3, **run)
        return dataclasses.replace(p, model=dataclasses.replace(p.model, dropout=0.0))

    eager = train(preset(), str(tmp_path / "eager"), progress=False, plots=False)
    compiled = train(preset(compile=True), str(tmp_path / "compiled"), progress=False, plots=False)
    assert compiled["final"]["loss"] == pytest.approx(eager["final"]["loss"], rel=1e-4)
    a, meta = load_checkpoint_model(str(tmp_path / "eager"))
    b, meta_b = load_checkpoint_model(str(tmp_path / "compiled"))
    assert meta_b["preset"]["run"]["compile"] is True and meta["preset"]["run"]["compile"] is False
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k], sb[k], rtol=1e-4, atol=1e-5), k
    with pytest.raises(TypeError, match="compile must be a bool"):
        RunConfig(compile="yes")


def test_init_from_starts_a_fresh_run_from_another_runs_weights(tmp_path):
    """``init_from``: the new run's step 1 starts from the other run's final weights (with
    a learning rate of 1e-12 one AdamW step moves no parameter by more than 1e-11), its
    steps start anew, the checkpoint it started from is recorded, and a resumed warm-started
    run continues its own checkpoints bit for bit. A model that does not fit, another task
    or a missing directory is refused by name."""
    first = str(tmp_path / "first")
    train(tiny_lm(steps=3), first, progress=False, plots=False)
    start = weights(first)

    def one_step(out, **run):
        train(tiny_lm(steps=1, lr=1e-12, warmup_steps=0, **run), out, progress=False, plots=False)
        return weights(out)

    warm = one_step(str(tmp_path / "warm"), init_from=first)
    cold = one_step(str(tmp_path / "cold"))
    names = [n for n, _ in load_checkpoint_model(first)[0].named_parameters()]
    assert max((warm[n] - start[n]).abs().max().item() for n in names) < 1e-10
    assert max((cold[n] - start[n]).abs().max().item() for n in names) > 1e-3  # a fresh run starts elsewhere
    meta = read_checkpoint_config(find_checkpoint(str(tmp_path / "warm")))
    assert meta["step"] == 1 and meta["init"] == {"checkpoint": os.path.abspath(find_checkpoint(first)), "step": 3}
    assert json.loads((tmp_path / "warm" / "run.json").read_text())["init"] == meta["init"]
    # With a real learning rate: killed after step 4 (checkpoint at 3) and resumed, the run
    # equals an uninterrupted one; reloading init_from on resume would lose steps 1-3.
    preset = tiny_lm(steps=5, init_from=first)
    train(preset, str(tmp_path / "straight"), progress=False, plots=False)
    with pytest.raises(Killed):
        train(preset, str(tmp_path / "resumed"), progress=False, plots=False, on_step=kill_at(4))
    train(preset, str(tmp_path / "resumed"), resume=True, progress=False, plots=False)
    a, b = weights(str(tmp_path / "straight")), weights(str(tmp_path / "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_checkpoint_config(find_checkpoint(str(tmp_path / "resumed")))["init"] == meta["init"]
    wide = dataclasses.replace(tiny_lm(steps=1, init_from=first), model=dataclasses.replace(tiny_lm().model, dim=48))
    with pytest.raises(CheckpointError, match="do not fit this model"):
        train(wide, str(tmp_path / "wide"), progress=False, plots=False)
    image = get_preset("image", "smoke")
    other_task = dataclasses.replace(image, run=dataclasses.replace(image.run, init_from=first))
    with pytest.raises(ValueError, match="holds a 'lm' model; this run trains 'image'"):
        train(other_task, str(tmp_path / "image"), progress=False, plots=False)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        train(tiny_lm(steps=1, init_from=str(tmp_path / "nowhere")), str(tmp_path / "lost"), progress=False, plots=False)
    with pytest.raises(ValueError, match="init_from must be None or the path"):
        RunConfig(init_from="")
