"""The text a linearisation trains and validates on: the file (or the embedded corpus)
split in two, its token ids (``MODEL_DIR``'s tokenizer, or bytes), the training windows
of each step, the validation windows and the perplexity on them."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from flt.data._files import read_regular
from flt.data.text import TEXT_BYTES_PER_BYTE, load_python_docs
from flt.tasks.base import step_generator

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Files that mark a directory as a ``transformers`` tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
#: The headline metric (validation perplexity) in records and plots.
METRIC = "ppl"


def load_text(path: str | None, valid_fraction: float = 0.1) -> tuple[bytes, bytes, str]:
    """``(train, valid, name)``: a UTF-8 file split at ``1 - valid_fraction`` of its bytes
    (at a line break when there is one nearby), or the embedded Python-documentation corpus."""
    if path is None:
        splits = load_python_docs()
        return splits.train, splits.valid, "python-docs"
    file = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"--data {path}: no such file (expected a UTF-8 text file)")
    # A FIFO or device is refused before it is read (reading a FIFO waits for a writer), and
    # the size is checked against FLT_MEMORY_LIMIT before the bytes are.
    data = read_regular(path, "--data file", bytes_per_byte=TEXT_BYTES_PER_BYTE, hint="use a smaller --data file")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--data {path}: not UTF-8 text ({err})") from None
    cut = int(len(data) * (1 - valid_fraction))
    newline = data.rfind(b"\n", max(0, cut - 1000), cut)
    cut = newline + 1 if newline > 0 else cut
    train, valid = data[:cut], data[cut:]
    if not train or not valid:
        raise ValueError(f"--data {path}: {len(data)} bytes leave an empty training or validation part")
    return train, valid, file.name


def check_tokens(model_dir: str | os.PathLike, byte_tokens: bool) -> None:
    """Refuse a ``MODEL_DIR`` without a tokenizer unless bytes are asked for
    (``byte_tokens``), and bytes asked for where it has one."""
    tokenizer = [name for name in TOKENIZER_FILES if (Path(model_dir) / name).is_file()]
    if byte_tokens and tokenizer:
        raise ValueError(f"--bytes: MODEL_DIR {model_dir} has a tokenizer ({tokenizer[0]}), which bytes would ignore; "
                         "drop --bytes to use it")
    if not byte_tokens and not tokenizer:
        raise ValueError(f"MODEL_DIR {model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); pass --bytes "
                         "(byte_tokens=True) to train on the text's bytes as token ids 0..255, right only for a model "
                         "trained on bytes, or save the model's tokenizer into it (tokenizer.save_pretrained)")


class Tokens:
    """Turns text into token ids with ``MODEL_DIR``'s tokenizer, or bytes
    (``byte_tokens``, for a folder without one: :func:`check_tokens`)."""

    def __init__(self, model_dir: str | os.PathLike, vocab_size: int, byte_tokens: bool = False):
        check_tokens(model_dir, byte_tokens)
        directory = Path(model_dir)
        self.tokenizer = None
        if not byte_tokens:
            # transformers (the hf extra) is imported only where a tokenizer is read.
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.kind = type(self.tokenizer).__name__
        elif vocab_size >= 256:
            self.kind = "bytes"
        else:
            raise ValueError(f"{model_dir} has no tokenizer and its vocabulary ({vocab_size} tokens) cannot hold bytes; "
                             "save the model's tokenizer into it (tokenizer.save_pretrained)")

    def encode(self, text: bytes) -> torch.Tensor:
        """Ids ``[N]`` int64."""
        if self.tokenizer is None:
            return byte_ids(text)
        ids = self.tokenizer(text.decode("utf-8"), add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)


def byte_ids(text: bytes) -> torch.Tensor:
    """Bytes as token ids ``[N]`` int64 (0..255)."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)


def window_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """The training windows of (1-based) ``step``: ``[B, seq_len + 1]`` token ids at random
    starts drawn from ``(seed, step)`` alone (a resumed run sees the same batches)."""
    span = tokens.numel() - seq_len - 1
    if span < 1:
        raise ValueError(f"the training text has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    starts = torch.randint(0, span, (batch_size,), generator=step_generator(seed, step, stream=11))
    return torch.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()])


def eval_windows(tokens: torch.Tensor, seq_len: int, batch_size: int, max_batches: int | None) -> Iterator[torch.Tensor]:
    """Consecutive validation windows ``[b, seq_len + 1]`` overlapping by one token, so each
    token after the first is predicted once; at most ``max_batches`` batches."""
    starts = list(range(0, tokens.numel() - seq_len - 1, seq_len))
    if not starts:
        raise ValueError(f"the validation text has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    for i, first in enumerate(range(0, len(starts), batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        yield torch.stack([tokens[s: s + seq_len + 1] for s in starts[first: first + batch_size]])


def next_token_loss(model: PreTrainedModel, windows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of every next token of ``windows [B, T + 1]`` (in float32 or better)."""
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten(), reduction=reduction)


@torch.no_grad()
def perplexity(model: PreTrainedModel, tokens: torch.Tensor, *, seq_len: int, batch_size: int, max_batches: int | None = None,
               device: torch.device | str | None = None) -> dict[str, float]:
    """``{"loss", "ppl", "tokens"}`` of ``model`` on ``tokens`` (:func:`eval_windows`), in eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for windows in eval_windows(tokens, seq_len, batch_size, max_batches):
            windows = windows.to(device) if device is not None else windows
            total += float(next_token_loss(model, windows, reduction="sum").double())
            count += windows[:, 1:].numel()
    finally:
        model.train(was_training)
    loss = total / count
    return {"loss": loss, METRIC: math.exp(loss), "tokens": count}
