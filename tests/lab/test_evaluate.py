"""``flt evaluate``: a saved run's metric on fresh draws, exactly, and with other estimator
settings (flt.commands.evaluate)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from flt.cli import main
from flt.commands.evaluate import evaluate_run
from flt.tasks import change_data
from flt.train import get_preset, train
from flt.train.config import Preset

pytestmark = pytest.mark.usefixtures("one_thread")


def _trained(tmp_path_factory, label: str, preset: Preset):
    """Train ``preset`` in a fresh directory with its own data cache; yields (run dir, summary)."""
    root = tmp_path_factory.mktemp(label)
    mp = pytest.MonkeyPatch()
    mp.setenv("FLT_CACHE_DIR", str(root / "cache"))
    summary = train(preset, str(root / "run"), progress=False, plots=False)
    yield str(root / "run"), summary
    mp.undo()


@pytest.fixture(scope="module")
def molecule_run(tmp_path_factory):
    """A few steps of the molecule task's FLT (multiplicative, near set) on 48 structures."""
    p = get_preset("molecule", "smoke", "flt")
    options = {**p.model.attention_options, "feature_map": "favor+", "num_frequencies": 32, "sampler": "iid", "near_neighbors": 4}
    model = dataclasses.replace(p.model, dim=16, attention_options=options)
    run = dataclasses.replace(p.run, steps=4, batch_size=4, eval_every=2, log_every=1, checkpoint_every=2)
    yield from _trained(tmp_path_factory, "evaluate", Preset("molecule", model, run, {**p.data, "num_samples": 48, "progress": False}))


def test_without_options_it_reproduces_the_draw_gap_of_the_run(molecule_run):
    path, summary = molecule_run
    res = evaluate_run(path)
    gap = summary["draw_gap"]
    assert res["metric"] == summary["metric"] == "mae" and res["options"] == {}
    for key in ("own", "fresh_mean", "fresh_std", "exact"):
        assert res[key] == pytest.approx(gap[key], rel=1e-6), key
    assert len(res["fresh"]) == 3


def test_changed_estimator_settings_are_evaluated_on_fresh_draws(molecule_run):
    path, summary = molecule_run
    res = evaluate_run(path, {"num_frequencies": 64, "num_features": 32, "sampler": "qmc"}, draws=2, exact=False)
    assert res["own"] is None and res["exact"] is None  # no own draw for other settings; exact skipped
    assert len(res["fresh"]) == 2 and all(math.isfinite(v) for v in res["fresh"])
    assert res["fresh"] != pytest.approx(evaluate_run(path, draws=2, exact=False)["fresh"])  # the estimator changed
    # Every pair in the near set: the estimate is the exact attention, on any draw.
    everything = evaluate_run(path, {"near_neighbors": 64}, draws=2)
    assert everything["fresh"] == pytest.approx([everything["exact"]] * 2, rel=1e-5)
    assert everything["exact"] == pytest.approx(summary["draw_gap"]["exact"], rel=1e-5)


def test_changed_options_are_checked_once_and_built_as_checked(molecule_run, attention_checks):
    path, _ = molecule_run
    evaluate_run(path, {"num_frequencies": 64}, draws=1, exact=False)
    assert len(attention_checks) == 1 and attention_checks[0]["num_frequencies"] == 64
    attention_checks.clear()
    evaluate_run(path, draws=1, exact=False)  # the saved options: checked where the model is built
    assert len(attention_checks) == 1


def test_options_that_change_learned_tensors_are_refused(molecule_run):
    path, _ = molecule_run
    with pytest.raises(ValueError, match=r"qk_norm.*learned tensors.*gone: .*log_temperature"):
        evaluate_run(path, {"qk_norm": False})
    with pytest.raises(ValueError, match="--draws must be >= 0"):
        evaluate_run(path, draws=-1)
    with pytest.raises(ValueError, match="--exact-max-elements"):
        evaluate_run(path, exact_max_elements=0)


def test_the_exact_evaluation_is_skipped_above_its_size_limit(molecule_run):
    path, summary = molecule_run
    assert evaluate_run(path, draws=0, exact_max_elements=1)["exact"] is None  # one sample is larger
    # a limit above one sample's weights evaluates exactly: the draw gap's value
    res = evaluate_run(path, draws=0, exact_max_elements=10**6)
    assert res["exact"] == pytest.approx(summary["draw_gap"]["exact"], rel=1e-5)


@pytest.mark.cli
def test_the_command_prints_and_writes_json(molecule_run, tmp_path, capsys):
    path, _ = molecule_run
    out = tmp_path / "eval.json"
    assert main(["evaluate", path, "--draws", "1", "--no-exact", "--attn-opt", "num_frequencies=16", "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert "mae with {'num_frequencies': 16}: own draw n/a, fresh draws" in line and "exact n/a" in line
    saved = json.loads(out.read_text())
    assert saved["options"] == {"num_frequencies": 16} and len(saved["fresh"]) == 1


def test_a_language_model_run_is_evaluated_on_its_own_windows(tmp_path):
    """An LM task cuts its validation text into windows of the model's length, which it
    learns from the config (``Task.configure``): evaluating a saved LM run once failed there."""
    p = get_preset("lm", "smoke", "flt")
    run = dataclasses.replace(p.run, steps=2, eval_every=2, log_every=1, checkpoint_every=2, eval_batches=2,
                              draw_gap=True, draw_gap_batches=2)
    summary = train(Preset("lm", p.model, run, p.data), str(tmp_path / "run"), progress=False,
                    plots=False)
    res = evaluate_run(str(tmp_path / "run"))
    assert res["metric"] == summary["metric"] == "ppl"
    for key in ("own", "fresh_mean", "fresh_std", "exact"):
        assert res[key] == pytest.approx(summary["draw_gap"][key], rel=1e-6), key


@pytest.fixture(scope="module")
def listops_run(tmp_path_factory):
    """Two steps of ListOps' FLT on expressions of 20-40 tokens."""
    p = get_preset("listops", "smoke", "flt")
    run = dataclasses.replace(p.run, steps=2, eval_every=2, log_every=1, checkpoint_every=2, batch_size=4)
    data = {**p.data, "num_train": 16, "num_valid": 12, "min_length": 20, "max_length": 40}
    yield from _trained(tmp_path_factory, "evaluate-listops", Preset("listops", p.model, run, data))


def _trained_data(path):
    """The data options the run was trained with."""
    return json.loads((Path(path) / "run.json").read_text())["preset"]["data"]


def _spy_tasks(monkeypatch):
    """Record the options of every task that flt evaluate loads, and the task."""
    import flt.tasks

    seen = []
    real = flt.tasks.load_task

    def spy(name, options):
        task = real(name, options)
        seen.append((name, dict(options), task))
        return task

    monkeypatch.setattr(flt.tasks, "load_task", spy)
    return seen


def test_other_data_options_evaluate_on_other_data(listops_run, monkeypatch):
    """Length generalisation: a model trained on 20-40 tokens evaluated on 60-100."""
    path, summary = listops_run
    seen = _spy_tasks(monkeypatch)
    same = evaluate_run(path, draws=1, exact=False)
    assert same["data"] == {} and same["own"] == pytest.approx(summary["draw_gap"]["own"], rel=1e-6)
    longer = evaluate_run(path, draws=1, exact=True, data_options={"min_length": 60, "max_length": 100})
    assert longer["data"] == {"min_length": 60, "max_length": 100}
    name, options, task = seen[-1]
    assert name == "listops" and options == {**_trained_data(path), "min_length": 60, "max_length": 100}
    lengths = task.valid.lengths
    assert len(lengths) == 12 and int(lengths.min()) >= 60 and int(lengths.max()) <= 100
    assert all(math.isfinite(longer[k]) for k in ("own", "exact")) and longer["own"] != same["own"]
    with pytest.raises(ValueError, match=r"unknown data options for 'listops': \['max_len'\]"):
        evaluate_run(path, data_options={"max_len": 100})


@pytest.mark.cli
def test_a_dataset_path_replaces_the_bundled_size_options(listops_run, tmp_path, monkeypatch, capsys):
    path, _ = listops_run
    tsv = "Source\tTarget\n( ( [MAX 2 9 ) [MIN 4 7 ] ) 0 ] )\t9\n[SM 1 [MED 3 5 1 ] ]\t4\n"
    for part in ("train", "val"):
        (tmp_path / f"basic_{part}.tsv").write_text(tsv)
    seen = _spy_tasks(monkeypatch)
    assert main(["evaluate", path, "--draws", "0", "--no-exact", "--data", str(tmp_path)]) == 0
    assert (f"accuracy with the trained options on {{'path': '{tmp_path}'}} (the trained run's max_length, min_length, "
            "num_train, num_valid dropped with its dataset): own draw") in capsys.readouterr().out
    _, options, task = seen[-1]
    assert options["path"] == str(tmp_path) and not {"num_train", "num_valid", "min_length", "max_length"} & set(options)
    assert len(task.valid) == 2


@pytest.mark.cli
def test_the_command_passes_data_options(listops_run, capsys, monkeypatch):
    path, _ = listops_run
    seen = _spy_tasks(monkeypatch)
    assert main(["evaluate", path, "--draws", "0", "--no-exact", "--data-opt", "min_length=60", "--data-opt", "max_length=100"]) == 0
    assert "accuracy with the trained options on {'min_length': 60, 'max_length': 100}: own draw" in capsys.readouterr().out
    assert int(seen[-1][2].valid.lengths.min()) >= 60


def test_data_the_trained_model_does_not_fit_is_refused(molecule_run, listops_run, tmp_path, monkeypatch):
    # Another split gives other target statistics, which the model's output scaling was trained with.
    path, _ = molecule_run
    with pytest.raises(ValueError, match=r"--data-opt/--data \{'split_seed': 1\}: the 'molecule' model would change on this data \(.*target_mean"):
        evaluate_run(path, draws=0, exact=False, data_options={"split_seed": 1})
    # Options of the bundled data are refused with a dataset read from files, not ignored.
    path, _ = listops_run
    for part in ("train", "val"):
        (tmp_path / f"basic_{part}.tsv").write_text("Source\tTarget\n[SM 1 [MED 3 5 1 ] ]\t4\n")
    with pytest.raises(ValueError, match=r"--data-opt/--data max_length: options of the bundled data, which the dataset at .* does not take"):
        evaluate_run(path, draws=0, exact=False, data_options={"path": str(tmp_path), "max_length": 100})
    # Estimator options are checked before any data is loaded.
    seen = _spy_tasks(monkeypatch)
    with pytest.raises(ValueError, match="family has no components to shift"):
        evaluate_run(path, {"spectrum": "gaussian", "shift": True}, draws=0, exact=False)
    assert seen == []


def test_a_char_language_model_is_not_evaluated_with_another_vocabulary(tmp_path):
    p = get_preset("lm", "smoke", "flt")
    run = dataclasses.replace(p.run, steps=1, eval_every=1, log_every=1, checkpoint_every=1, eval_batches=1, draw_gap=False)
    train(Preset("lm", p.model, run, {**p.data, "tokenizer": "char"}), str(tmp_path / "run"), progress=False, plots=False)
    text = tmp_path / "other.txt"
    text.write_text("abc abc\n" * 4000)
    with pytest.raises(ValueError, match=r"the 'lm' model would change on this data \(.*vocab_size.*the task's saved tokenizer"):
        evaluate_run(str(tmp_path / "run"), draws=0, exact=False, data_options={"path": str(text)})


def test_another_text_file_drops_the_trained_validation_file(tmp_path, monkeypatch):
    """An LM trained on a file with its own validation file, evaluated on another file: the
    validation comes from the new file, not from the old validation file."""
    for name in ("train", "valid", "other"):
        (tmp_path / f"{name}.txt").write_text(f"{name}: the quick brown fox jumps over the lazy dog\n" * 400)
    p = get_preset("lm", "smoke", "flt")
    run = dataclasses.replace(p.run, steps=1, eval_every=1, log_every=1, checkpoint_every=1, eval_batches=1, draw_gap=False)
    data = change_data("lm", p.data, {"path": str(tmp_path / "train.txt"), "valid_path": str(tmp_path / "valid.txt")})
    train(Preset("lm", p.model, run, data), str(tmp_path / "run"), progress=False, plots=False)
    seen = _spy_tasks(monkeypatch)
    res = evaluate_run(str(tmp_path / "run"), draws=0, exact=False, max_batches=1, data_options={"path": str(tmp_path / "other.txt")})
    _, options, task = seen[-1]
    assert options["path"] == str(tmp_path / "other.txt") and "valid_path" not in options
    assert res["dropped"] == ["valid_path"]
    text = bytes(task.valid_tokens.tolist())
    assert b"other:" in text and b"valid:" not in text and b"train:" not in text


def test_a_checkpoint_that_does_not_fit_its_own_config_is_named_as_such(molecule_run):
    from flt.commands.evaluate import load_with_draws
    from flt.train.checkpoint import load_checkpoint_model

    model, _ = load_checkpoint_model(molecule_run[0])
    state = model.state_dict()
    key = next(k for k in state if k.endswith("weight"))
    with pytest.raises(ValueError, match=r"^the checkpoint's learned tensors do not fit the model its own config builds "
                                         r"\(gone: extra\): a checkpoint of another version of flt\?"):
        load_with_draws(model, {**state, "extra": state[key]}, {"--attn-opt": {}})
    with pytest.raises(ValueError, match=rf"^--attn-opt {{'x': 1}}: the learned tensors of the checkpoint do not fit \(reshaped: {key}\)"):
        load_with_draws(model, {**state, key: state[key][:1]}, {"--attn-opt": {"x": 1}})


def test_statistics_that_differ_in_their_last_bits_are_the_same_model():
    """A target spread summed with another number of threads (1.9462372055997939 against
    ...958, seen between a 1-thread training and a 2-thread evaluation) is the same model;
    a real change of the data is not."""
    from flt.commands.evaluate import same_value

    assert same_value(1.9462372055997939, 1.9462372055997958)
    assert same_value({"target_std": 1.9462372055997939, "dims": [1.0, 2.0]}, {"target_std": 1.9462372055997958, "dims": [1.0, 2.0]})
    assert not same_value(1.9462372055997939, 1.9462372)
    assert not same_value({"a": 1.0}, {"a": 1.0, "b": 2.0})
    assert not same_value([1.0, 2.0], [1.0])
    assert not same_value("1.0", 1.0)


@pytest.fixture(scope="module")
def molecule_run_two_batches(tmp_path_factory):
    """The molecule run of :func:`molecule_run` whose draw gap reads 2 batches of 4 structures."""
    p = get_preset("molecule", "smoke", "flt")
    options = {**p.model.attention_options, "feature_map": "favor+", "num_frequencies": 32, "sampler": "iid", "near_neighbors": 4}
    model = dataclasses.replace(p.model, dim=16, attention_options=options)
    run = dataclasses.replace(p.run, steps=2, batch_size=4, eval_batch_size=4, eval_every=2, log_every=1,
                              checkpoint_every=2, draw_gap_batches=2)
    yield from _trained(tmp_path_factory, "evaluate2", Preset("molecule", model, run, {**p.data, "num_samples": 48, "progress": False}))


def test_smaller_batches_score_the_draw_gaps_samples(molecule_run_two_batches):
    """The draw gap reads 8 structures: in batches of 4, of 1, and exactly in the batches that fit."""
    from flt.tasks import load_task

    path, summary = molecule_run_two_batches
    gap = summary["draw_gap"]
    res = evaluate_run(path, draws=1, batch_size=1)
    assert res["own"] == pytest.approx(gap["own"], rel=1e-5)
    assert res["exact"] == pytest.approx(gap["exact"], rel=1e-5)
    # an exact batch of one structure (what a tight memory limit gives) scores the same 8
    preset = get_preset("molecule", "smoke", "flt")
    task = load_task("molecule", {**preset.data, "num_samples": 48, "progress": False})
    cfg = task.configure(preset.model)
    one = cfg.heads * task.longest_sequence(cfg) ** 2
    tight = evaluate_run(path, draws=0, exact_max_elements=one)
    assert tight["exact"] == pytest.approx(gap["exact"], rel=1e-5)
    assert evaluate_run(path, draws=0, max_batches=1, batch_size=1)["own"] != pytest.approx(gap["own"], rel=1e-4)


def test_a_breakdown_is_refused_for_a_task_without_one(molecule_run):
    path, _ = molecule_run
    with pytest.raises(ValueError, match=r"--breakdown: task 'molecule' has no error breakdown \(nbody has one\)"):
        evaluate_run(path, draws=0, exact=False, breakdown=True)
