"""``listops``: ListOps of the Long Range Arena, a classifier over 500-2000 tokens (the
``long`` and ``base`` presets; ``smoke`` and ``small``: ListOps-short, the same generator
on 100-300 tokens).

Data options: ``path`` (the LRA release: a directory with ``basic_train.tsv`` and
``basic_val.tsv``, or a ``*_train.tsv`` file; default: a set generated from the benchmark's
specification by :func:`flt.data.listops.load_listops`, cached), and for the generated set
``num_train``, ``num_valid``, ``seed``, ``min_length``, ``max_length``, ``max_depth``,
``max_args``; for either, ``bucket`` (default 0: off): training batches are drawn from
pools of that many batches sorted by length (:func:`flt.tasks.base.bucketed_indices`), so
a batch pads little. Positions are token indices (``P = 1``); batches are padded to their
longest sequence and the padding is masked out of attention and pooling. A full
validation pass visits the expressions in order of length (the sums do not depend on it).

Test split: for the generated set ``num_test`` (default ``num_valid``) further expressions
of the validation stream; for the LRA files ``basic_test.tsv`` when present, else
:data:`TEST_FRACTION` of all expressions carved from training. Validation is never touched.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from flt._checks import check_nonnegative_int, check_positive_int
from flt.data._split import carve_test
from flt.data.listops import NUM_CLASSES, VOCAB, ListOpsData, load_listops, load_listops_tsv
from flt.models import TokenModel, config_kwargs, replace_fields
from flt.models.config import LayeredConfig, TrunkConfig
from flt.tasks.base import (
    Presets,
    Task,
    bucketed_indices,
    epoch_indices,
    eval_slices,
    mechanism_options,
    shard,
)
from flt.tasks.preset import Preset, RunConfig

#: Expression lengths in tokens, ``(min_length, max_length)``: the benchmark's, the data
#: options' default (the ``long`` and ``base`` presets), and ListOps-short's (``smoke`` and
#: ``small``), which one CPU core trains in minutes.
BENCHMARK_LENGTHS = (500, 2000)
SHORT_LENGTHS = (100, 300)

#: ``(tokens [B, L], key_padding_mask [B, L] True = padding, labels [B])``.
ListOpsBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: FLT: the banded estimator, bidirectional: exact weights on the 64 nearest tokens on each
#: side with T5 buckets over the band's signed offsets (``near_relative="t5"``, softmax's
#: term), a learned local spectrum far away. Positions enter only as offsets, so finding an
#: expression's root (its first token) needs a term that tells left from right: the
#: spectra are even functions of the offset (unless shifted, ``shift=True``; that did not
#: help on 500-2000 tokens at this budget), the buckets are not. With a band of 16 the
#: ``small`` preset learns nothing beyond the bag of tokens (docs/long_context.md). The
#: other linear mechanisms get FLT's number of random features; softmax gets T5 buckets
#: (a relative bias, the exact counterpart); Toeplitz-FFT its relative table, computed by the
#: exact quadratic formula up to 2048 tokens (``dense_below``; the same function as its FFTs,
#: which transform ``m (Dv + 1)`` channels and were 5 times slower at 1024 tokens here;
#: runs started with the earlier default, 512, resume with ``--attn-opt dense_below=512``).
ATTENTION_DEFAULTS: dict[str, dict[str, Any]] = {
    "flt": {"spectrum": "local", "num_features": 64, "num_frequencies": 16, "amplitude": 1.0, "near_field": 64,
            "near_relative": "t5"},
    "performer": {"num_features": 64},
    "toeplitz": {"num_features": 64, "max_distance": 2048, "dense_below": 2048},
    "softmax": {"relative_bias": "t5"},
}
POSENC_DEFAULTS: dict[str, dict[str, Any]] = {"shifted_basis": {"domain": [0.0, 2048.0]}}


@dataclass(frozen=True)
class ListOpsConfig(LayeredConfig):
    """Sequence classifier (:class:`flt.models.TokenModel`): token embedding, bidirectional
    trunk, mean over the valid tokens, linear head. Positions are token indices."""

    vocab_size: int = len(VOCAB)
    num_classes: int = NUM_CLASSES

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("vocab_size", self.vocab_size)
        check_positive_int("num_classes", self.num_classes)


def smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train listops --preset smoke``: 30 steps of a 1-layer width-32 classifier on
    256 generated expressions of 100-300 tokens (shorter than the benchmark's, so it runs
    in seconds). About 20 s on the loaded 2-core VM (4 s of it training; generating the set
    about 1 s, then cached); validation accuracy 0.16 (chance 0.1; the most frequent label
    of the 64 validation expressions covers about 0.2)."""
    model = ListOpsConfig(dim=32, depth=1, heads=2, **mechanism_options(ListOpsTask, attention, posenc))
    run = RunConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=15, eval_batches=4,
                    checkpoint_every=15, log_every=5)
    return Preset(ListOpsTask.name, model, run, {"num_train": 256, "num_valid": 64, "min_length": SHORT_LENGTHS[0],
                                                 "max_length": SHORT_LENGTHS[1]})


def small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train listops --preset small``: ListOps-short, a shorter variant of the
    benchmark: its operators, depth (10) and arguments (2-10) on expressions of 100-300
    tokens instead of 500-2000 (mean about 200), the length that one CPU core trains in
    minutes. 2 layers, width 64, 2 heads; 1200 steps of 16 expressions from 5000 generated
    ones, accuracy on 500 validation ones (their most frequent label covers 0.176; the rule
    "the root operator alone decides" scores 0.352). About 2.5 min (Performer, 0.11 s/step)
    to 5.5 min (FLT, 0.25 s/step) per run with one thread; softmax + T5 0.14-0.18 s/step,
    Toeplitz 0.16-0.17 s/step (at these lengths its op takes the exact quadratic formula).
    Three seeds: softmax + T5 0.333, FLT 0.335, Toeplitz 0.321, Performer 0.198
    (docs/long_context.md); evaluated with its exact attention FLT scores 0.331. A run ends
    with the draw gap (own draw, 3 fresh draws, exact attention). The benchmark's lengths
    with the same budget: ``--preset long``."""
    model = ListOpsConfig(dim=64, depth=2, heads=2, **mechanism_options(ListOpsTask, attention, posenc))
    run = RunConfig(steps=1200, batch_size=16, lr=2e-3, warmup_steps=100, eval_every=300, eval_batches=None,
                    checkpoint_every=600, log_every=50)
    return Preset(ListOpsTask.name, model, run, {"num_train": 5000, "num_valid": 500, "min_length": SHORT_LENGTHS[0],
                                                 "max_length": SHORT_LENGTHS[1]})


def long(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train listops --preset long``: the ``small`` model and budget (2 layers, width
    64, 1200 steps of 16 expressions from 5000, accuracy on 500) on the benchmark's lengths,
    500-2000 tokens (mean about 1125), with batches of similar length (``bucket=32``: pools
    of 32 batches sorted by length). About 17 min (FLT, 0.85 s/step) to 40 min (softmax
    + T5, 2.0 s/step) per run with one thread on an idle 2-core VM (20 steps measured; run
    two at a time, 1.1 and 2.65 s/step; Toeplitz 3.3 s/step). Two seeds: softmax + T5 0.348 /
    0.208, FLT 0.168 / 0.152, Performer 0.168 / 0.152, Toeplitz 0.168 / 0.152 (the most
    frequent label 0.168; docs/long_context.md). After ListOps-short (a ``small`` run, then
    ``--steps 600 --init-from RUN`` here): softmax + T5 0.354 / 0.332, FLT 0.338 / 0.330,
    Performer 0.152 / 0.168, Toeplitz 0.326 / 0.336."""
    model = ListOpsConfig(dim=64, depth=2, heads=2, **mechanism_options(ListOpsTask, attention, posenc))
    run = RunConfig(steps=1200, batch_size=16, lr=2e-3, warmup_steps=100, eval_every=300, eval_batches=None,
                    checkpoint_every=300, log_every=50)
    return Preset(ListOpsTask.name, model, run, {"num_train": 5000, "num_valid": 500, "bucket": 32})


def base(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train listops --preset base``: 4 layers, width 128, 5000 steps of 32 expressions
    from 20k generated ones (the LRA budget is 5000 steps of 32 on 96k). Not run to the end on
    the 2-core VM: its first 12 steps (idle, 2 threads, seed 0) took FLT 4.0 s/step median,
    9.7 s/step on average (the first step and the longest batches weigh most), peak RSS 12.0
    GiB; softmax + T5 11.7 and 19.3 s/step, 15.2 GiB. About 5.5-13.5 h of training for FLT
    and 16-27 h for softmax + T5, plus ten evaluations on the 2000 validation expressions
    (a projection from those steps, not a measured run time); no accuracy measured."""
    model = ListOpsConfig(dim=128, depth=4, heads=4, **mechanism_options(ListOpsTask, attention, posenc))
    run = RunConfig(steps=5000, batch_size=32, lr=5e-4, warmup_steps=500, eval_every=500, eval_batches=None,
                    checkpoint_every=500, log_every=50)
    return Preset(ListOpsTask.name, model, run, {"num_train": 20_000, "num_valid": 2000, "bucket": 32})


#: Share of all expressions carved from training as the test split of LRA files that
#: ship no ``basic_test.tsv``.
TEST_FRACTION = 0.1


class ListOpsTask(Task[ListOpsBatch, ListOpsConfig]):
    """ListOps classification (cross-entropy, accuracy)."""

    name = "listops"
    description = (f"ListOps (Long Range Arena) classifier over expressions of {SHORT_LENGTHS[0]}-{SHORT_LENGTHS[1]} tokens "
                   f"(presets smoke, small: ListOps-short) or {BENCHMARK_LENGTHS[0]}-{BENCHMARK_LENGTHS[1]} (long, base: the "
                   "benchmark's); bundled data: generated from its specification")
    config, model = ListOpsConfig, TokenModel
    metric, higher_is_better, compare_metrics, unit = "accuracy", True, ("loss",), "tok"
    options = ("path", "num_train", "num_valid", "num_test", "seed", "min_length", "max_length", "max_depth", "max_args",
               "bucket")
    bundled_options = ("num_train", "num_valid", "num_test", "seed", "min_length", "max_length", "max_depth", "max_args")
    dataset = staticmethod(load_listops)
    presets: ClassVar[Presets] = {"smoke": smoke, "small": small, "long": long, "base": base}
    attention_defaults, posenc_defaults = ATTENTION_DEFAULTS, POSENC_DEFAULTS
    axes: ClassVar[dict[str, str]] = {"loss": "cross-entropy (nats/expression)", "accuracy": "accuracy (fraction of expressions)",
                                      "offset": "tokens"}

    def __init__(self, *, path: str | os.PathLike[str] | None = None, num_train: int = 2000, num_valid: int = 200, num_test: int | None = None, seed: int = 0,
                 min_length: int = BENCHMARK_LENGTHS[0], max_length: int = BENCHMARK_LENGTHS[1], max_depth: int = 10,
                 max_args: int = 10, bucket: int = 0) -> None:
        check_nonnegative_int("bucket", bucket, "pools of batches sorted by length; 0: off")
        self.bucket = bucket
        if path is None:
            # The test set defaults to validation's size: further expressions of its stream.
            splits = load_listops(num_train=num_train, num_valid=num_valid, seed=seed, min_length=min_length,
                                  max_length=max_length, max_depth=max_depth, max_args=max_args,
                                  num_test=num_valid if num_test is None else num_test)
        else:
            splits = load_listops_tsv(path)
        train_data, test_data = splits.train, splits.test
        if test_data is None:  # an LRA directory without basic_test.tsv: carve from training
            train, test = carve_test(np.arange(len(splits.train)), len(splits.train) + len(splits.valid), TEST_FRACTION, 0)
            train_data, test_data = splits.train.subset(train), splits.train.subset(test)
        self.train, self.valid, self.test = train_data, splits.valid, test_data

    @classmethod
    def model_arguments(cls, config: TrunkConfig) -> dict[str, Any]:
        """The classifier: ``num_classes`` outputs from the mean over the valid tokens, bidirectional."""
        arguments = config_kwargs(config)
        arguments["out_dim"] = arguments.pop("num_classes")
        return {**arguments, "head": "mean", "causal": False}

    def configure(self, cfg: ListOpsConfig) -> ListOpsConfig:
        return replace_fields(cfg, vocab_size=len(VOCAB), num_classes=NUM_CLASSES)

    def train_batch(self, step: int, batch_size: int, seed: int, rank: int, world: int) -> ListOpsBatch:
        if self.bucket:
            idx = bucketed_indices(self.train.lengths, batch_size, seed, step, self.bucket)
        else:
            idx = epoch_indices(len(self.train), batch_size, seed, step)
        return self.train.batch(idx[shard(batch_size, rank, world)])

    def batch_items(self, batch: ListOpsBatch) -> int:
        return int((~batch[1]).sum())

    def loss(self, model: nn.Module, batch: ListOpsBatch) -> torch.Tensor:
        tokens, pad, labels = batch
        return F.cross_entropy(model(tokens, pad).float(), labels)

    def eval_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[ListOpsBatch]:
        return self._batches(self.valid, batch_size, max_batches, rank, world)

    def test_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[ListOpsBatch]:
        return self._batches(self.test, batch_size, max_batches, rank, world)

    @staticmethod
    def _batches(data: ListOpsData, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[ListOpsBatch]:
        order = torch.arange(len(data))
        if max_batches is None:  # every expression once: shortest first, so that batches pad little
            order = torch.sort(data.lengths, stable=True).indices
        for sl in eval_slices(len(data), batch_size, max_batches, rank, world):
            yield data.batch(order[sl])

    def eval_sums(self, model: nn.Module, batch: ListOpsBatch) -> dict[str, float]:
        tokens, pad, labels = batch
        logits = model(tokens, pad).float()
        return {"nll": float(F.cross_entropy(logits, labels, reduction="sum")),
                "correct": float((logits.argmax(-1) == labels).sum()), "count": float(labels.numel())}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["nll"] / sums["count"], "accuracy": sums["correct"] / sums["count"]}

    def rpe_extent(self, cfg: ListOpsConfig) -> tuple[float, bool]:
        return 64.0, False

    def longest_sequence(self, cfg: ListOpsConfig) -> int:
        return int(max(self.valid.lengths.max(), self.test.lengths.max()))

    def step_shape(self, cfg: ListOpsConfig, batch_size: int) -> tuple[int, int]:
        return batch_size, max(int(self.train.lengths.max()), int(self.valid.lengths.max()), int(self.test.lengths.max()))
