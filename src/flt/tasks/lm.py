"""``lm``: byte- or character-level causal language modelling (perplexity, bits per byte).

Data options: ``path`` (a text file such as enwik8, cut 90/5/5, or a WikiText directory;
default: the Python documentation corpus shipped with Python), ``valid_path``,
``tokenizer`` (``"byte"`` or ``"char"``), ``max_bytes`` (cap on the default corpus),
``require_utf8``, ``test_fraction``. Positions are token indices (``P = 1``).

Test split: a corpus' own (enwik8's last 5%, WikiText's test file); otherwise, for the
default corpus, the documents after validation's in CRC order (``test_fraction`` of them,
default 0.1, :func:`flt.data.load_python_docs`) and, for a train file with a
``valid_path``, the last ``test_fraction`` of the bytes cut from training
(:func:`flt.data.text.carve_text_test`). Validation is never touched. Text generation from a trained
model (:func:`generate_text`, ``flt generate``) lives here too.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flt.data import (
    TOKENIZERS,
    ByteTokenizer,
    CharTokenizer,
    LMDataset,
    load_python_docs,
    load_text_files,
)
from flt.data.text import carve_text_test
from flt.models import CausalLM, LMConfig, replace_fields
from flt.tasks.base import Presets, Task, mechanism_options, shard, step_generator
from flt.tasks.preset import Preset, RunConfig

#: ``(inputs, targets)``, token ids ``[B, T]`` each; the targets are the inputs shifted by one.
LMBatch = tuple[torch.Tensor, torch.Tensor]

#: FLT: local windows (its natural spectrum: "attend to the last w tokens") with a locality
#: bias at the start (``amplitude=1``), and the banded estimator (``near_field=16``,
#: docs/math.md section 5.1) whose exact near-field term is a learned table, one entry per
#: offset of the band (``near_relative="clipped"``): the strong local biases a language
#: model learns are exact inside the band instead of inflating FAVOR+'s variance, and as
#: free as T5's table. Small preset, 2 seeds (docs/results.md): ppl 3.70, against 4.20
#: with a second local spectrum as the near term and 3.65 for softmax with T5's scaled
#: table. The other linear mechanisms get FLT's number of random features; softmax gets T5
#: buckets. FLT's exact counterpart is ``softmax`` with ``relative_bias=spectrum`` and
#: FLT's spectrum options (without the band's table).
ATTENTION_DEFAULTS: dict[str, dict[str, Any]] = {
    "flt": {"spectrum": "local", "num_features": 64, "num_frequencies": 16, "amplitude": 1.0, "near_field": 16,
            "near_relative": "clipped"},
    "performer": {"num_features": 64},
    "toeplitz": {"num_features": 64, "max_distance": 256},
    "softmax": {"relative_bias": "t5"},
}
POSENC_DEFAULTS: dict[str, dict[str, Any]] = {"shifted_basis": {"domain": [0.0, 256.0]}}


def smoke(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train lm --preset smoke``: 40 steps of a 2-layer byte model on 200 kB of the
    Python docs. About 8 s; validation ppl 26 (bpb 4.7)."""
    model = LMConfig(dim=64, depth=2, heads=2, max_len=64, **mechanism_options(LMTask, attention, posenc))
    run = RunConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=20, eval_batches=4,
                    checkpoint_every=20, log_every=5)
    return Preset(LMTask.name, model, run, {"max_bytes": 200_000})


def small(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train lm --preset small``: 4 layers, width 128, context 128 bytes, 800 steps
    of 16 windows on the Python docs corpus (1.9 MB train, 0.29 MB valid). FLT with
    ``near_field=16``, the band's table as near term, redraws every step (seed 0,
    ``--threads 1``, a 2-core VM with one other job): About 7 min (404 s; 0.41 s/step
    median), validation ppl 3.72 (bpb 1.89); draw gap on the first 32 validation batches:
    own draw 3.650, fresh draws 3.653 +- 0.009, exact 3.637. Plain FLT (one fixed draw, no
    near field): about 5 min, ppl 6.55."""
    model = LMConfig(dim=128, depth=4, heads=4, max_len=128, **mechanism_options(LMTask, attention, posenc))
    run = RunConfig(steps=800, batch_size=16, lr=3e-3, warmup_steps=50, eval_every=100, eval_batches=16,
                    checkpoint_every=100, log_every=10, draw_gap_batches=32)
    return Preset(LMTask.name, model, run, {})


def base(attention: str = "flt", posenc: str = "none") -> Preset:
    """``flt train lm --preset base``: 6 layers, width 192, context 256 bytes, 2000 steps
    of 16 windows. About 1 h (3689 s); validation ppl 3.23 (bpb 1.69)."""
    model = LMConfig(dim=192, depth=6, heads=6, max_len=256, **mechanism_options(LMTask, attention, posenc))
    run = RunConfig(steps=2000, batch_size=16, lr=2e-3, warmup_steps=100, eval_every=250, eval_batches=16,
                    checkpoint_every=250, log_every=20, draw_gap_batches=32)
    return Preset(LMTask.name, model, run, {})


class LMTask(Task[LMBatch, LMConfig]):
    """Next-token prediction on a byte or character stream."""

    name = "lm"
    description = "causal language model; bundled data: the Python documentation (text)"
    config, model = LMConfig, CausalLM
    metric, higher_is_better, compare_metrics, unit = "ppl", False, ("bpb",), "tok"
    # Typed as the base class has them: LongLMTask replaces them.
    options: ClassVar[tuple[str, ...]] = ("path", "valid_path", "tokenizer", "max_bytes", "require_utf8", "test_fraction")
    bundled_options: ClassVar[tuple[str, ...]] = ("max_bytes",)
    path_options: ClassVar[tuple[str, ...]] = ("valid_path",)
    dataset: ClassVar[Callable[..., Any]] = staticmethod(load_python_docs)
    presets: ClassVar[Presets] = {"smoke": smoke, "small": small, "base": base}
    attention_defaults, posenc_defaults = ATTENTION_DEFAULTS, POSENC_DEFAULTS
    axes: ClassVar[dict[str, str]] = {"loss": "cross-entropy (nats/token)", "ppl": "perplexity (per token)", "bpb": "bits per byte",
                                      "offset": "tokens"}

    def __init__(self, *, path: str | os.PathLike[str] | None = None, valid_path: str | os.PathLike[str] | None = None,
                 tokenizer: str = "byte", max_bytes: int | None = None, require_utf8: bool = True,
                 test_fraction: float = 0.1) -> None:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, got {tokenizer!r}")
        if path is None:
            if valid_path is not None:
                raise ValueError("valid_path needs path")
            splits = load_python_docs(max_bytes=max_bytes, test_fraction=test_fraction)
        else:
            if max_bytes is not None:
                raise ValueError("max_bytes applies to the default corpus only")
            splits = carve_text_test(load_text_files(path, valid_path, require_utf8=require_utf8), test_fraction, require_utf8)
        self.sources = _split_sources(path, valid_path, max_bytes)
        self.tokenizer_name = tokenizer
        self.tokenizer = TOKENIZERS[tokenizer](splits.train)
        self.train_tokens = self.tokenizer.encode(splits.train)
        self.valid_tokens = self.tokenizer.encode(splits.valid)
        assert splits.test is not None, "test_fraction > 0 (checked above): both loaders give a test split"
        self.test_tokens = self.tokenizer.encode(splits.test)
        # UTF-8 bytes per token id, for bits per byte (unknown characters count as U+FFFD).
        if isinstance(self.tokenizer, CharTokenizer):
            chars = self.tokenizer.UNKNOWN + self.tokenizer.chars
            self.token_bytes = torch.tensor([len(ch.encode("utf-8")) for ch in chars], dtype=torch.float64)
        else:
            self.token_bytes = torch.ones(256, dtype=torch.float64)

    def configure(self, cfg: LMConfig) -> LMConfig:
        self.seq_len = cfg.max_len
        for split, tokens in (("train", self.train_tokens), ("valid", self.valid_tokens)):
            if tokens.numel() < cfg.max_len + 1:
                raise ValueError(f"the {split} split ({self.sources[split]}) has {tokens.numel()} tokens, fewer than the "
                                 f"max_len + 1 = {cfg.max_len + 1} that one window needs; give more text or a smaller "
                                 "max_len (--model-opt max_len=N)")
        self.train_set = LMDataset(self.train_tokens, self.seq_len)
        self.valid_set = LMDataset(self.valid_tokens, self.seq_len)
        self.test_set = LMDataset(self.test_tokens, self.seq_len)
        return replace_fields(cfg, vocab_size=self.tokenizer.vocab_size)

    def holdout_split(self, fraction: float, seed: int) -> tuple[Task[LMBatch, LMConfig], Task[LMBatch, LMConfig]]:
        """The last ``fraction`` of the training tokens (``seed`` unused)."""
        cut = int(round((1 - fraction) * self.train_tokens.numel()))
        weights, alpha = copy.copy(self), copy.copy(self)
        weights.train_set = LMDataset(self.train_tokens[:cut], self.seq_len)
        alpha.train_set = alpha.valid_set = LMDataset(self.train_tokens[cut:], self.seq_len)
        for part, what in ((weights.train_set, "training"), (alpha.train_set, "held-out")):
            if len(part) < 1:
                raise ValueError(f"the {what} part of the text is shorter than one window of {self.seq_len} tokens")
        return weights, alpha

    def train_batch(self, step: int, batch_size: int, seed: int, rank: int, world: int) -> LMBatch:
        x, y = self.train_set.sample(batch_size, generator=step_generator(seed, step))
        s = shard(batch_size, rank, world)
        return x[s], y[s]

    def batch_items(self, batch: LMBatch) -> int:
        return batch[0].numel()

    def loss(self, model: nn.Module, batch: LMBatch) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def eval_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[LMBatch]:
        return self._windows(self.valid_set, batch_size, max_batches, rank, world)

    def test_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[LMBatch]:
        return self._windows(self.test_set, batch_size, max_batches, rank, world)

    @staticmethod
    def _windows(dataset: LMDataset, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[LMBatch]:
        # A capped evaluation takes windows evenly spread over the split, not its first
        # ones, so it estimates the full-split metric of the final evaluation.
        n = len(dataset)
        if max_batches is None or max_batches * batch_size >= n:
            windows = list(range(n))
        else:
            windows = torch.linspace(0, n - 1, max_batches * batch_size, dtype=torch.float64).round().long().tolist()
        for i, first in enumerate(range(0, len(windows), batch_size)):
            if i % world == rank:
                pairs = [dataset[j] for j in windows[first : first + batch_size]]
                yield torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])

    def eval_sums(self, model: nn.Module, batch: LMBatch) -> dict[str, float]:
        x, y = batch
        nll = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
        return {"nll": float(nll), "tokens": float(y.numel()), "bytes": float(self.token_bytes[y.cpu()].sum())}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["nll"] / sums["tokens"]
        return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": sums["nll"] / (math.log(2) * sums["bytes"])}

    def rpe_extent(self, cfg: LMConfig) -> tuple[float, bool]:
        return float(cfg.max_len), True

    def longest_sequence(self, cfg: LMConfig) -> int:
        return int(cfg.max_len)

    def extra(self) -> dict[str, Any]:
        tok = {"kind": self.tokenizer_name}
        if isinstance(self.tokenizer, CharTokenizer):
            tok["chars"] = self.tokenizer.chars
        return {"tokenizer": tok}

    def report(self, model: nn.Module, device: torch.device) -> str:
        prompt = "def "
        text = generate_text(as_causal_lm(model), self.tokenizer, prompt, 200, device=device, temperature=0.8, top_k=40, seed=0)
        return f"sample (prompt {prompt!r}, temperature 0.8, top-k 40):\n{text}"


def _split_sources(path: str | os.PathLike[str] | None, valid_path: str | os.PathLike[str] | None,
                   max_bytes: int | None) -> dict[str, str]:
    """Where each split's text comes from, for messages."""
    if path is None:
        return dict.fromkeys(("train", "valid"), "the bundled Python documentation"
                             + (f", max_bytes={max_bytes}" if max_bytes is not None else ""))
    path = os.fspath(path)
    if valid_path is not None:
        return {"train": path, "valid": os.fspath(valid_path)}
    if os.path.isdir(path):
        return {s: f"{path}/wiki.{s}.tokens or .raw" for s in ("train", "valid")}
    return {s: f"the {s} part of {path}" for s in ("train", "valid")}


def as_causal_lm(model: nn.Module) -> CausalLM:
    """``model``, which must be the :class:`CausalLM` an LM task builds (for generation)."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"text generation needs a CausalLM, got {type(model).__name__}")
    return model


def tokenizer_from_extra(extra: dict[str, Any]) -> ByteTokenizer | CharTokenizer:
    """Rebuild the tokenizer saved by :meth:`LMTask.extra`."""
    tok = extra.get("tokenizer") if isinstance(extra, dict) else None
    if not isinstance(tok, dict) or tok.get("kind") not in ("byte", "char"):
        raise ValueError("the checkpoint does not describe a tokenizer (is it a language-model run?)")
    return ByteTokenizer() if tok["kind"] == "byte" else CharTokenizer(tok["chars"])


@torch.no_grad()
def generate_text(model: CausalLM, tokenizer: ByteTokenizer | CharTokenizer, prompt: str, max_new_tokens: int, *,
                  device: torch.device | str, temperature: float = 0.8, top_k: int | None = 40, seed: int = 0,
                  recurrent: bool | None = None) -> str:
    """Decode ``prompt`` + ``max_new_tokens`` sampled tokens (model in eval mode; restores its mode)."""
    ids = tokenizer.encode(prompt)
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    was_training = model.training
    model.eval()
    try:
        gen = torch.Generator(device=device).manual_seed(seed)
        out = model.generate(ids[None].to(device), max_new_tokens, temperature=temperature, top_k=top_k, generator=gen, recurrent=recurrent)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0].cpu())
