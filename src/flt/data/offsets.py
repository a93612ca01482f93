"""Generated data of the ``offsets`` task: random tokens, and at every position a weighted
mean of the values of the tokens at a few offsets far back.

Token ``x_j`` is uniform over a vocabulary of ``V`` symbols, each with a fixed random value
vector ``v(x) ~ N(0, I_k)``. The target at position ``i`` is

    y_i = sum_{j <= i} exp(f(i - j)) v(x_j) / sum_{j <= i} exp(f(i - j)),
    f(d) = A sum_c exp(-(d - c_c)^2 / (2 sigma^2)),

a causal softmax over the keys with the relative logit ``f``: bumps of height ``A``
(``amplitude``) and width ``sigma`` (``width``) at the offsets ``c_c`` (``centers``). With
the defaults (``A = 3``, bumps at 64 and 256 tokens, ``sigma = 24``) a key at a bump's
centre weighs ``e^3 ~ 20`` times one outside, so the target is mostly the mean of the
values 40 to 90 and 230 to 280 tokens back, plus a share (about a fifth at 512 tokens)
of the mean of all earlier values. It is exactly one attention layer with a relative term and no content
term (``q.k = 0``): ``softmax(q.k + f(i - j))`` with the bumps as ``f``, which a
shifted Gaussian-mixture spectrum (:class:`flt.relative.spectra.GaussianMixtureSpectrum` with
``shift=True``, ``mu = 0``) is, and which no mechanism can compute from a band of nearby
tokens when the centres lie far beyond it.

Everything is a function of the data seed: the value table, and each split's tokens from
their own stream, so the test split shares nothing with the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: ``SeedSequence`` stream of each split's tokens and of the value table.
STREAMS = {"train": 0, "valid": 1, "test": 2, "values": 3}


def _generator(seed: int, stream: str) -> torch.Generator:
    state = np.random.SeedSequence([seed, STREAMS[stream]]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def offset_logits(offsets: torch.Tensor, centers: Sequence[float], width: float, amplitude: float) -> torch.Tensor:
    """The task's relative logit ``f(d) = A sum_c exp(-(d - c_c)^2 / (2 width^2))`` at
    ``offsets [...]`` (float64, same shape)."""
    d = offsets.to(torch.float64).unsqueeze(-1)
    c = torch.as_tensor(list(centers), dtype=torch.float64)
    return amplitude * torch.exp(-((d - c) ** 2) / (2.0 * width**2)).sum(-1)


def token_values(vocab_size: int, value_dim: int, seed: int) -> torch.Tensor:
    """The value table ``v [V, k]`` (float64): standard normal draws, centred over the
    vocabulary so that every channel's target has mean 0 (otherwise a constant, each
    channel's mean, would explain part of the variance that ``rel_mse`` divides by)."""
    v = torch.randn(vocab_size, value_dim, generator=_generator(seed, "values"), dtype=torch.float64)
    return v - v.mean(0)


def split_tokens(split: str, num: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """``num`` sequences of ``length`` uniform tokens ``[num, length]`` (int64) of ``split``."""
    return torch.randint(vocab_size, (num, length), generator=_generator(seed, split))


def offset_targets(tokens: torch.Tensor, values: torch.Tensor, logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Targets ``y [S, N, k]`` (float64) of ``tokens [S, N]`` for the value table
    ``values [V, k]`` and the relative logit ``logits [>= N]`` (``f(0), f(1), ...``).

    The numerator is a causal convolution of the values with ``w(d) = exp(f(d))``, done by
    FFT in float64 on ``chunk`` sequences at a time; the denominator is the prefix sum of
    ``w``. ``w`` is scaled by ``exp(-max f)`` first (the ratio does not change)."""
    S, N = tokens.shape
    if logits.numel() < N:
        raise ValueError(f"logits must cover the offsets 0..{N - 1}, got {logits.numel()} values")
    w = torch.exp(logits[:N].to(torch.float64) - logits[:N].max())
    size = 2 * N  # no wrap-around: a linear convolution of two length-N signals
    w_hat = torch.fft.rfft(w, n=size).view(1, -1, 1)
    den = torch.cumsum(w, 0).view(1, N, 1)
    out = torch.empty(S, N, values.shape[1], dtype=torch.float64)
    for first in range(0, S, chunk):
        v = values[tokens[first : first + chunk]]
        num = torch.fft.irfft(torch.fft.rfft(v, n=size, dim=1) * w_hat, n=size, dim=1)[:, :N]
        out[first : first + chunk] = num / den
    return out


@dataclass
class OffsetSplit:
    """One split: ``tokens [S, N]`` (int64) and ``targets [S, N, k]`` (float32)."""

    tokens: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass
class OffsetSplits:
    """The three splits and the value table ``values [V, k]`` (float64)."""

    train: OffsetSplit
    valid: OffsetSplit
    test: OffsetSplit
    values: torch.Tensor


def default_score_from(centers: Sequence[float], width: float) -> int:
    """First scored position: the far edge of the farthest bump, ``max(c) + 3 width``, so
    that every scored target has its whole kernel inside the sequence."""
    return int(math.ceil(max(centers) + 3 * width))


def generate_offsets(*, num_train: int = 2000, num_valid: int = 200, num_test: int = 200, length: int = 512,
                     eval_length: int | None = None, vocab_size: int = 16, value_dim: int = 4,
                     centers: Sequence[float] = (64.0, 256.0), width: float = 24.0, amplitude: float = 3.0,
                     seed: int = 0) -> OffsetSplits:
    """The task's splits: training sequences of ``length`` tokens, validation and test
    sequences of ``eval_length`` (default ``length``) tokens."""
    eval_length = eval_length or length
    longest = max(length, eval_length)
    logits = offset_logits(torch.arange(longest), centers, width, amplitude)
    values = token_values(vocab_size, value_dim, seed)

    def split(name: str, num: int, n: int) -> OffsetSplit:
        tokens = split_tokens(name, num, n, vocab_size, seed)
        return OffsetSplit(tokens, offset_targets(tokens, values, logits).to(torch.float32))

    return OffsetSplits(split("train", num_train, length), split("valid", num_valid, eval_length),
                        split("test", num_test, eval_length), values)
