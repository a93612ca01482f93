"""Bad input gets a clear, early error: sizes bounded before allocation, nothing silently
accepted, messages that name the option, the file and the line."""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import pytest
import torch

from flt import ATTENTION
from flt._io import file_mode
from flt._limits import MemoryLimitError, check_memory, memory_limit, parse_bytes
from flt.data.errors import DataError
from flt.models.config import LMConfig
from flt.models.memory import model_bytes
from flt.tasks.preset import RunConfig


@pytest.fixture
def limit(monkeypatch):
    """Set ``FLT_MEMORY_LIMIT`` for one test (a machine-independent limit)."""
    def set_limit(text: str) -> None:
        monkeypatch.setenv("FLT_MEMORY_LIMIT", text)
    return set_limit


# -- A. sizes bounded before allocation ---------------------------------------------------


def test_the_limit_comes_from_the_environment_variable_or_the_machine(limit):
    assert parse_bytes("8G") == 8 * 2**30 and parse_bytes("512M") == 512 * 2**20 and parse_bytes("1e6") == 10**6
    with pytest.raises(ValueError, match="FLT_MEMORY_LIMIT must be a number of bytes"):
        parse_bytes("lots")
    free, source = memory_limit()
    assert free > 0 and "RAM" in source
    limit("2G")
    assert memory_limit() == (2 * 2**30, "FLT_MEMORY_LIMIT")


def test_a_refusal_states_the_estimate_and_the_limit(limit):
    limit("1M")
    check_memory("a small thing", 2**19)
    with pytest.raises(MemoryLimitError, match=r"a big thing needs about 2 MiB, more than the 1 MiB of FLT_MEMORY_LIMIT; shrink it"):
        check_memory("a big thing", 2**21, hint="shrink it")


def test_the_attention_estimates_follow_each_mechanisms_closed_form():
    b, h, n, dv = 2, 3, 50, 8
    assert ATTENTION["softmax"].activation_values({}, batch=b, heads=h, length=n, head_dim=dv, training=False) == b * h * n * n
    m = 16
    performer = ATTENTION["performer"].activation_values({"num_features": m}, batch=b, heads=h, length=n, head_dim=dv, training=True)
    assert performer == 2 * (2 * b * h * n * m + b * h * m * dv)
    band = ATTENTION["flt"].activation_values({"num_features": m, "near_field": 4}, batch=b, heads=h, length=n, head_dim=dv, training=False)
    assert band == 2 * b * h * n * m + b * h * m * dv + 2 * b * h * n * 9
    # Training keeps every layer's activations; parameters get gradients and two moments.
    cfg = LMConfig(dim=32, depth=3, heads=2, attention="softmax")  # mlp_ratio 4
    train, infer = model_bytes(cfg, batch=4, length=64, training=True), model_bytes(cfg, batch=4, length=64, training=False)
    trunk, weights = 4 * 64 * 32 * (8 + 2 * 4), 4 * 2 * 64 * 64
    assert infer["activations"] == (trunk + weights) * 4
    assert train["activations"] == 3 * (trunk + 2 * weights) * 4
    assert train["parameters"] == 4 * infer["parameters"]


@pytest.mark.parametrize("option", ["num_features", "num_frequencies"])
def test_a_layer_too_large_for_memory_is_refused_before_it_allocates(option, limit):
    limit("1G")
    start = time.perf_counter()
    with pytest.raises(MemoryLimitError, match=rf"attention 'flt' \(dim=32, heads=2, {option}=1000000000\) needs about"):
        ATTENTION["flt"].from_options(32, 2, **{option: 10**9})
    assert time.perf_counter() - start < 30  # minutes before (the draws were allocated and orthogonalised)


@pytest.mark.parametrize("change", [{"dim": 2**30}, {"depth": 10**9}, {"batch_size": 10**9}])
def test_training_refuses_a_model_or_batch_that_cannot_fit_before_the_run_directory_exists(tmp_path, change, limit):
    import dataclasses

    from flt.tasks import get_preset
    from flt.train.loop import train

    limit("4G")
    preset = get_preset("lm", "smoke")
    preset = dataclasses.replace(preset, data={"max_bytes": 20_000})
    if "batch_size" in change:
        preset = dataclasses.replace(preset, run=dataclasses.replace(preset.run, **change))
    else:
        preset = dataclasses.replace(preset, model=dataclasses.replace(preset.model, **change))
    out = tmp_path / "run"
    with pytest.raises(MemoryLimitError, match=rf"training this model \(.*{next(iter(change))}={next(iter(change.values()))}"):
        train(preset, str(out), progress=False, plots=False)
    assert not out.exists()


def test_building_a_model_from_a_config_too_large_for_memory_is_refused(limit):
    from flt.tasks import get_task

    limit("1G")
    with pytest.raises(MemoryLimitError, match=r"building this model \(dim=1073741824, depth=1"):
        get_task("lm").build_model(LMConfig(dim=2**30, heads=2, depth=1))
    assert get_task("lm").build_model(LMConfig(dim=32, heads=2, depth=1)) is not None


def test_an_xyz_header_claiming_a_billion_atoms_is_refused_before_ase_reads_it(tmp_path):
    pytest.importorskip("ase")
    from flt.data.molecules import load_ase

    path = tmp_path / "big.xyz"
    path.write_text("1000000000\nenergy=1.0\nH 0 0 0\n")
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"big.xyz, line 1: frame 0 declares 1,000,000,000 atoms, but only 19 bytes follow"):
        load_ase(path)
    assert time.perf_counter() - start < 30  # minutes before (ASE parsed what the header claimed)
    # The second frame's header is checked too, with its own line number.
    path.write_text("1\nenergy=1.0\nH 0 0 0\n5\nenergy=2.0\nH 0 0 0\n")
    with pytest.raises(DataError, match=r"line 4: frame 1 declares 5 atoms"):
        load_ase(path)


def test_a_pyg_file_declaring_a_trillion_nodes_is_refused_by_its_memory(tmp_path, limit):
    from flt.graphs.data import load_pyg

    limit("1G")
    path = tmp_path / "g.pt"
    torch.save({"edge_index": torch.tensor([[0, 1, 2], [1, 2, 3]]), "num_nodes": 10**12}, path)
    with pytest.raises(MemoryLimitError, match=r"g.pt: 1,000,000,000,000 nodes \(its num_nodes\) needs about"):
        load_pyg(path)


def test_an_image_size_that_cannot_be_held_is_refused_before_resizing(tmp_path, limit):
    Image = pytest.importorskip("PIL.Image")
    from flt.data.images import load_image_folder

    limit("1G")
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for i in range(2):
            Image.new("RGB", (4, 4)).save(tmp_path / c / f"{i}.png")
    with pytest.raises(MemoryLimitError, match=r"4 images resized to size=\[100000, 100000\].*pass a smaller size"):
        load_image_folder(tmp_path, size=(100000, 100000))


def test_a_listops_row_that_makes_the_padded_table_too_large_is_refused(limit):
    from flt.data.listops import ListOpsData

    limit("100M")
    with pytest.raises(MemoryLimitError, match=r"100 expressions padded to the longest, 200,000 tokens"):
        ListOpsData.from_sequences([[1] * 200_000] + [[1, 2]] * 99, [0] * 100)


# -- B. nothing silently accepted ------------------------------------------------------


@pytest.mark.parametrize("field,value", [("lr", True), ("weight_decay", False), ("steps", 10.0), ("draw_gap", 1)])
def test_a_bool_is_no_number_and_a_float_no_int_in_the_run_config(field, value):
    with pytest.raises(TypeError, match=rf"RunConfig: {field} must be"):
        RunConfig(**{field: value})
    assert RunConfig(lr=1).lr == 1  # an int is a number


def test_model_config_fields_are_type_checked():
    with pytest.raises(TypeError, match="LMConfig: dropout must be a number, got True"):
        LMConfig(dropout=True)
    with pytest.raises(TypeError, match="LMConfig: cape must be a bool"):
        LMConfig(cape=1)
    with pytest.raises(ValueError, match="mlp_ratio must be a positive finite number"):
        LMConfig(mlp_ratio=float("inf"))


def test_data_options_are_type_checked_strictly(tmp_path):
    from flt.data.text import load_text_files
    from flt.tasks import change_data, load_task

    path = tmp_path / "t.txt"
    path.write_text("hello world " * 100)
    with pytest.raises(TypeError, match=r"data options of 'lm': option 'require_utf8' must be a bool \(true or false\), got 'maybe'"):
        load_task("lm", {"path": str(path), "require_utf8": "maybe"})
    with pytest.raises(TypeError, match="require_utf8 must be a bool"):
        load_text_files(path, require_utf8="maybe")
    with pytest.raises(TypeError, match=r"--data-opt: data options of 'image': option 'size' must be a list of ints"):
        change_data("image", {}, {"size": [8.5, 8]})


def test_a_model_field_that_the_data_sets_is_refused_when_given_otherwise():
    from flt.tasks.base import check_data_fields

    given = LMConfig(vocab_size=10)
    with pytest.raises(ValueError, match=r"vocab_size=10 was given, but the data sets vocab_size=256"):
        check_data_fields(given, LMConfig(vocab_size=256))
    check_data_fields(LMConfig(), LMConfig(vocab_size=80))  # the default is filled in from the data
    check_data_fields(LMConfig(vocab_size=80), LMConfig(vocab_size=80))


@pytest.mark.parametrize("name", ["flt", "performer"])
def test_chunk_size_zero_is_refused_by_name_and_none_is_the_default(name):
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, or None for the default .* got 0"):
        ATTENTION[name].from_options(16, 2, causal=True, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ATTENTION[name].from_options(16, 2, causal=True, chunk_size=-4)
    assert ATTENTION[name].from_options(16, 2, causal=True, chunk_size=None).core.chunk_size is None


def test_atom_positions_and_numbers_are_bounded(tmp_path):
    pytest.importorskip("ase")
    from flt.data.molecules import load_ase

    path = tmp_path / "far.xyz"
    path.write_text("2\nProperties=species:S:1:pos:R:3 energy=1.0\nH 0 0 0\nH 1e30 0 0\n")
    with pytest.raises(DataError, match=r"far.xyz: structure 0, atom 1 lies at \[1e\+30, 0.0, 0.0\] Å, beyond the 1e\+06 Å"):
        load_ase(path)
    path.write_text("2\nProperties=species:S:1:pos:R:3 energy=1.0\nH 0 0 0\nH 999999 0 0\n")
    assert load_ase(path).pos.abs().max() == pytest.approx(999999)
    path.write_text("1\nProperties=species:S:1:pos:R:3 energy=1.0\nX 0 0 0\n")
    with pytest.raises(DataError, match="atomic number 0"):
        load_ase(path)


# -- C. clear messages --------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, float("nan"), float("inf"), -2.0])
@pytest.mark.parametrize("option", ["length_scale", "length_spread"])
def test_gaussian_mixture_lengths_are_checked_by_name(option, value):
    with pytest.raises(ValueError, match=rf"{option} must be a positive finite number"):
        ATTENTION["flt"].from_options(16, 2, spectrum="gaussian_mixture", **{option: value})


@pytest.mark.parametrize("spectrum", ["local", "gaussian_mixture"])
def test_a_negative_number_of_frequencies_is_told_it_must_be_positive(spectrum):
    with pytest.raises(ValueError, match=r"^num_frequencies must be a positive integer, got -3$"):
        ATTENTION["flt"].from_options(16, 2, spectrum=spectrum, num_frequencies=-3)


def test_an_edge_id_beyond_int64_names_the_file_and_line(tmp_path):
    from flt.graphs.data import load_edge_list

    path = tmp_path / "e.txt"
    path.write_text("0 1\n1 1" + "0" * 40 + "\n")
    with pytest.raises(DataError, match=r"e.txt, line 2: node id 100000000000\.\.\.\(41 digits\) does not fit int64"):
        load_edge_list(path)


def test_a_pyg_node_count_must_be_an_integer(tmp_path):
    from flt.graphs.data import load_pyg

    path = tmp_path / "g.pt"
    torch.save({"edge_index": torch.tensor([[0, 1], [1, 60]]), "num_nodes": 61.0}, path)
    with pytest.raises(DataError, match=r"g.pt: num_nodes must be an integer, got 61.0 \(float\)"):
        load_pyg(path)
    torch.save({"edge_index": torch.tensor([[0, 1], [1, 60]]), "num_nodes": torch.tensor(61)}, path)
    assert load_pyg(path).num_nodes == 61


def _listops_dir(tmp_path, train: bytes):
    (tmp_path / "basic_train.tsv").write_bytes(train)
    (tmp_path / "basic_val.tsv").write_bytes(b"Source\tTarget\n[MAX 1 2 ]\t2\n")
    return tmp_path


def test_listops_files_are_validated_when_read_with_file_and_line(tmp_path):
    from flt.data.listops import load_listops_tsv

    root = _listops_dir(tmp_path, b"Source\tTarget\n[MAX 1 2 ]\t2\n\xff\xfe\t3\n")
    with pytest.raises(DataError, match=r"basic_train.tsv:3: not UTF-8 text"):
        load_listops_tsv(root)
    root = _listops_dir(tmp_path, b"Source\tTarget\n[MAX 1 2 ]\t2\n ( ) \t3\n")
    with pytest.raises(DataError, match=r"basic_train.tsv:3: the source expression is empty"):
        load_listops_tsv(root)


def test_a_bad_listops_file_fails_before_the_run_directory_exists(tmp_path):
    import dataclasses

    from flt.tasks import get_preset
    from flt.train.loop import train

    root = _listops_dir(tmp_path, b"Source\tTarget\n[MAX 1 2 ]\t2\n\t3\n")
    preset = get_preset("listops", "smoke")
    preset = dataclasses.replace(preset, data={"path": str(root)})
    with pytest.raises(DataError, match="the source expression is empty"):
        train(preset, str(tmp_path / "run"), progress=False, plots=False)
    assert not (tmp_path / "run").exists()


def test_listops_caches_get_the_permissions_of_a_plain_open(tmp_path):
    from flt.data.listops import load_listops

    load_listops(num_train=2, num_valid=2, min_length=10, max_length=40, cache_dir=tmp_path)
    modes = {os.stat(tmp_path / f).st_mode & 0o777 for f in os.listdir(tmp_path)}
    assert modes == {file_mode()}


def test_a_too_short_text_names_its_split_and_file(tmp_path):
    from flt.tasks import load_task

    train, valid = tmp_path / "train.txt", tmp_path / "valid.txt"
    train.write_text("x" * 100)
    valid.write_text("abc")
    task = load_task("lm", {"path": str(train), "valid_path": str(valid)})
    with pytest.raises(ValueError, match=rf"the valid split \({valid}\) has 3 tokens, fewer than the max_len \+ 1 = 33"):
        task.configure(LMConfig(dim=32, depth=1, heads=2, max_len=32))


def _cifar_batch(path, n: int, protocol: int) -> None:
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((n, 3072), np.uint8), b"labels": [0] * n}, f, protocol=protocol)


def test_an_empty_cifar_batch_is_called_empty_not_malicious(tmp_path):
    from flt.data.images import _read_cifar_batch

    path = tmp_path / "data_batch_1"
    _cifar_batch(path, 0, protocol=2)  # protocol 2 writes the empty buffer as a call of bytes()
    with pytest.raises(DataError, match=r"data_batch_1 holds 0 images"):
        _read_cifar_batch(str(path), 10)


def test_a_cifar_folder_without_its_meta_file_is_reported_as_cifar(tmp_path):
    from flt.tasks import load_task

    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        _cifar_batch(tmp_path / name, 2, protocol=2)
    with pytest.raises(DataError, match=r"CIFAR meta file not found: .*batches.meta"):
        load_task("image", {"path": str(tmp_path)})


def test_the_corrupt_molecule_cache_advice_works_from_the_command_line(tmp_path):
    pytest.importorskip("ase")
    from flt.data.molecules import catalysis_cache_path, load_catalysis

    path = catalysis_cache_path(4, cache_dir=tmp_path)
    with open(path, "wb") as f:
        f.write(b"garbage")
    with pytest.raises(DataError, match=r"is corrupt .*; delete that file and run again to regenerate it"):
        load_catalysis(4, cache_dir=tmp_path)
