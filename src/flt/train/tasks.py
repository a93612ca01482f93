"""Task adapters: one small class per task that the single training loop drives.

A task loads its data (:mod:`flt.data`), fills the data-dependent fields of the model
config, draws the global batch of a step, computes the training loss and sums the
validation metrics. Batches are a pure function of ``(seed, step)``, never of a
sampler's internal state, so a resumed run sees the same batches as an uninterrupted one
and any number of processes splits the same global batch.

Data options (``Preset.data``, ``--data-opt KEY=VALUE``; ``--data PATH`` sets ``path``):

* ``lm``: ``path`` (a text file such as enwik8, cut 90/5/5, or a WikiText directory;
  default: the Python documentation corpus shipped with Python), ``valid_path``,
  ``tokenizer`` (``"byte"`` or ``"char"``), ``max_bytes`` (cap on the default corpus),
  ``require_utf8``.
* ``image``: ``path`` (a CIFAR-10 python directory, or class subfolders of images;
  default: scikit-learn's 8x8 digits), ``valid_dir``, ``size`` ([H, W]), ``channels``,
  ``valid_fraction``, ``split_seed``.
* ``molecule``: ``path`` (an ASE database or any file ``ase.io.read`` reads; default:
  the generated catalysis set), ``target``, ``num_samples``, ``relax_steps``,
  ``valid_fraction``, ``split_seed``, ``cache_dir``.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from flt.data import (
    TOKENIZERS,
    ByteTokenizer,
    CharTokenizer,
    LMDataset,
    collate_molecules,
    load_ase,
    load_catalysis,
    load_cifar10,
    load_digits,
    load_image_folder,
    load_python_docs,
    load_text_files,
    split_molecules,
)
from flt.models.config import replace_fields


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator determined by ``(seed, step, stream)`` alone."""
    state = np.random.SeedSequence([seed, step, stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def _check_options(task: str, options: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown data options for {task!r}: {unknown}; known: {sorted(allowed)}")


def _shard(batch_size: int, rank: int, world: int) -> slice:
    if batch_size % world:
        raise ValueError(f"the global batch_size ({batch_size}) must be divisible by the number of processes ({world})")
    local = batch_size // world
    return slice(rank * local, (rank + 1) * local)


def _epoch_indices(n: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Global batch of (1-based) ``step``: a seeded permutation per epoch, last partial batch dropped."""
    if n < batch_size:
        raise ValueError(f"the training split has {n} samples, fewer than the batch size {batch_size}")
    per_epoch = n // batch_size
    epoch, i = divmod(step - 1, per_epoch)
    perm = torch.randperm(n, generator=step_generator(seed, epoch, stream=1))
    return perm[i * batch_size : (i + 1) * batch_size]


def _eval_slices(n: int, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator[slice]:
    """This rank's share of the first ``max_batches`` consecutive batches of ``n`` items."""
    for i, first in enumerate(range(0, n, batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        if i % world == rank:
            yield slice(first, min(first + batch_size, n))


class Task:
    """Interface of a task; see the module docstring."""

    name: str = ""
    #: Headline validation metric and whether larger is better (for tables and plots).
    metric: str = ""
    higher_is_better: bool = False
    #: What throughput counts.
    unit: str = "samples"

    def configure(self, cfg):
        """The model config with its data-dependent fields filled in."""
        raise NotImplementedError

    def train_batch(self, step: int, batch_size: int, seed: int, rank: int, world: int):
        """This process's slice (``rank`` of ``world``) of the global batch of ``step``."""
        raise NotImplementedError

    def batch_items(self, batch) -> int:
        """Number of ``unit`` in a (local) batch, for throughput."""
        raise NotImplementedError

    def loss(self, model, batch) -> torch.Tensor:
        """Scalar training loss, the mean over the batch (so DDP's mean of gradients is exact)."""
        raise NotImplementedError

    def eval_batches(self, batch_size: int, max_batches: int | None, rank: int, world: int) -> Iterator:
        """This process's share of the validation batches (at most ``max_batches`` in all)."""
        raise NotImplementedError

    def eval_sums(self, model, batch) -> dict[str, float]:
        """Sums over one batch (summed again over batches and processes)."""
        raise NotImplementedError

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Validation metrics from the total sums; always includes ``loss`` and :attr:`metric`."""
        raise NotImplementedError

    def rpe_extent(self, cfg) -> tuple[float, bool]:
        """``(L, causal)``: plot ``f`` on ``[0, L]`` (causal) or ``[-L, L]`` per axis."""
        raise NotImplementedError

    def extra(self) -> dict[str, Any]:
        """JSON data a checkpoint needs besides the configs (e.g. the tokenizer)."""
        return {}

    def report(self, model, device) -> str | None:
        """A line or two printed at the end of training (e.g. a generated sample)."""
        return None


class LMTask(Task):
    """Next-token prediction on a byte or character stream."""

    name, metric, higher_is_better, unit = "lm", "ppl", False, "tok"
    OPTIONS = ("path", "valid_path", "tokenizer", "max_bytes", "require_utf8")

    def __init__(self, *, path=None, valid_path=None, tokenizer: str = "byte", max_bytes: int | None = None, require_utf8: bool = True):
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, got {tokenizer!r}")
        if path is None:
            if valid_path is not None:
                raise ValueError("valid_path needs path")
            splits = load_python_docs(max_bytes=max_bytes)
        else:
            if max_bytes is not None:
                raise ValueError("max_bytes applies to the default corpus only")
            splits = load_text_files(path, valid_path, require_utf8=require_utf8)
        self.tokenizer_name = tokenizer
        self.tokenizer = TOKENIZERS[tokenizer](splits.train)
        self.train_tokens = self.tokenizer.encode(splits.train)
        self.valid_tokens = self.tokenizer.encode(splits.valid)
        # UTF-8 bytes per token id, for bits per byte (unknown characters count as U+FFFD).
        if tokenizer == "byte":
            self.token_bytes = torch.ones(256, dtype=torch.float64)
        else:
            chars = self.tokenizer.UNKNOWN + self.tokenizer.chars
            self.token_bytes = torch.tensor([len(ch.encode("utf-8")) for ch in chars], dtype=torch.float64)

    def configure(self, cfg):
        self.seq_len = cfg.max_len
        self.train_set = LMDataset(self.train_tokens, self.seq_len)
        self.valid_set = LMDataset(self.valid_tokens, self.seq_len)
        return replace_fields(cfg, vocab_size=self.tokenizer.vocab_size)

    def train_batch(self, step, batch_size, seed, rank, world):
        x, y = self.train_set.sample(batch_size, generator=step_generator(seed, step))
        s = _shard(batch_size, rank, world)
        return x[s], y[s]

    def batch_items(self, batch) -> int:
        return batch[0].numel()

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def eval_batches(self, batch_size, max_batches, rank, world):
        # A capped evaluation takes windows evenly spread over the split, not its first
        # ones, so it estimates the full-split metric of the final evaluation.
        n = len(self.valid_set)
        if max_batches is None or max_batches * batch_size >= n:
            windows = list(range(n))
        else:
            windows = torch.linspace(0, n - 1, max_batches * batch_size, dtype=torch.float64).round().long().tolist()
        for i, first in enumerate(range(0, len(windows), batch_size)):
            if i % world == rank:
                pairs = [self.valid_set[j] for j in windows[first : first + batch_size]]
                yield torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])

    def eval_sums(self, model, batch):
        x, y = batch
        nll = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
        return {"nll": float(nll), "tokens": float(y.numel()), "bytes": float(self.token_bytes[y.cpu()].sum())}

    def metrics(self, sums):
        loss = sums["nll"] / sums["tokens"]
        return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": sums["nll"] / (math.log(2) * sums["bytes"])}

    def rpe_extent(self, cfg):
        return float(cfg.max_len), True

    def extra(self):
        tok = {"kind": self.tokenizer_name}
        if self.tokenizer_name == "char":
            tok["chars"] = self.tokenizer.chars
        return {"tokenizer": tok}

    def report(self, model, device):
        prompt = "def "
        text = generate_text(model, self.tokenizer, prompt, 200, device=device, temperature=0.8, top_k=40, seed=0)
        return f"sample (prompt {prompt!r}, temperature 0.8, top-k 40):\n{text}"


def tokenizer_from_extra(extra: dict[str, Any]):
    """Rebuild the tokenizer saved by :meth:`LMTask.extra`."""
    tok = extra.get("tokenizer") if isinstance(extra, dict) else None
    if not isinstance(tok, dict) or tok.get("kind") not in ("byte", "char"):
        raise ValueError("the checkpoint does not describe a tokenizer (is it a language-model run?)")
    return ByteTokenizer() if tok["kind"] == "byte" else CharTokenizer(tok["chars"])


@torch.no_grad()
def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, *, device, temperature=0.8, top_k=40, seed=0, recurrent=None) -> str:
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


class ImageTask(Task):
    """Image classification (cross-entropy, accuracy)."""

    name, metric, higher_is_better, unit = "image", "accuracy", True, "img"
    OPTIONS = ("path", "valid_dir", "size", "channels", "valid_fraction", "split_seed")

    def __init__(self, *, path=None, valid_dir=None, size=None, channels: int = 3, valid_fraction: float = 0.2, split_seed: int = 0):
        if path is None:
            if valid_dir is not None or size is not None:
                raise ValueError("valid_dir and size apply to an image folder given by path")
            splits = load_digits(valid_fraction=valid_fraction, seed=split_seed)
        elif os.path.exists(os.path.join(path, "batches.meta")) or os.path.isdir(os.path.join(path, "cifar-10-batches-py")):
            splits = load_cifar10(path)
        else:
            splits = load_image_folder(
                path, valid_dir, size=None if size is None else tuple(size), channels=channels,
                valid_fraction=valid_fraction, seed=split_seed,
            )
        self.train, self.valid = splits.train, splits.valid

    def configure(self, cfg):
        _, c, h, w = self.train.images.shape
        if h != w:
            raise ValueError(f"the classifier needs square images, got {h}x{w}; pass --data-opt size=[S,S]")
        return replace_fields(cfg, image_size=h, channels=c, num_classes=self.train.num_classes)

    def train_batch(self, step, batch_size, seed, rank, world):
        idx = _epoch_indices(len(self.train), batch_size, seed, step)[_shard(batch_size, rank, world)]
        return self.train.images[idx], self.train.labels[idx]

    def batch_items(self, batch) -> int:
        return batch[0].shape[0]

    def loss(self, model, batch):
        images, labels = batch
        return F.cross_entropy(model(images).float(), labels)

    def eval_batches(self, batch_size, max_batches, rank, world):
        for sl in _eval_slices(len(self.valid), batch_size, max_batches, rank, world):
            yield self.valid.images[sl], self.valid.labels[sl]

    def eval_sums(self, model, batch):
        images, labels = batch
        logits = model(images).float()
        return {
            "nll": float(F.cross_entropy(logits, labels, reduction="sum")),
            "correct": float((logits.argmax(-1) == labels).sum()),
            "count": float(labels.numel()),
        }

    def metrics(self, sums):
        return {"loss": sums["nll"] / sums["count"], "accuracy": sums["correct"] / sums["count"]}

    def rpe_extent(self, cfg):
        return 2.0, False


class MoleculeTask(Task):
    """Scalar property regression (MSE on standardised targets; MAE and RMSE in target units)."""

    name, metric, higher_is_better, unit = "molecule", "mae", False, "mol"
    OPTIONS = ("path", "target", "num_samples", "relax_steps", "valid_fraction", "split_seed", "cache_dir", "progress")

    def __init__(self, *, path=None, target: str = "energy", num_samples: int = 2000, relax_steps: int = 30,
                 valid_fraction: float = 0.1, split_seed: int = 0, cache_dir=None, progress: bool = True):
        if path is None:
            splits = load_catalysis(
                num_samples, seed=split_seed, relax_steps=relax_steps, valid_fraction=valid_fraction,
                cache_dir=cache_dir, progress=progress,
            )
        else:
            splits = split_molecules(load_ase(path, target), valid_fraction, split_seed)
        self.train, self.valid = splits.train, splits.valid
        y = self.train.y.double()
        self.target_mean, self.target_std = float(y.mean()), float(y.std()) if len(y) > 1 else 1.0
        if not self.target_std > 0:
            self.target_std = 1.0

    def configure(self, cfg):
        zmax = int(max(self.train.z.max(), self.valid.z.max()))
        if zmax >= cfg.num_elements:
            raise ValueError(f"the data has atomic number {zmax}, beyond num_elements = {cfg.num_elements}")
        return replace_fields(cfg, target_mean=self.target_mean, target_std=self.target_std)

    def _collate(self, data, idx):
        return collate_molecules([data[int(i)] for i in idx])

    def train_batch(self, step, batch_size, seed, rank, world):
        idx = _epoch_indices(len(self.train), batch_size, seed, step)[_shard(batch_size, rank, world)]
        return self._collate(self.train, idx)

    def batch_items(self, batch) -> int:
        return batch.y.shape[0]

    def loss(self, model, batch):
        pred = model(batch.z, batch.pos, batch.mask)
        return F.mse_loss((pred.float() - self.target_mean) / self.target_std, (batch.y.float() - self.target_mean) / self.target_std)

    def eval_batches(self, batch_size, max_batches, rank, world):
        for sl in _eval_slices(len(self.valid), batch_size, max_batches, rank, world):
            yield self._collate(self.valid, range(sl.start, sl.stop))

    def eval_sums(self, model, batch):
        err = model(batch.z, batch.pos, batch.mask).double() - batch.y.double()
        return {
            "sq_norm": float(((err / self.target_std) ** 2).sum()),
            "abs": float(err.abs().sum()),
            "sq": float((err**2).sum()),
            "count": float(err.numel()),
        }

    def metrics(self, sums):
        n = sums["count"]
        return {"loss": sums["sq_norm"] / n, "mae": sums["abs"] / n, "rmse": math.sqrt(sums["sq"] / n)}

    def rpe_extent(self, cfg):
        # Twice the largest distance of an atom from its structure's centre covers every offset.
        radius = 0.0
        for i in range(min(len(self.train), 256)):
            _, pos, _ = self.train[i]
            radius = max(radius, float((pos - pos.mean(0)).norm(dim=-1).max()))
        return max(1.0, 2 * radius), False


TASK_CLASSES: dict[str, type[Task]] = {"lm": LMTask, "image": ImageTask, "molecule": MoleculeTask}


def load_task(task: str, options: dict[str, Any]) -> Task:
    """Load the data of ``task`` with loader ``options`` (see the module docstring)."""
    if task not in TASK_CLASSES:
        raise ValueError(f"task must be one of {sorted(TASK_CLASSES)}, got {task!r}")
    cls = TASK_CLASSES[task]
    _check_options(task, options, cls.OPTIONS)
    return cls(**options)
