"""ListOps (Long Range Arena): nested list operations over digits, generated or read from TSV.

An expression is a digit ``0``-``9`` or an operation ``[OP a_1 ... a_k ]`` over ``k`` argument
expressions; the label is its value, a digit (10 classes). Operators: ``MAX``, ``MIN``,
``MED`` (the median; for an even count the mean of the two middle values rounded down,
i.e. ``int(numpy.median(...))`` on digits) and ``SM`` (sum modulo 10). The generator
follows the benchmark's specification: at most ``max_depth = 10`` nested operations, at
most ``max_args = 10`` arguments per operation, and only expressions of ``min_length`` to
``max_length`` tokens (500 to 2000) are kept. Tokens are the operators (``[MAX`` ...), the
closing ``]`` and the digits; the round brackets of the original TSV files (a binary
tree's layout) carry no information and are dropped by :func:`parse_tokens`.

Token ids: ``0`` padding, ``1``-``10`` the digits, then ``[MAX [MIN [MED [SM ]``
(:data:`VOCAB`). A generated set is a pure function of its parameters and is cached as
``.npz`` (no pickles) under ``$FLT_CACHE_DIR/listops`` (default ``~/.cache/flt/listops``),
written atomically.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flt._io import atomic_write
from flt._limits import check_memory
from flt.data._files import check_file_size, load_npz, open_regular
from flt.data.errors import DataError

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
CLOSE = "]"
PAD = 0
#: Token strings by id (id 0 is padding).
VOCAB = ("<pad>", *[str(d) for d in range(10)], *OPERATORS, CLOSE)
TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}
NUM_CLASSES = 10
#: Bumped whenever the generator or the cache layout changes, so old caches are not read.
FORMAT_VERSION = 1


@dataclass
class ListOpsData:
    """Padded token ids ``tokens [S, L]`` (int64, ``PAD`` after each sequence), ``lengths [S]``
    and ``labels [S]``."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [b, Lb], key_padding_mask [b, Lb] True = padding, labels [b])`` cut to the
        longest sequence of the batch."""
        longest = int(self.lengths[idx].max())
        tokens = self.tokens[idx, :longest]
        pad = torch.arange(longest).unsqueeze(0) >= self.lengths[idx].unsqueeze(1)
        return tokens, pad, self.labels[idx]

    def subset(self, idx: torch.Tensor | np.ndarray | Sequence[int]) -> ListOpsData:
        """The expressions at ``idx`` (1-D integer indices), in that order."""
        idx = torch.as_tensor(idx, dtype=torch.int64)
        return ListOpsData(self.tokens[idx], self.lengths[idx], self.labels[idx])

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], labels: list[int]) -> ListOpsData:
        if not sequences:
            raise DataError("a ListOps set needs at least one expression")
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        # The padded table holds every expression at the longest one's length: one long row
        # among many makes it huge, so it is sized before it is allocated.
        check_memory(f"a ListOps set of {len(sequences):,} expressions padded to the longest, {int(lengths.max()):,} tokens",
                     len(sequences) * int(lengths.max()) * 8, hint="drop or shorten the longest expressions")
        tokens = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.int64)
        for i, s in enumerate(sequences):
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        return cls(tokens, lengths, torch.tensor(labels, dtype=torch.int64))


@dataclass
class ListOpsSplits:
    train: ListOpsData
    valid: ListOpsData
    test: ListOpsData | None = None
    name: str = "listops"


def apply_operator(op: str, args: list[int]) -> int:
    """The value of ``op`` (a name of :data:`OPERATORS`, with or without ``[``) on digits."""
    op = op.lstrip("[")
    if not args:
        raise ValueError(f"operation {op} has no arguments")
    if op == "MAX":
        return max(args)
    if op == "MIN":
        return min(args)
    if op == "MED":
        s = sorted(args)
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    if op == "SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}; known: {[o.lstrip('[') for o in OPERATORS]}")


def evaluate(tokens: list[str]) -> int:
    """Value of a well-formed expression given as token strings (a stack machine, the
    reference evaluator); raises ``ValueError`` on a malformed one."""
    stack: list[tuple[str, list[int]]] = []
    result = None
    for i, tok in enumerate(tokens):
        if result is not None:
            raise ValueError(f"tokens after the end of the expression at position {i}: {tok!r}")
        if tok in OPERATORS:
            stack.append((tok, []))
        elif tok == CLOSE:
            if not stack:
                raise ValueError(f"unmatched ']' at position {i}")
            op, args = stack.pop()
            value = apply_operator(op, args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        elif len(tok) == 1 and tok.isdigit():
            if not stack:
                if len(tokens) == 1:
                    return int(tok)
                raise ValueError(f"digit {tok!r} outside any operation at position {i}")
            stack[-1][1].append(int(tok))
        else:
            raise ValueError(f"unknown token {tok!r} at position {i}")
    if result is None:
        raise ValueError("the expression is not closed" if stack else "empty expression")
    return result


def depth(tokens: list[str]) -> int:
    """Largest number of nested operations."""
    d = best = 0
    for tok in tokens:
        if tok in OPERATORS:
            d += 1
            best = max(best, d)
        elif tok == CLOSE:
            d -= 1
    return best


def _check_spec(min_length: int, max_length: int, max_depth: int, max_args: int, branch_prob: float) -> None:
    for name, v in (("min_length", min_length), ("max_length", max_length), ("max_depth", max_depth), ("max_args", max_args)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if min_length > max_length:
        raise ValueError(f"min_length ({min_length}) must not exceed max_length ({max_length})")
    if max_args < 2:
        raise ValueError(f"max_args must be at least 2, got {max_args}")
    if isinstance(branch_prob, bool) or not isinstance(branch_prob, (int, float)) or not 0.0 < branch_prob < 1.0:
        raise ValueError(f"branch_prob must lie strictly between 0 and 1, got {branch_prob!r}")


def _grow(rng: random.Random, level: int, max_depth: int, max_args: int, branch_prob: float, out: list[str], limit: int) -> int | None:
    """Append one operation at nesting ``level`` (1 = outermost) and return its value, computed
    while the tree grows (not by :func:`evaluate`); None once ``out`` passes ``limit``."""
    op = rng.choice(OPERATORS)
    out.append(op)
    args = []
    for _ in range(rng.randint(2, max_args)):
        if level < max_depth and rng.random() < branch_prob:
            value = _grow(rng, level + 1, max_depth, max_args, branch_prob, out, limit)
            if value is None:
                return None
        else:
            value = rng.randint(0, 9)
            out.append(str(value))
        args.append(value)
        if len(out) > limit:
            return None
    out.append(CLOSE)
    return apply_operator(op, args) if len(out) <= limit else None


def generate_expression(rng: random.Random, *, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
                        max_args: int = 10, branch_prob: float = 0.25, max_tries: int = 10_000) -> tuple[list[str], int]:
    """One expression of ``min_length`` to ``max_length`` tokens and its value (rejection
    sampling of random trees: each argument is a nested operation with probability
    ``branch_prob`` while the depth allows, else a digit; every operation has 2 to
    ``max_args`` arguments)."""
    _check_spec(min_length, max_length, max_depth, max_args, branch_prob)
    for _ in range(max_tries):
        out: list[str] = []
        value = _grow(rng, 1, max_depth, max_args, branch_prob, out, max_length)
        if value is not None and len(out) >= min_length:
            return out, value
    raise DataError(f"no ListOps expression of {min_length}-{max_length} tokens in {max_tries} tries "
                    f"(max_depth {max_depth}, max_args {max_args}, branch_prob {branch_prob}); widen the length range")


def generate_listops(num_samples: int, *, seed: int = 0, min_length: int = 500, max_length: int = 2000,
                     max_depth: int = 10, max_args: int = 10, branch_prob: float = 0.25) -> ListOpsData:
    """``num_samples`` expressions and their labels (the values computed as the trees grow),
    a function of the arguments alone. About 2.5 ms per expression of 500-2000 tokens
    (about 30% of the trees drawn fall in that range)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    rng = random.Random(f"listops:{seed}")
    seqs, labels = [], []
    for _ in range(num_samples):
        expr, value = generate_expression(rng, min_length=min_length, max_length=max_length, max_depth=max_depth,
                                          max_args=max_args, branch_prob=branch_prob)
        labels.append(value)
        seqs.append([TOKEN_ID[t] for t in expr])
    return ListOpsData.from_sequences(seqs, labels)


def decode(ids: torch.Tensor | np.ndarray | Sequence[int]) -> list[str]:
    """Token strings of one sequence of ids (padding dropped)."""
    return [VOCAB[int(i)] for i in ids if int(i) != PAD]


def default_cache_dir() -> str:
    """``$FLT_CACHE_DIR/listops`` if the variable is set, else ``~/.cache/flt/listops``."""
    root = os.environ.get("FLT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flt")
    return os.path.join(root, "listops")


def _params(**kw: object) -> str:
    return f"v{FORMAT_VERSION} " + " ".join(f"{k}={kw[k]}" for k in sorted(kw))


def _cached(path: str, params: str, make: Callable[[], ListOpsData]) -> ListOpsData:
    fix = "delete it to regenerate"
    if os.path.exists(path):
        arrays = load_npz(path, "cached ListOps set", fix)
        if str(arrays.get("params")) != params:
            raise DataError(f"cached ListOps set {path} was made with other parameters ({arrays.get('params')}); {fix}")
        return ListOpsData(torch.from_numpy(arrays["tokens"].astype(np.int64)), torch.from_numpy(arrays["lengths"]),
                           torch.from_numpy(arrays["labels"]))
    data = make()
    arrays = {"tokens": data.tokens.numpy().astype(np.uint8), "lengths": data.lengths.numpy(),
              "labels": data.labels.numpy(), "params": np.array(params)}
    # Readers never see a half-written cache; the file gets the permissions of a plain open().
    atomic_write(path, lambda f: np.savez(f, **arrays), binary=True)
    return data


def load_listops(*, num_train: int = 2000, num_valid: int = 200, seed: int = 0, min_length: int = 500,
                 max_length: int = 2000, max_depth: int = 10, max_args: int = 10, branch_prob: float = 0.25,
                 cache_dir: str | os.PathLike | None = None, num_test: int = 0) -> ListOpsSplits:
    """Generated ListOps (module docstring), cached. Train and validation are independent
    streams (seeds ``2 * seed`` and ``2 * seed + 1``). ``num_test > 0`` adds a test split:
    the ``num_test`` expressions the validation stream draws after its ``num_valid`` (so
    training and validation are those without it). The original has 96k / 2k / 2k."""
    if isinstance(num_test, bool) or not isinstance(num_test, int) or num_test < 0:
        raise ValueError(f"num_test must be a non-negative int, got {num_test!r}")
    spec: dict[str, Any] = {"min_length": min_length, "max_length": max_length, "max_depth": max_depth, "max_args": max_args, "branch_prob": branch_prob}
    folder = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    out = []
    parts = [("train", num_train, 2 * seed), ("valid", num_valid, 2 * seed + 1)]
    if num_test:
        parts.append(("valid+test", num_valid + num_test, 2 * seed + 1))
    for part, n, s in parts:
        params = _params(n=n, seed=s, **spec)
        key = hashlib.sha256(params.encode()).hexdigest()[:16]
        path = os.path.join(folder, f"listops-{part}-{key}.npz")
        out.append(_cached(path, params, functools.partial(generate_listops, n, seed=s, **spec)))
    test = out[2].subset(torch.arange(num_valid, num_valid + num_test)) if num_test else None
    return ListOpsSplits(out[0], out[1], test)


def parse_tokens(source: str) -> list[str]:
    """Token strings of one LRA ``Source`` field (round brackets dropped)."""
    return [t for t in source.replace("(", " ").replace(")", " ").split() if t]


#: Bytes each byte of a ListOps TSV costs once read: a token of two characters becomes an
#: int64 list entry (8 bytes), then a row of the padded int64 table.
TSV_BYTES_PER_BYTE = 8


def _bracket_problem(tokens: list[str]) -> str:
    """What makes ``tokens`` not one expression of balanced brackets ("" when nothing
    does): a ``]`` without an operation, an operation left open, or tokens after the end."""
    if len(tokens) == 1 and tokens[0] not in OPERATORS and tokens[0] != CLOSE:
        return ""  # a lone digit
    depth = 0
    for i, tok in enumerate(tokens):
        if depth == 0 and i > 0:
            return f"token {i + 1} ({tok!r}) comes after the end of the expression"
        if tok in OPERATORS:
            depth += 1
        elif tok == CLOSE:
            if depth == 0:
                return f"token {i + 1} is a ']' that closes no operation"
            depth -= 1
        elif depth == 0:
            return f"token {i + 1} ({tok!r}) lies outside any operation"
    return f"{depth} operation(s) left open (a ']' is missing)" if depth else ""


def read_tsv(path: str | os.PathLike) -> ListOpsData:
    """One LRA ListOps TSV file (``Source<TAB>Target`` with a header line)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"ListOps file {path!r} does not exist")
    seqs, labels = [], []
    with open_regular(path, "ListOps file") as fh:
        check_file_size(path, os.fstat(fh.fileno()).st_size, "ListOps file", bytes_per_byte=TSV_BYTES_PER_BYTE)
        for n, raw in enumerate(fh, 1):
            try:
                # utf-8-sig on the first line: a byte-order mark is not part of the header.
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip() or (n == 1 and line.split("\t")[0].strip() == "Source"):
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise DataError(f"{path}:{n}: expected 'Source<TAB>Target', got {len(fields)} field(s)")
            tokens = parse_tokens(fields[0])
            if not tokens:
                raise DataError(f"{path}:{n}: the source expression is empty")
            unknown = [t for t in tokens if t not in TOKEN_ID or t == VOCAB[PAD]]
            if unknown:
                raise DataError(f"{path}:{n}: unknown tokens {sorted(set(unknown))}")
            problem = _bracket_problem(tokens)
            if problem:
                raise DataError(f"{path}:{n}: the source expression is not well formed: {problem}")
            try:
                label = int(fields[1])
            except ValueError:
                raise DataError(f"{path}:{n}: the target {fields[1]!r} is not a digit") from None
            if not 0 <= label < NUM_CLASSES:
                raise DataError(f"{path}:{n}: the target {label} is not a digit 0-9")
            seqs.append([TOKEN_ID[t] for t in tokens])
            labels.append(label)
    if not seqs:
        raise DataError(f"ListOps file {path} holds no examples")
    return ListOpsData.from_sequences(seqs, labels)


def load_listops_tsv(path: str | os.PathLike) -> ListOpsSplits:
    """The original LRA files: ``path`` is a directory with ``basic_train.tsv``,
    ``basic_val.tsv`` (and optionally ``basic_test.tsv``), or a train file next to which
    ``*_val.tsv`` lies."""
    path = os.fspath(path)
    if os.path.isdir(path):
        names = {part: os.path.join(path, f"basic_{part}.tsv") for part in ("train", "val", "test")}
    else:
        stem = path[: -len("_train.tsv")] if path.endswith("_train.tsv") else None
        if stem is None:
            raise DataError(f"ListOps path {path!r} must be a directory with basic_train.tsv and basic_val.tsv, or a *_train.tsv file")
        names = {part: f"{stem}_{part}.tsv" for part in ("train", "val", "test")}
    # exists, not isfile: a FIFO or a folder of that name is reported by read_tsv as what it is.
    for part in ("train", "val"):
        if not os.path.exists(names[part]):
            raise DataError(f"ListOps needs {names[part]} (the LRA release's {os.path.basename(names[part])})")
    test = read_tsv(names["test"]) if os.path.exists(names["test"]) else None
    return ListOpsSplits(read_tsv(names["train"]), read_tsv(names["val"]), test, name=os.path.basename(path.rstrip("/")))
