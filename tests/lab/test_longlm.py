"""The long-context byte LM: the stdlib source corpus and its file-disjoint split, the smoke
preset, and constant-memory decoding of FLT's banded estimator against the full forward."""

from __future__ import annotations

import json

import pytest
import torch

from flt.data.errors import DataError
from flt.data.pysource import EXCLUDED_DIRS, load_python_source, source_files, split_files, stdlib_dir
from flt.layers.band_decode import BandDecodeState
from flt.layers.flt import FLTAttention


def make_tree(root, names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"# {name}\n".encode() * 20)


def test_the_stdlib_corpus_is_split_by_file_deterministically():
    files = source_files()
    assert len(files) > 300 and all(f.endswith(".py") for f in files)
    assert not any(part in EXCLUDED_DIRS for f in files for part in f.split("/")[:-1])
    train, valid = split_files(files, 0.1, seed=0)
    assert set(train).isdisjoint(valid) and sorted(train + valid) == files
    assert 0.04 < len(valid) / len(files) < 0.2
    assert split_files(files, 0.1, seed=0) == (train, valid)
    other = split_files(files, 0.1, seed=1)[1]
    assert other != valid
    # A file's side depends on its path alone: dropping other files moves no file.
    half = files[::2]
    assert split_files(half, 0.1, seed=0)[1] == [f for f in valid if f in set(half)]


def test_the_splits_hold_the_bytes_of_their_files(tmp_path):
    names = [f"pkg{i % 3}/mod{i}.py" for i in range(40)] + ["test/skip.py", "site-packages/x/y.py", "notes.txt"]
    make_tree(tmp_path, names)
    splits = load_python_source(root=tmp_path, valid_fraction=0.25, seed=0)
    assert "test/skip.py" not in splits.train_files + splits.valid_files
    assert len(splits.train_files) + len(splits.valid_files) == 40
    assert set(splits.train_files).isdisjoint(splits.valid_files) and splits.valid_files
    valid_text = bytes(splits.valid.tolist()).decode()
    for name in splits.valid_files:
        assert f"# {name}\n" in valid_text
    for name in splits.train_files:
        assert f"# {name}\n" not in valid_text
    capped = load_python_source(root=tmp_path, valid_fraction=0.25, seed=0, max_bytes=1000)
    assert capped.train.numel() + capped.valid.numel() == 1000
    assert torch.equal(capped.valid, splits.valid[: capped.valid.numel()])


def test_bad_corpus_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="valid_fraction"):
        split_files(["a.py"], 1.5)
    with pytest.raises(ValueError, match="max_bytes"):
        load_python_source(max_bytes=1)
    with pytest.raises(DataError, match="not a directory"):
        source_files(tmp_path / "missing")
    make_tree(tmp_path, ["only.py"])
    with pytest.raises(DataError, match="empty split"):
        load_python_source(root=tmp_path)
    assert stdlib_dir()


@pytest.mark.cli
def test_smoke_preset_trains_in_seconds(tmp_path):
    from flt.cli import main

    out = tmp_path / "run"
    code = main(["train", "longlm", "--preset", "smoke", "--out-dir", str(out), "--no-progress", "--no-plots",
                 "--threads", "1", "--run-opt", "steps=4", "--run-opt", "eval_every=4", "--run-opt", "checkpoint_every=4",
                 "--data-opt", "max_bytes=60000", "--model-opt", "max_len=256"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "longlm" and summary["steps"] == 4
    assert 0.0 < summary["final"]["bpb"] < 9.0  # untrained: 8 bits per byte


def banded_layer(width, *, rope=False, seed=0, **kw):
    layer = FLTAttention.from_options(16, 2, causal=True, spectrum="local", num_features=8, num_frequencies=4, near_field=width,
                         seed=seed, rope=rope, amplitude=1.0, dtype=torch.float64, **kw).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in layer.near_spectrum.parameters():  # a near-field bias that is not zero
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return layer


@pytest.mark.parametrize("width, length, rope", [(3, 20, False), (1, 9, True), (5, 4, False), (8, 40, False)])
def test_band_decoding_equals_the_full_forward_in_float64(width, length, rope):
    layer = banded_layer(width, rope=rope)
    x = torch.randn(2, length, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    full = layer(x)
    state, outs = None, []
    for t in range(length):
        y, state = layer.step(x[:, t], state)
        outs.append(y)
    torch.testing.assert_close(torch.stack(outs, 1), full, rtol=1e-10, atol=1e-12)
    # Constant memory: the ring buffer holds w + 1 tokens whatever the length.
    assert isinstance(state, BandDecodeState) and state.position == length
    assert state.xk.shape[2] == state.v.shape[2] == state.pos.shape[1] == width + 1
    assert state.kv.shape[-2:] == (8, 8)


def test_band_decoding_with_given_positions_and_a_large_logit_scale():
    layer = banded_layer(2, temperature=30.0)  # exponents far beyond exp's float range without the shifts
    x = torch.randn(1, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    pos = torch.cumsum(torch.rand(1, 12, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) + 0.5, 1)
    full = layer(x, pos)
    state, outs = None, []
    for t in range(12):
        y, state = layer.step(x[:, t], state, pos[0, t])
        outs.append(y)
    out = torch.stack(outs, 1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, full, rtol=1e-9, atol=1e-11)


def test_band_decoding_checks_its_inputs():
    layer = banded_layer(2)
    with pytest.raises(ValueError, match=r"x must"):
        layer.step(torch.randn(2, 3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="BandDecodeState"):
        layer.step(torch.randn(2, 16, dtype=torch.float64), state=object())
    _, state = layer.step(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="batch 2"):
        layer.step(torch.randn(3, 16, dtype=torch.float64), state)
    bidirectional = FLTAttention.from_options(16, 2, near_field=2, dtype=torch.float64)
    with pytest.raises(ValueError, match="causal=True"):
        bidirectional.step(torch.randn(2, 16, dtype=torch.float64))


def test_the_crossover_is_interpolated_between_measured_lengths():
    from flt.bench.long import crossover, report

    rows = [{"mechanism": "flt", "n": n, "ms_per_step": t, "spread": 0.1, "peak_mib": 10.0 * n / 1024}
            for n, t in ((1024, 400.0), (2048, 800.0), (4096, 1600.0))]
    rows += [{"mechanism": "softmax+t5", "n": n, "ms_per_step": t, "spread": 0.1, "peak_mib": 5.0 * (n / 1024) ** 2}
             for n, t in ((1024, 100.0), (2048, 400.0), (4096, 1600.0))]
    assert crossover(rows, "flt", "softmax+t5") == pytest.approx(4096.0)  # equal there, slower below
    rows[-1]["ms_per_step"] = 3200.0  # ratio 2 at 2048, 1/2 at 4096: equal halfway in log N
    assert crossover(rows, "flt", "softmax+t5") == pytest.approx(2048 * 2**0.5)
    assert crossover(rows, "flt", "softmax+t5", "peak_mib") == pytest.approx(2048.0)
    assert crossover(rows, "flt", "softmax+spectrum") is None
    text = report(rows, "header")
    assert "| flt | 400 (spread 10%) | 10 |" in text and "softmax+t5's from N = 2896" in text


def test_the_presets_flt_layers_start_at_temperature_16():
    # The preset's FLT normalises queries and keys; a learned temperature of 1 would bound its
    # logits to [-1, 1]. ATTENTION_DEFAULTS must reach every layer of the built model.
    from flt.tasks.longlm import ATTENTION_DEFAULTS, LongLMTask, small

    assert ATTENTION_DEFAULTS["flt"]["temperature"] == 16.0
    model = LongLMTask.build_model(small().model)
    layers = [m for m in model.modules() if isinstance(m, FLTAttention)]
    assert len(layers) == 2
    for layer in layers:
        assert layer.near_field == 16 and layer.scaling.qk_norm
        assert torch.allclose(layer.scaling.log_temperature.exp(), torch.full((2,), 16.0))
        x = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(0))
        q, k = layer.scaling(x.view(1, 8, 2, 32).transpose(1, 2), x.view(1, 8, 2, 32).transpose(1, 2))
        logits = q @ k.transpose(-1, -2)  # t cos(q, k): the diagonal is t
        assert torch.allclose(logits.diagonal(dim1=-2, dim2=-1), torch.full((1, 2, 8), 16.0), atol=1e-4)
