"""Fuzzing the inputs a user controls: every option of the attention mechanisms and their
spectra, the fields of the run and model configs, and malformed data files.

The property is the same everywhere: a value is accepted, or refused with a ``ValueError``
or ``TypeError`` whose message names the option (or the file), quickly; never another
exception type (an overflow, an out-of-memory error, a codec error) and never a hang
(each example has a deadline). Sizes that would not fit in memory are part of the draw:
they must be refused by their estimate (:mod:`flt._limits`), not allocated.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flt.data.errors import DataError
from flt.layers.registry import ATTENTION
from flt.models.config import ImageConfig, LMConfig, MoleculeConfig
from flt.options import ATTENTION_ARGUMENTS, constructor_options
from flt.relative.spectra import SPECTRA
from flt.tasks.preset import RunConfig

#: Values of every kind a ``KEY=VALUE`` flag or a Python caller may give: small and huge
#: ints, floats with NaN, infinities and 1e30, bools, strings, lists, None.
VALUES = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, 7, 10**9, 10**12, 10**18, 2**63]),
    st.integers(min_value=-5, max_value=64),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, -1.0, 0.0, 0.5, 1e-30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.sampled_from(["", "none", "local", "favor+", "relu", "t5", "alibi", "gaussian", "sdpa", "iid", "qmc"]),
    st.lists(st.one_of(st.integers(-2, 6), st.floats(allow_nan=True, allow_infinity=True)), max_size=3),
)

@pytest.fixture(autouse=True, scope="module")
def small_memory_limit():
    """A fixed limit, so that what is refused does not depend on the machine's free RAM, and
    small, so that what is accepted builds in milliseconds."""
    old = os.environ.get("FLT_MEMORY_LIMIT")
    os.environ["FLT_MEMORY_LIMIT"] = "256M"
    yield
    if old is None:
        del os.environ["FLT_MEMORY_LIMIT"]
    else:
        os.environ["FLT_MEMORY_LIMIT"] = old


#: (mechanism, option, spectrum or None) for every option a layer or its spectrum takes.
ATTENTION_CASES = [
    (name, option, None)
    for name, cls in ATTENTION.items()
    for option in constructor_options(cls).params
    if option not in (*ATTENTION_ARGUMENTS, "feature_dim")
] + [
    ("flt", option, spectrum)
    for spectrum, cls in SPECTRA.items()
    for option in constructor_options(cls).params
    if option not in ("heads", "pos_dim", "num_frequencies", "device", "dtype")
]

FAST = settings(max_examples=400, deadline=20000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _accepted_or_named(build, name: str) -> None:
    try:
        build()
    except (ValueError, TypeError) as err:
        assert name in str(err), f"the error does not name {name!r}: {err}"


def _build_attention(case, value) -> None:
    mechanism, option, spectrum = case
    options = {option: value}
    if spectrum is not None:
        options["spectrum"] = spectrum
        if spectrum in ("gaussian_mixture", "local"):
            options.setdefault("num_frequencies", 8)
    _accepted_or_named(lambda: ATTENTION[mechanism].from_options(16, 2, **options), option)


@settings(max_examples=60, deadline=20000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=st.sampled_from(ATTENTION_CASES), value=VALUES)
def test_every_attention_option_is_accepted_or_refused_by_name(case, value):
    _build_attention(case, value)


#: The values that broke constructors before: zero, negatives, huge counts, an int past
#: int64, NaN, infinities, 1e30, bools, None, strings, lists.
NASTY = [0, -1, 3, 10**9, 10**12, 2**63, float("nan"), float("inf"), -float("inf"), 1e30, 1e-30, True, None, "", "x",
         [1, 2], [float("nan")]]


@pytest.mark.slow
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(str(x) for x in c if x))
def test_every_attention_option_with_every_nasty_value(case):
    """All options times :data:`NASTY`, exhaustively (about 90 s)."""
    for value in NASTY:
        _build_attention(case, value)


CONFIGS = [(cls, f.name) for cls in (RunConfig, LMConfig, ImageConfig, MoleculeConfig) for f in dataclasses.fields(cls)]


@FAST
@given(case=st.sampled_from(CONFIGS), value=VALUES)
def test_every_config_field_is_accepted_or_refused_by_name(case, value):
    cls, field = case
    _accepted_or_named(lambda: cls(**{field: value}), field)


@settings(max_examples=60, deadline=20000, derandomize=True)
@given(field=st.sampled_from(["dim", "depth", "heads", "num_features", "num_frequencies", "near_field", "batch_size"]),
       size=st.sampled_from([10**9, 10**12, 10**18]))
def test_huge_sizes_are_refused_by_the_memory_estimate_before_allocation(field, size):
    from flt._limits import MemoryLimitError
    from flt.models.memory import check_model_memory

    cfg_fields = {"dim": 32, "depth": 2, "heads": 2}
    batch = 8
    options = {"num_features": 16, "num_frequencies": 8, "spectrum": "local"}
    if field in cfg_fields:
        cfg_fields[field] = size * cfg_fields["heads"] if field == "dim" else size
        if field == "heads":
            cfg_fields["dim"] = size
    elif field == "batch_size":
        batch = size
    else:
        options[field] = size
    cfg = LMConfig(**cfg_fields, max_len=64, attention="flt", attention_options=options)
    with pytest.raises(MemoryLimitError, match="needs about .* more than"):
        check_model_memory(cfg, batch=batch, length=64, training=True)


# -- malformed files ---------------------------------------------------------------------

MUTATIONS = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("empty"), st.none()),
    st.tuples(st.just("non_utf8"), st.floats(0, 1)),
    st.tuples(st.just("garbage"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("huge_count"), st.sampled_from([10**9, 10**12, 10**40, -5])),
    st.tuples(st.just("wrong_count"), st.integers(0, 9)),
)


def _mutate(data: bytes, mutation) -> bytes:
    kind, arg = mutation
    if kind == "truncate":
        return data[: int(len(data) * arg)]
    if kind == "empty":
        return b""
    if kind == "non_utf8":
        i = int(len(data) * arg)
        return data[:i] + b"\xff\xfe\x80" + data[i:]
    if kind == "garbage":
        return arg
    # Counts: the first integer of the file (a header's atom count, a node id) replaced.
    text = data.decode("utf-8", errors="replace")
    digits = next((i for i, c in enumerate(text) if c.isdigit()), None)
    if digits is None:
        return data
    end = digits
    while end < len(text) and text[end].isdigit():
        end += 1
    return (text[:digits] + str(arg) + text[end:]).encode()


def _loads_or_names_file(load, path: str) -> None:
    try:
        load(path)
    except (ValueError, TypeError) as err:  # DataError is a ValueError
        assert os.path.basename(path) in str(err), f"the error does not name the file: {err}"


FILES = settings(max_examples=60, deadline=20000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                 derandomize=True)


def _fuzz_file(tmp_path, name: str, valid: bytes, mutation, load) -> None:
    path = tmp_path / name
    path.write_bytes(_mutate(valid, mutation))
    _loads_or_names_file(load, str(path))


@FILES
@given(mutation=MUTATIONS)
def test_xyz_files(tmp_path, mutation):
    pytest.importorskip("ase")
    from flt.data.molecules import load_ase

    valid = b"2\nProperties=species:S:1:pos:R:3 energy=-1.5\nH 0.0 0.0 0.0\nH 0.0 0.0 0.74\n" * 2
    _fuzz_file(tmp_path, "mol.xyz", valid, mutation, load_ase)


@FILES
@given(mutation=MUTATIONS)
def test_listops_tsv_files(tmp_path, mutation):
    from flt.data.listops import read_tsv

    valid = b"Source\tTarget\n( ( [MAX 2 ) 9 ] )\t9\n[SM 1 2 3 ]\t6\n"
    _fuzz_file(tmp_path, "basic_train.tsv", valid, mutation, read_tsv)


@FILES
@given(mutation=MUTATIONS)
def test_edge_list_files(tmp_path, mutation):
    from flt.graphs.data import load_edge_list

    _fuzz_file(tmp_path, "graph.txt", b"# edges\n0 1\n1 2\n2 3 0.5\n", mutation, load_edge_list)


@FILES
@given(mutation=MUTATIONS)
def test_text_files(tmp_path, mutation):
    from flt.data.text import load_text_files

    _fuzz_file(tmp_path, "corpus.txt", ("hello wörld " * 40).encode(), mutation, load_text_files)


@FILES
@given(mutation=MUTATIONS)
def test_pyg_files(tmp_path, mutation):
    from flt.graphs.data import load_pyg

    buffer = tmp_path / "valid.pt"
    torch.save({"edge_index": torch.tensor([[0, 1, 2], [1, 2, 3]]), "num_nodes": 4}, buffer)
    _fuzz_file(tmp_path, "graph.pt", buffer.read_bytes(), mutation, load_pyg)


@FILES
@given(mutation=MUTATIONS, protocol=st.sampled_from([2, 4]))
def test_cifar_batch_files(tmp_path, mutation, protocol):
    from flt.data.images import _read_cifar_batch

    valid = pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, protocol=protocol)
    _fuzz_file(tmp_path, "data_batch_1", valid, mutation, lambda p: _read_cifar_batch(p, 10))


@FILES
@given(mutation=MUTATIONS)
def test_molecule_cache_files(tmp_path, mutation):
    pytest.importorskip("ase")
    from flt.data import molecules

    params = molecules._cache_params(2, 0, 0, 0.05)
    path = tmp_path / "valid.npz"
    np.savez(path, params=np.asarray(params), z=np.array([1, 1]), pos=np.zeros((2, 3)), offsets=np.array([0, 1, 2]),
             y=np.zeros(2), **{f"info_{k}": np.zeros(2) for k in molecules._INFO_KEYS})
    _fuzz_file(tmp_path, "cache.npz", path.read_bytes(), mutation, lambda p: molecules._load_cache(p, params))


def test_the_mutations_reach_the_loaders_checks(tmp_path):
    """The fuzzers above are not vacuous: each kind of damage makes a loader refuse."""
    from flt.data.listops import read_tsv

    path = tmp_path / "basic_train.tsv"
    valid = b"Source\tTarget\n[SM 1 2 3 ]\t6\n"
    for mutation in (("empty", None), ("non_utf8", 0.5), ("truncate", 0.3)):
        path.write_bytes(_mutate(valid, mutation))
        with pytest.raises(DataError, match="basic_train.tsv"):
            read_tsv(str(path))
    assert _mutate(b"2\nx", ("huge_count", 10**9)) == b"1000000000\nx"
    assert zipfile  # the cache fuzzer's archives are zip files
