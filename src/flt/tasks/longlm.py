"""``longlm``: a byte-level causal language model with contexts of 1024 to 8192 bytes.

The corpus is the Python standard library's own source (:func:`flt.data.pysource.load_python_source`,
12.1 MB in 734 files on CPython 3.11.7, train and validation split by file), so nothing is
downloaded. Everything else (the model, the loss, bits per byte, generation) is the ``lm``
task's; only the data and the presets differ. Data options: ``max_bytes`` (cap on the
corpus), ``valid_fraction``, ``test_fraction`` (default 0.1: training files moved to a
held-out test split, :func:`flt.data.pysource.load_python_source`), ``split_seed``. The context is the model config's ``max_len``
(``--model-opt max_len=4096``).

The presets turn the draw gap off (``--run-opt draw_gap=true`` turns it on): its exact
attention evaluates the spectrum on all ``N^2`` offsets, 6 s per 1024-byte window on the
2-core VM and gigabytes of memory at 4096. ``flt evaluate RUN --max-batches 8
--exact-max-elements 67108864`` measures it on a saved run (docs/long_context.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from flt.data import ByteTokenizer
from flt.data.pysource import load_python_source
from flt.models import LMConfig
from flt.tasks.base import Presets, Task, mechanism_options
from flt.tasks.lm import LMTask, as_causal_lm, generate_text
from flt.tasks.preset import Preset, RunConfig

#: As for ``lm``: FLT with the banded estimator (``near_field=16``: the last 16 bytes exact,
#: a learned local spectrum beyond) and a local spectrum; Performer and Toeplitz-FFT with
#: FLT's number of random features; softmax with T5 buckets (its relative bias).
#: FLT's queries and keys are L2-normalised (``qk_norm``, on for FAVOR+) with a learned
#: temperature per head that starts at 16 (the layer's default: 1): its logits ``t cos(q, k)``
#: start as sharp as softmax's can be, where ``t = 1`` bounds them to ``[-1, 1]`` (nearly
#: uniform attention) and 40 steps do not learn a large ``t``. At the small preset's budget
#: this took FLT from 4.634 to 4.392 bits per byte at a peak learning rate of 3e-3 and from
#: 4.634 to 4.310 (seed 0) at 1e-2 (docs/long_context.md).
ATTENTION_DEFAULTS: dict[str, dict[str, Any]] = {
    "flt": {"spectrum": "local", "num_features": 64, "num_frequencies": 16, "amplitude": 1.0, "near_field": 16,
            "temperature": 16.0},
    "performer": {"num_features": 64},
    "toeplitz": {"num_features": 64, "max_distance": 8192},
    "softmax": {"relative_bias": "t5"},
}
POSENC_DEFAULTS: dict[str, dict[str, Any]] = {"shifted_basis": {"domain": [0.0, 8192.0]}}


def smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train longlm --preset smoke``: 8 steps of a 1-layer width-32 byte model with a
    512-byte context (shorter than the task's 1k-8k, so that it runs in seconds) on 300 kB
    of the stdlib source. About 5 s on the 2-core VM with one other job (1 min under a load
    average of 18); validation bpb 7.51 (7.35 with the layer's default temperature 1,
    ``--attention flt:temperature=1.0``; untrained: 8)."""
    model = LMConfig(dim=32, depth=1, heads=2, max_len=512, mlp_ratio=2.0, **mechanism_options(LongLMTask, attention, posenc))
    run = RunConfig(steps=8, batch_size=2, lr=3e-3, warmup_steps=2, eval_every=8, eval_batches=2,
                    checkpoint_every=8, log_every=2, draw_gap=False)
    return Preset(LongLMTask.name, model, run, {"max_bytes": 300_000})


def small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train longlm --preset small``: 2 layers, width 64, context 4096 bytes, 40 steps
    of one window on 1 MB of the stdlib source (validation: the 24 windows of its 0.1 MB):
    the short budget of docs/long_context.md's FLT-against-exact comparison; peak learning
    rate 1e-2, the best of 2e-3 to 2e-2 for both FLT and exact softmax + T5 (seed 0). About
    15 s with FLT on the 2-core VM with one other job (0.18-0.19 s/step, ``--threads 1``;
    0.68 s/step under a load average of 15), validation bpb 4.31 (seed 0); with exact
    softmax + T5 about 3.5 min (3.6-3.7 s/step; 8-12 s/step under that load), bpb 4.32."""
    model = LMConfig(dim=64, depth=2, heads=2, max_len=4096, mlp_ratio=2.0, **mechanism_options(LongLMTask, attention, posenc))
    run = RunConfig(steps=40, batch_size=1, lr=1e-2, warmup_steps=5, eval_every=40, eval_batches=4,
                    checkpoint_every=40, log_every=5, draw_gap=False)
    return Preset(LongLMTask.name, model, run, {"max_bytes": 1_000_000})


def base(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train longlm --preset base``: 4 layers, width 128, context 8192 bytes, 2000
    steps of 4 windows on the whole corpus. Not run to the end on the 2-core VM: its first 6
    steps with FLT (idle, 2 threads, seed 0) took 10.5 s/step median, 11.9 s/step on
    average, peak RSS 6.2 GiB. About 6-7 h of training (a projection, not a measured run
    time; no bits per byte measured). Exact softmax + T5 was not tried: one window of the
    small model at 8192 bytes already peaks at 4.0 GiB (docs/long_context.md), and this
    model has 16 times its heads x layers x windows."""
    model = LMConfig(dim=128, depth=4, heads=4, max_len=8192, **mechanism_options(LongLMTask, attention, posenc))
    run = RunConfig(steps=2000, batch_size=4, lr=2e-3, warmup_steps=100, eval_every=250, eval_batches=16,
                    checkpoint_every=250, log_every=20, draw_gap=False)
    return Preset(LongLMTask.name, model, run, {})


class LongLMTask(LMTask):
    """Next-byte prediction over long contexts of Python source."""

    name = "longlm"
    description = "long-context byte LM (1k-8k bytes); bundled data: the Python standard library's source, split by file"
    config_key = LMTask.name  # its checkpoints hold an LMConfig, saved as the lm task's
    options = ("max_bytes", "valid_fraction", "test_fraction", "split_seed")
    bundled_options, path_options = ("max_bytes",), ()
    dataset = staticmethod(load_python_source)
    presets: ClassVar[Presets] = {"smoke": smoke, "small": small, "base": base}
    attention_defaults, posenc_defaults = ATTENTION_DEFAULTS, POSENC_DEFAULTS
    # Not searched (yet): its held-out part and search presets are not chosen.
    holdout_split = Task.holdout_split

    def __init__(self, *, max_bytes: int | None = None, valid_fraction: float = 0.1, test_fraction: float = 0.1,
                 split_seed: int = 0) -> None:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")
        splits = load_python_source(max_bytes=max_bytes, valid_fraction=valid_fraction, seed=split_seed, test_fraction=test_fraction)
        self.tokenizer_name = "byte"
        self.tokenizer = ByteTokenizer()
        assert splits.test is not None, "test_fraction > 0 (checked above) gives a test split"
        self.train_tokens, self.valid_tokens, self.test_tokens = splits.train, splits.valid, splits.test
        self.token_bytes = torch.ones(256, dtype=torch.float64)
        self.files = (len(splits.train_files), len(splits.valid_files), len(splits.test_files))

    def report(self, model: nn.Module, device: torch.device) -> str:
        prompt = "def "
        text = generate_text(as_causal_lm(model), self.tokenizer, prompt, 64, device=device, temperature=0.8, top_k=40, seed=0)
        return f"sample (prompt {prompt!r}, temperature 0.8, top-k 40):\n{text}"
