"""ListOps: the generator against its specification and a reference evaluator, the cache,
the LRA TSV loader, and the task's smoke preset."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from flt.data.errors import DataError
from flt.data.listops import (
    CLOSE,
    OPERATORS,
    PAD,
    TOKEN_ID,
    apply_operator,
    decode,
    depth,
    evaluate,
    generate_expression,
    generate_listops,
    load_listops,
    load_listops_tsv,
    read_tsv,
)


def recursive_value(tokens: list[str]) -> int:
    """A second evaluator, recursive descent with numpy's median, independent of the stack machine."""
    def parse(i):
        tok = tokens[i]
        if tok.isdigit():
            return int(tok), i + 1
        op, args, i = tok, [], i + 1
        while tokens[i] != CLOSE:
            value, i = parse(i)
            args.append(value)
        fn = {"[MAX": max, "[MIN": min, "[MED": lambda a: int(np.median(a)), "[SM": lambda a: sum(a) % 10}[op]
        return fn(args), i + 1

    value, end = parse(0)
    assert end == len(tokens)
    return value


def argument_counts(tokens: list[str]) -> list[int]:
    stack, counts = [], []
    for tok in tokens:
        if tok in OPERATORS:
            if stack:
                stack[-1] += 1
            stack.append(0)
        elif tok == CLOSE:
            counts.append(stack.pop())
        else:
            stack[-1] += 1
    assert not stack
    return counts


def test_operators_on_known_values():
    assert apply_operator("MAX", [3, 9, 1]) == 9
    assert apply_operator("[MIN", [3, 9, 1]) == 1
    assert apply_operator("MED", [7, 1, 4]) == 4
    assert apply_operator("MED", [1, 4, 8, 9]) == 6  # (4 + 8) / 2
    assert apply_operator("MED", [1, 2]) == 1  # 1.5 rounded down
    assert apply_operator("SM", [9, 8, 7]) == 4
    with pytest.raises(ValueError, match="unknown ListOps operator"):
        apply_operator("AVG", [1])


def test_evaluator_on_a_hand_written_expression_and_malformed_ones():
    tokens = "[MAX 2 9 [MIN 4 7 ] 0 ]".split()
    assert evaluate(tokens) == 9 and depth(tokens) == 2
    assert evaluate("[SM [MED 1 5 3 ] [MAX 8 2 ] 9 ]".split()) == (3 + 8 + 9) % 10
    for bad, msg in (("[MAX 1 2", "not closed"), ("[MAX 1 ] ]", "after the end"), ("1 2", "outside"),
                     ("[MAX 1 x ]", "unknown token"), ("", "empty")):
        with pytest.raises(ValueError, match=msg):
            evaluate(bad.split())


@pytest.mark.parametrize("seed", [0, 1])
def test_generated_expressions_are_well_formed_within_spec_and_labelled_right(seed):
    data = generate_listops(12, seed=seed)
    for i in range(len(data)):
        tokens = decode(data.tokens[i])
        n = int(data.lengths[i])
        assert len(tokens) == n and 500 <= n <= 2000
        assert (data.tokens[i, n:] == PAD).all()
        assert 1 <= depth(tokens) <= 10
        assert all(2 <= k <= 10 for k in argument_counts(tokens))
        label = int(data.labels[i])
        assert evaluate(tokens) == label == recursive_value(tokens)


def test_generator_respects_a_tighter_spec_and_uses_every_operator():
    rng = random.Random(5)
    seen = set()
    for _ in range(30):
        tokens, value = generate_expression(rng, min_length=20, max_length=60, max_depth=3, max_args=4)
        assert 20 <= len(tokens) <= 60 and depth(tokens) <= 3
        assert all(k <= 4 for k in argument_counts(tokens))
        assert recursive_value(tokens) == value
        seen.update(t for t in tokens if t in OPERATORS)
    assert seen == set(OPERATORS)
    with pytest.raises(ValueError, match="min_length"):
        generate_expression(rng, min_length=10, max_length=5)
    with pytest.raises(DataError, match="widen"):
        generate_expression(rng, min_length=5000, max_length=5001, max_depth=2, max_tries=3)


def test_generation_is_deterministic_and_cached(tmp_path):
    a = generate_listops(5, seed=7, min_length=50, max_length=200)
    b = generate_listops(5, seed=7, min_length=50, max_length=200)
    c = generate_listops(5, seed=8, min_length=50, max_length=200)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.tokens[:, :50], c.tokens[:, :50])
    kw = dict(num_train=6, num_valid=3, min_length=50, max_length=200, cache_dir=tmp_path)
    first = load_listops(**kw)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2
    again = load_listops(**kw)  # from the cache
    assert torch.equal(first.train.tokens, again.train.tokens) and torch.equal(first.valid.labels, again.valid.labels)
    assert not torch.equal(first.train.tokens[:3, :50], first.valid.tokens[:, :50])
    files[0].write_bytes(b"not an archive")
    with pytest.raises(DataError, match="delete it"):
        load_listops(**kw)


def test_batches_are_padded_to_their_longest_sequence():
    data = generate_listops(4, seed=0, min_length=30, max_length=90)
    tokens, pad, labels = data.batch(torch.tensor([1, 3]))
    assert tokens.shape[1] == int(data.lengths[[1, 3]].max())
    assert torch.equal((~pad).sum(1), data.lengths[[1, 3]])
    assert (tokens[pad] == PAD).all() and (tokens[~pad] != PAD).all()


TSV = "Source\tTarget\n( ( [MAX 2 9 ) [MIN 4 7 ] ) 0 ] )\t9\n[SM 1 [MED 3 5 1 ] ]\t4\n"


def test_the_lra_tsv_loader(tmp_path):
    for part in ("train", "val"):
        (tmp_path / f"basic_{part}.tsv").write_text(TSV)
    splits = load_listops_tsv(tmp_path)
    assert splits.test is None and len(splits.train) == 2
    first = decode(splits.train.tokens[0])
    assert first == "[MAX 2 9 [MIN 4 7 ] 0 ]".split()  # round brackets dropped
    assert splits.train.labels.tolist() == [9, 4]
    assert [evaluate(decode(t)) for t in splits.valid.tokens] == splits.valid.labels.tolist()
    assert splits.train.tokens[0, 0] == TOKEN_ID["[MAX"]
    same = load_listops_tsv(tmp_path / "basic_train.tsv")
    assert torch.equal(same.train.tokens, splits.train.tokens)


@pytest.mark.parametrize("text, msg", [
    ("Source\tTarget\n[MAX 1 2 ]\t12\n", "not a digit 0-9"),
    ("[MAX 1 2 ]\tx\n", "not a digit"),
    ("[MAX 1 AVG ]\t1\n", "unknown tokens"),
    ("[MAX 1 2 ]\n", "Source<TAB>Target"),
    ("Source\tTarget\n", "no examples"),
])
def test_bad_tsv_files_name_the_line(tmp_path, text, msg):
    path = tmp_path / "x_train.tsv"
    path.write_text(text)
    with pytest.raises(DataError, match=msg):
        read_tsv(path)
    with pytest.raises(DataError, match="basic_train.tsv"):
        load_listops_tsv(tmp_path / "missing")
    with pytest.raises(DataError, match="x_val.tsv"):
        load_listops_tsv(path)


@pytest.mark.cli
@pytest.mark.parametrize("attention", ["flt", "softmax"])
def test_smoke_preset_trains_in_seconds(tmp_path, monkeypatch, attention):
    from flt.cli import main

    monkeypatch.setenv("FLT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    code = main(["train", "listops", "--preset", "smoke", "--attention", attention, "--out-dir", str(out),
                 "--no-progress", "--no-plots", "--threads", "1", "--data-opt", "num_train=64", "--data-opt", "num_valid=16",
                 "--run-opt", "steps=6", "--run-opt", "eval_every=6", "--run-opt", "checkpoint_every=6",
                 "--run-opt", "draw_gap=false"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "listops" and summary["steps"] == 6
    assert 0.0 <= summary["final"]["accuracy"] <= 1.0 and np.isfinite(summary["final"]["loss"])


@pytest.mark.parametrize("attention", ["softmax", "flt"])
def test_the_classifier_ignores_padding(attention):
    from flt.tasks import get_preset, get_task

    task = get_task("listops")
    cfg = get_preset("listops", "smoke", attention).model
    torch.manual_seed(0)
    model = task.build_model(cfg, dtype=torch.float64).eval()
    data = generate_listops(2, seed=1, min_length=20, max_length=40)
    tokens, pad, _ = data.batch(torch.tensor([0, 1]))
    both = model(tokens, pad)
    for i in range(2):
        n = int(data.lengths[i])
        alone = model(tokens[i : i + 1, :n])
        torch.testing.assert_close(both[i : i + 1], alone, rtol=1e-9, atol=1e-9)


def test_bucketed_batches_cover_each_epoch_once_with_similar_lengths():
    from flt.tasks.base import bucketed_indices, epoch_indices

    lengths = torch.randint(500, 2001, (100,), generator=torch.Generator().manual_seed(0))
    batch, per_epoch = 8, 100 // 8
    for pool, epoch in ((4, 0), (4, 1), (1, 0)):
        batches = [bucketed_indices(lengths, batch, 7, epoch * per_epoch + i + 1, pool) for i in range(per_epoch)]
        seen = torch.cat(batches)
        assert seen.unique().numel() == per_epoch * batch  # no item twice in an epoch
        # the items are those of the plain epoch (the same permutation, its tail dropped)
        plain = torch.cat([epoch_indices(100, batch, 7, epoch * per_epoch + i + 1) for i in range(per_epoch)])
        assert torch.equal(seen.sort().values, plain.sort().values)
        if pool == 1:  # the plain batches, visited in another order
            assert sorted(map(tuple, (b.sort().values.tolist() for b in batches))) == sorted(
                tuple(plain[i * batch : (i + 1) * batch].sort().values.tolist()) for i in range(per_epoch))
    # within a pool batches are sorted by length, so a batch spans far fewer lengths
    spans = [lengths[b].max() - lengths[b].min() for b in batches_of(lengths, batch, pool=4, per_epoch=per_epoch)]
    plain_spans = [lengths[b].max() - lengths[b].min() for b in batches_of(lengths, batch, pool=1, per_epoch=per_epoch)]
    assert sum(spans) < 0.5 * sum(plain_spans)
    # a pure function of (seed, step): a resumed run draws the same batch
    assert torch.equal(bucketed_indices(lengths, batch, 7, 5, 4), bucketed_indices(lengths, batch, 7, 5, 4))
    assert not torch.equal(bucketed_indices(lengths, batch, 7, 5, 4), bucketed_indices(lengths, batch, 8, 5, 4))
    with pytest.raises(ValueError, match="pool"):
        bucketed_indices(lengths, batch, 7, 1, 0)


def batches_of(lengths, batch, *, pool, per_epoch):
    from flt.tasks.base import bucketed_indices

    return [bucketed_indices(lengths, batch, 3, i + 1, pool) for i in range(per_epoch)]


def test_the_task_buckets_training_batches_and_sorts_a_full_validation_pass(tmp_path, monkeypatch):
    from flt.tasks import get_task

    monkeypatch.setenv("FLT_CACHE_DIR", str(tmp_path / "cache"))
    kw = {"num_train": 64, "num_valid": 20, "min_length": 30, "max_length": 120}
    plain, bucketed = get_task("listops")(**kw), get_task("listops")(bucket=4, **kw)
    widths = [bucketed.train_batch(s, 8, 0, 0, 1)[0].shape[1] for s in range(1, 9)]
    plain_widths = [plain.train_batch(s, 8, 0, 0, 1)[0].shape[1] for s in range(1, 9)]
    assert sum(widths) < sum(plain_widths)
    # the two ranks of a 2-process run split the same global batch
    whole = bucketed.train_batch(3, 8, 0, 0, 1)[2]
    halves = torch.cat([bucketed.train_batch(3, 8, 0, r, 2)[2] for r in (0, 1)])
    assert torch.equal(whole, halves)
    full = list(bucketed.eval_batches(6, None, 0, 1))
    assert sum(b[2].numel() for b in full) == 20
    assert [b[0].shape[1] for b in full] == sorted(b[0].shape[1] for b in full)
    assert sorted(torch.cat([b[2] for b in full]).tolist()) == sorted(bucketed.valid.labels.tolist())
    first = next(iter(bucketed.eval_batches(6, 1, 0, 1)))  # a partial pass keeps the stored order
    assert torch.equal(first[2], bucketed.valid.labels[:6])
    with pytest.raises(ValueError, match="bucket"):
        get_task("listops")(bucket=-1, **kw)


def test_small_preset_is_the_benchmark_on_shorter_expressions():
    import inspect

    from flt.tasks import get_preset, get_task

    small, base = get_preset("listops", "small", "flt"), get_preset("listops", "base", "flt")
    long = get_preset("listops", "long", "flt")
    assert (small.data["min_length"], small.data["max_length"]) == (100, 300)
    assert long.model == small.model and long.run.steps == small.run.steps and long.run.batch_size == 16
    assert "min_length" not in long.data and long.data["bucket"] > 0
    assert small.run.draw_gap and long.run.draw_gap and base.run.draw_gap  # up to 2000 tokens the exact evaluation fits
    spec = inspect.signature(get_task("listops")).parameters
    assert (spec["min_length"].default, spec["max_length"].default) == (500, 2000)
    assert (spec["max_depth"].default, spec["max_args"].default) == (10, 10)
    for preset in (small, long, base):  # depth and arguments are the benchmark's; base also its lengths
        assert "max_depth" not in preset.data and "max_args" not in preset.data
    assert "min_length" not in base.data and "max_length" not in base.data


def test_flt_band_term_tells_left_from_right():
    """The root of an expression is its first token; with positions as offsets only, a model
    finds it by direction (no key on its left). FLT's spectra are even, so its listops
    default carries T5 buckets over the band's signed offsets."""
    from flt.tasks import get_preset, get_task

    cfg = get_preset("listops", "small", "flt").model
    model = get_task("listops").build_model(cfg, dtype=torch.float64)
    attn = model.trunk.blocks[0].attn
    t = torch.arange(1, attn.near_field + 1, dtype=torch.float64).view(-1, 1)
    torch.testing.assert_close(attn.spectrum.of_offsets(-t), attn.spectrum.of_offsets(t), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        attn.near_spectrum.table.normal_()
    left, right = attn.near_spectrum.of_offsets(-t), attn.near_spectrum.of_offsets(t)
    assert (left - right).abs().min() > 0
