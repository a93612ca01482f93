"""Shared test helpers: one float-tolerance table and deterministic seeds."""

from __future__ import annotations

import os

import pytest
import torch

# Triton decides when it is first imported whether kernels compile for a GPU or run in its
# CPU interpreter; without CUDA the kernel tests (tests/library/test_ops_triton.py) need the latter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker would start as many torch threads as the machine has cores:
# on 2 cores, -n 2 then runs 4 busy threads, and the library suite took 155 s instead of 87 s.
# Each worker gets its share of the cores instead, and so do the processes it starts (the CLI
# and torchrun tests), through OMP_NUM_THREADS, unless the caller set it.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _share = max(1, _cores // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

#: (rtol, atol) per dtype for comparisons of a fast path with its reference.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (1e-2, 1e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None, scale: float = 1.0, msg: str = "") -> None:
    """Compare with the per-dtype tolerance; ``scale`` loosens both tolerances."""
    dtype = dtype or expected.dtype
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol * scale, atol=atol * scale, msg=msg or None)


def assert_same_gradients(out: torch.Tensor, ref: torch.Tensor, inputs, *, exact_dtype: bool = False) -> tuple:
    """``out`` and ``ref`` agree (:func:`assert_close`), and so do their gradients for one
    random upstream gradient with respect to ``inputs`` (``None`` on both sides or neither;
    ``exact_dtype``: each pair of gradients also has one dtype, which :func:`assert_close`
    alone would not see). Returns the gradients of ``out``, for further checks."""
    assert_close(out, ref)
    inputs = list(inputs)
    up = torch.randn_like(out)
    g_out = torch.autograd.grad((out * up).sum(), inputs, retain_graph=True, allow_unused=True)
    g_ref = torch.autograd.grad((ref * up).sum(), inputs, allow_unused=True)
    for a, b in zip(g_out, g_ref, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert not exact_dtype or a.dtype == b.dtype, f"gradient dtype {a.dtype}, reference {b.dtype}"
            assert_close(a, b)
    return g_out


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny models are fastest on one, and several OpenMP
    threads on a busy machine can be a hundred times slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def attention_checks(monkeypatch):
    """The option sets checked for an attention mechanism from here on, one dict per check,
    whichever entry point checks them (:func:`flt.options.check_attention_options` and
    ``AttentionBase.from_options`` both go through ``flt.layers.base.check_options``)."""
    import flt.layers.base as base

    checked: list[dict] = []
    real = base.check_options

    def counting(owner, cls, options, **kwargs):
        if owner.startswith("attention"):
            checked.append(dict(options))
        return real(owner, cls, options, **kwargs)

    monkeypatch.setattr(base, "check_options", counting)
    return checked


@pytest.fixture
def isolated_cli(monkeypatch, tmp_path, one_thread):
    """For tests that run flt's commands: one thread, and the generated-data caches in the
    test's own folder."""
    monkeypatch.setenv("FLT_CACHE_DIR", str(tmp_path / "cache"))
    yield


class Killed(Exception):
    """Raised by :func:`kill_at`'s hook: a trainer stopped as a kill would stop it."""


def kill_at(step):
    """An ``on_step`` hook that raises :class:`Killed` after ``step``."""

    def hook(s):
        if s == step:
            raise Killed

    return hook


def random_rotation(seed: int | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A uniformly random proper rotation ``[3, 3]`` (QR of a Gaussian matrix, signs fixed,
    determinant +1), from a generator seeded with ``seed`` (None: torch's global one)."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q.to(dtype)
