"""The test split: held out from training and from validation (which picks presets and
learning rates), and leaving validation as it was without one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flt.commands.evaluate import evaluate_run
from flt.data import load_catalysis, load_python_docs, split_molecules
from flt.data._split import carve_test, split_indices
from flt.data.images import load_digits
from flt.data.listops import generate_listops, load_listops
from flt.data.molecules import MoleculeData, generate_catalysis
from flt.data.pysource import load_python_source
from flt.data.text import TextSplits, carve_text_test
from flt.tasks import TASKS, get_preset, load_task
from flt.train import train
from flt.train.config import Preset

pytestmark = pytest.mark.usefixtures("one_thread")


def test_carve_test_takes_its_items_from_training_only_and_is_deterministic():
    train, valid = split_indices(100, 0.1, seed=3)
    rest, test = carve_test(train, 100, 0.2, seed=3)
    assert len(test) == 20 and len(rest) == 70
    assert np.array_equal(np.sort(np.concatenate([rest, test])), train)  # a partition of training
    assert not set(test) & set(valid)
    assert np.all(np.diff(test) > 0) and np.all(np.diff(rest) > 0)
    again = carve_test(train, 100, 0.2, seed=3)
    assert np.array_equal(again[1], test)
    assert not np.array_equal(carve_test(train, 100, 0.2, seed=4)[1], test)
    with pytest.raises(ValueError, match="test_fraction"):
        carve_test(train, 100, 1.0, seed=0)


def test_catalysis_test_structures_are_generated_after_the_split_ones(tmp_path):
    kw = dict(seed=0, relax_steps=0, valid_fraction=0.25, cache_dir=tmp_path, progress=False)
    plain = load_catalysis(8, **kw)
    with_test = load_catalysis(8, test_samples=3, **kw)
    assert plain.test is None
    for name in ("train", "valid"):  # training and validation are those without a test split
        a, b = getattr(plain, name), getattr(with_test, name)
        assert torch.equal(a.y, b.y) and torch.equal(a.pos, b.pos)
    longer = generate_catalysis(11, seed=0, relax_steps=0)
    assert torch.equal(with_test.test.y, longer.y[8:])
    assert torch.equal(with_test.test.pos, longer.subset(np.arange(8, 11)).pos)


def test_molecule_files_carve_test_from_training():
    rng = np.random.default_rng(0)
    data = MoleculeData.from_lists([np.array([1, 6])] * 40, [rng.normal(size=(2, 3))] * 40, list(np.arange(40.0)))
    plain = split_molecules(data, 0.1, 0)
    split = split_molecules(data, 0.1, 0, test_fraction=0.2)
    assert torch.equal(plain.valid.y, split.valid.y)
    train, test = set(split.train.y.tolist()), set(split.test.y.tolist())
    assert len(test) == 8 and not train & test and not test & set(split.valid.y.tolist())
    assert train | test == set(plain.train.y.tolist())


def test_digits_validation_holds_the_same_images_with_a_test_split():
    plain, split = load_digits(), load_digits(test_fraction=0.1)
    assert torch.equal(plain.valid.labels, split.valid.labels)
    # Standardised by other training statistics: the same images once unstandardised.
    raw = lambda s, x: x * s.std.view(1, -1, 1, 1) + s.mean.view(1, -1, 1, 1)  # noqa: E731
    torch.testing.assert_close(raw(plain, plain.valid.images), raw(split, split.valid.images))
    assert len(split.test) == round(0.1 * (len(plain.train) + len(plain.valid)))
    assert len(split.train) + len(split.test) == len(plain.train)


def test_python_docs_test_documents_come_from_training():
    plain, split = load_python_docs(), load_python_docs(test_fraction=0.1)
    assert split.valid == plain.valid and plain.test is None and split.test
    assert len(split.train) < len(plain.train)
    # Whole documents: each test document appears in the training text without a test split.
    assert all(doc in plain.train for doc in split.test.split(b"\n\n")[:5])
    assert split.test[:2000] not in split.train


def test_text_files_keep_their_own_test_split_or_carve_the_end_of_training():
    own = TextSplits(train=b"a" * 90, valid=b"b" * 10, test=b"c" * 10)
    assert carve_text_test(own, 0.1) is own
    carved = carve_text_test(TextSplits(train=b"abcdefghij" * 9, valid=b"v" * 10), 0.1)
    assert carved.valid == b"v" * 10 and carved.train + carved.test == b"abcdefghij" * 9 and len(carved.test) == 10


def test_python_source_test_files_are_training_files_and_validation_is_unchanged():
    plain = load_python_source(max_bytes=200_000)
    split = load_python_source(max_bytes=200_000, test_fraction=0.1)
    assert split.valid_files == plain.valid_files and torch.equal(split.valid, plain.valid)
    assert split.test_files and set(split.test_files) <= set(plain.train_files)
    assert not set(split.test_files) & set(split.train_files)


def test_listops_test_expressions_continue_the_validation_stream(tmp_path):
    spec = dict(min_length=10, max_length=40, seed=0, cache_dir=tmp_path)
    plain = load_listops(num_train=8, num_valid=6, **spec)
    split = load_listops(num_train=8, num_valid=6, num_test=4, **spec)
    assert torch.equal(plain.valid.tokens, split.valid.tokens) and torch.equal(plain.train.labels, split.train.labels)
    stream = generate_listops(10, seed=1, min_length=10, max_length=40)
    assert torch.equal(split.test.labels, stream.labels[6:])


# qm9 parses the 130,831 molecules of qm9pack into a fresh cache: about 10 s.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "qm9" else n for n in sorted(TASKS)])
def test_every_task_batches_its_test_split_like_validation(name, tmp_path, monkeypatch):
    monkeypatch.setenv("FLT_CACHE_DIR", str(tmp_path))
    preset = get_preset(name, "smoke")
    data = {**preset.data, **({"progress": False} if name == "molecule" else {})}
    task = load_task(name, data)
    task.configure(preset.model)
    valid = next(iter(task.eval_batches(4, 1, 0, 1)))
    test = next(iter(task.test_batches(4, 1, 0, 1)))
    assert type(test) is type(valid)
    if isinstance(valid, (tuple, list)):
        assert len(test) == len(valid)
        assert [type(t) for t in test] == [type(v) for v in valid]
    assert len(list(task.test_batches(4, 2, 0, 1))) <= 2  # max_batches caps it as for validation


def test_training_reports_the_test_metric_that_flt_evaluate_measures(tmp_path, monkeypatch):
    monkeypatch.setenv("FLT_CACHE_DIR", str(tmp_path / "cache"))
    p = get_preset("molecule", "smoke", "flt")
    model = dataclasses.replace(p.model, dim=16)
    run = dataclasses.replace(p.run, steps=4, batch_size=4, eval_every=2, log_every=1, checkpoint_every=2)
    preset = Preset("molecule", model, run, {**p.data, "num_samples": 40, "progress": False})
    summary = train(preset, str(tmp_path / "run"), progress=False, plots=False)
    assert set(summary["test"]) == set(summary["final"]) and summary["test_mae"] == summary["test"]["mae"]
    assert summary["test_mae"] != summary["final"]["mae"]  # another set of structures
    res = evaluate_run(str(tmp_path / "run"), split="test", draws=0, exact=False)
    assert res["split"] == "test" and res["own"] == pytest.approx(summary["test_mae"], rel=1e-6)
    assert evaluate_run(str(tmp_path / "run"), draws=0, exact=False)["own"] == pytest.approx(summary["final"]["mae"], rel=1e-6)


def test_a_task_without_test_batches_has_no_test_split():
    from flt.tasks.base import Task, has_test_split

    class NoTest(Task):
        name = "no-test"

    assert not has_test_split(NoTest()) and all(has_test_split(object.__new__(cls)) for cls in TASKS.values())
    with pytest.raises(NotImplementedError, match="no test split"):
        NoTest().test_batches(4, None, 0, 1)
