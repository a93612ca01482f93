"""Text for the causal language model: corpora, tokenizers and next-token windows.

Shapes: a token array is ``[N]``; a batch of windows is ``x, y: [B, T]`` int64 where
``y`` is ``x`` shifted left by one token (``y[:, t]`` is the token after ``x[:, t]``).

Corpora are held as raw ``bytes`` (:class:`TextSplits`) so that byte-level benchmarks
such as enwik8 need no decoding; the character tokenizer decodes UTF-8 itself.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._files import read_regular
from .errors import DataError, MissingDataError, require_dir

#: Standard-library sources appended to the pydoc topics in the default corpus. Paths are
#: relative to ``sysconfig.get_paths()["stdlib"]``; files a Python version lacks are skipped.
STDLIB_SOURCES = (
    "textwrap.py", "string.py", "functools.py", "collections/__init__.py", "dataclasses.py",
    "argparse.py", "json/encoder.py", "json/decoder.py", "typing.py", "enum.py",
    "fractions.py", "statistics.py", "heapq.py", "bisect.py", "difflib.py", "shutil.py",
    "tempfile.py", "logging/__init__.py", "inspect.py", "ast.py", "calendar.py", "random.py",
    "csv.py", "configparser.py", "contextlib.py", "copy.py", "pprint.py", "reprlib.py",
    "numbers.py", "glob.py", "fnmatch.py", "threading.py", "queue.py", "sched.py",
    "base64.py", "ipaddress.py", "urllib/parse.py", "html/parser.py", "tokenize.py",
    "traceback.py", "shlex.py", "getopt.py", "optparse.py", "weakref.py", "types.py",
    "colorsys.py", "gettext.py",
)

#: File names tried, in order, for each split of a WikiText-2/103 directory.
WIKITEXT_FILES = {
    "train": ("wiki.train.tokens", "wiki.train.raw"),
    "valid": ("wiki.valid.tokens", "wiki.valid.raw"),
    "test": ("wiki.test.tokens", "wiki.test.raw"),
}

#: enwik8's standard split, 90M / 5M / 5M bytes, as integer proportions.
ENWIK8_SPLIT = (90, 5, 5)

_DOC_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class TextSplits:
    """Raw bytes of a corpus' splits; ``test`` is ``None`` when the source has none."""

    train: bytes
    valid: bytes
    test: bytes | None = None
    name: str = ""


def _utf8_boundary(data: bytes, i: int) -> int:
    """Largest index ``<= i`` that does not fall inside a UTF-8 multi-byte character."""
    # Continuation bytes look like 0b10xxxxxx; a cut before one would split a character.
    while 0 < i < len(data) and (data[i] & 0xC0) == 0x80:
        i -= 1
    return i


def _python_docs_documents() -> list[tuple[str, bytes]]:
    """``(name, text)`` pairs: every pydoc topic (sorted by key), then :data:`STDLIB_SOURCES`."""
    docs: list[tuple[str, bytes]] = []
    topics: dict[str, str]
    try:
        from pydoc_data import topics as pydoc_topics

        topics = pydoc_topics.topics
    except ImportError:
        # Some distributions strip pydoc_data; the corpus is then the sources alone,
        # which is still deterministic for that installation.
        topics = {}
    docs.extend((f"pydoc:{key}", topics[key].encode("utf-8")) for key in sorted(topics))
    stdlib = sysconfig.get_paths()["stdlib"]
    for rel in STDLIB_SOURCES:
        path = os.path.join(stdlib, *rel.split("/"))
        if os.path.isfile(path):
            with open(path, "rb") as f:
                docs.append((f"stdlib:{rel}", f.read()))
    return docs


def load_python_docs(*, max_bytes: int | None = None, valid_fraction: float = 0.1, test_fraction: float = 0.0) -> TextSplits:
    """The default LM corpus: documentation and standard-library source shipped with Python.

    Documents are the ``pydoc_data.topics`` entries and the files in
    :data:`STDLIB_SOURCES`; nothing is downloaded and the bytes are identical on every call
    for a given Python installation (CPython 3.11.7: 126 documents, 2.17 MB, of which
    0.29 MB or 13% is validation). A document goes to validation when the CRC-32 of its
    name, scaled to ``[0, 1)``, is below ``valid_fraction``, so no document straddles the
    split. With ``test_fraction > 0`` the documents whose scaled CRC-32 lies in
    ``[valid_fraction, valid_fraction + test_fraction)`` are the test split, taken from
    training, so validation is the same documents as without it. Documents are joined by a
    blank line. ``max_bytes`` caps the total: validation and test keep their first
    ``valid_fraction * max_bytes`` and ``test_fraction * max_bytes`` bytes, train the rest
    of the budget, each cut at a UTF-8 character boundary.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must lie strictly between 0 and 1, got {valid_fraction!r}")
    if not 0.0 <= test_fraction < 1.0 - valid_fraction:
        raise ValueError(f"test_fraction must lie in [0, 1 - valid_fraction), got {test_fraction!r}")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 2):
        raise ValueError(f"max_bytes must be None or an integer >= 2, got {max_bytes!r}")
    docs = _python_docs_documents()
    where = [zlib.crc32(name.encode("utf-8")) / 2**32 for name, _ in docs]
    part = ["valid" if u < valid_fraction else "test" if u < valid_fraction + test_fraction else "train" for u in where]
    train, valid, test = (_DOC_SEPARATOR.join(text for (_, text), p in zip(docs, part, strict=True) if p == name)
                          for name in ("train", "valid", "test"))
    if max_bytes is not None:
        n_valid = max(1, int(round(max_bytes * valid_fraction)))
        n_test = int(round(max_bytes * test_fraction))
        train = train[: _utf8_boundary(train, max_bytes - n_valid - n_test)]
        valid = valid[: _utf8_boundary(valid, n_valid)]
        test = test[: _utf8_boundary(test, n_test)]
    if test_fraction and not test:
        raise DataError(f"the Python documentation corpus has an empty test split from {len(docs)} documents; "
                        "raise max_bytes or test_fraction")
    if not train or not valid:
        raise DataError(
            f"the Python documentation corpus has an empty split (train {len(train)} bytes, "
            f"valid {len(valid)} bytes from {len(docs)} documents); raise max_bytes or change valid_fraction"
        )
    return TextSplits(train=train, valid=valid, test=test if test_fraction else None, name="python-docs")


def carve_text_test(splits: TextSplits, test_fraction: float, require_utf8: bool = True) -> TextSplits:
    """``splits`` with a test split: its own when it has one, else the last ``test_fraction``
    of all its bytes cut from the end of training (at a character boundary with
    ``require_utf8``), so validation is untouched."""
    if splits.test is not None:
        return splits
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")
    cut = len(splits.train) - int(round((len(splits.train) + len(splits.valid)) * test_fraction))
    if require_utf8:
        cut = _utf8_boundary(splits.train, cut)
    if cut <= 0 or cut >= len(splits.train):
        raise DataError(f"{splits.name}: {len(splits.train)} training bytes are too few to carve a test split "
                        f"of test_fraction {test_fraction}")
    return TextSplits(train=splits.train[:cut], valid=splits.valid, test=splits.train[cut:], name=splits.name)


#: Bytes each byte of a text file costs once loaded: the bytes, the splits cut from them,
#: and a token of int64 per byte (the byte tokenizer; characters take no more).
TEXT_BYTES_PER_BYTE = 10


def _read_bytes(path: str, what: str, require_utf8: bool) -> bytes:
    data = read_regular(path, what, bytes_per_byte=TEXT_BYTES_PER_BYTE, hint="use a smaller file")
    if not data:
        raise DataError(f"{what} is empty: {path}")
    if require_utf8:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{what} {path} is not valid UTF-8 text (bad byte at offset {e.start}); "
                "to load it as raw bytes, pass --data-opt require_utf8=false to flt train / flt compare "
                "(require_utf8=False in Python)"
            ) from None
    return data


def _find_wikitext(root: str, split: str) -> str | None:
    for name in WIKITEXT_FILES[split]:
        path = os.path.join(root, name)
        if os.path.exists(path):
            return path
    return None


def load_text_files(
    train_path: str | os.PathLike,
    valid_path: str | os.PathLike | None = None,
    test_path: str | os.PathLike | None = None,
    *,
    split: Sequence[int] = ENWIK8_SPLIT,
    require_utf8: bool = True,
) -> TextSplits:
    """Load a local raw-text corpus; nothing is downloaded.

    Three layouts are accepted:

    * ``train_path`` is a directory in the WikiText-2/103 layout: ``wiki.train.tokens``,
      ``wiki.valid.tokens`` and optionally ``wiki.test.tokens`` (or the ``.raw`` names).
    * ``train_path`` and ``valid_path`` (and optionally ``test_path``) are files.
    * ``train_path`` alone is one file, such as enwik8, cut into contiguous train / valid /
      test parts in the integer proportions ``split`` (default 90:5:5, which gives
      enwik8's standard 90M/5M/5M bytes); with ``require_utf8`` the cuts move back to
      the nearest character boundary.

    With ``require_utf8`` every file must be valid UTF-8 (pass ``False`` for byte-level
    data). Missing files raise :class:`MissingDataError`; empty files or splits and
    non-UTF-8 text raise :class:`DataError`; both name the file.
    """
    if not isinstance(require_utf8, bool):
        raise TypeError(f"require_utf8 must be a bool (true or false), got {require_utf8!r}")
    train_path = os.fspath(train_path)
    if os.path.isdir(train_path):
        if valid_path is not None or test_path is not None:
            raise ValueError("valid_path and test_path must be None when train_path is a WikiText directory")
        root = require_dir(train_path, "WikiText directory")
        paths = {s: _find_wikitext(root, s) for s in WIKITEXT_FILES}
        for s in ("train", "valid"):
            if paths[s] is None:
                tried = " or ".join(os.path.join(root, n) for n in WIKITEXT_FILES[s])
                raise MissingDataError(f"WikiText {s} file not found: tried {tried}")
        train_file, valid_file, test_file = paths["train"], paths["valid"], paths["test"]
        assert train_file is not None and valid_file is not None  # checked above
        test = _read_bytes(test_file, "WikiText test file", require_utf8) if test_file else None
        return TextSplits(
            train=_read_bytes(train_file, "WikiText train file", require_utf8),
            valid=_read_bytes(valid_file, "WikiText valid file", require_utf8),
            test=test,
            name=os.path.basename(os.path.normpath(root)),
        )
    if valid_path is not None:
        test = _read_bytes(os.fspath(test_path), "test file", require_utf8) if test_path is not None else None
        return TextSplits(
            train=_read_bytes(train_path, "train file", require_utf8),
            valid=_read_bytes(os.fspath(valid_path), "validation file", require_utf8),
            test=test,
            name=os.path.basename(train_path),
        )
    if test_path is not None:
        raise ValueError("test_path needs valid_path as well")
    if len(split) != 3 or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in split):
        raise ValueError(f"split must be three positive integers (train, valid, test), got {split!r}")
    data = _read_bytes(train_path, "text file", require_utf8)
    total = sum(split)
    # Integer arithmetic keeps enwik8's 90M/5M/5M cut exact.
    a = len(data) * split[0] // total
    b = len(data) * (split[0] + split[1]) // total
    if require_utf8:
        a, b = _utf8_boundary(data, a), _utf8_boundary(data, b)
    parts = {"train": data[:a], "valid": data[a:b], "test": data[b:]}
    for s, part in parts.items():
        if not part:
            raise DataError(
                f"text file {train_path} ({len(data)} bytes) is too small: its {s} split "
                f"under proportions {tuple(split)} is empty"
            )
    return TextSplits(name=os.path.basename(train_path), **parts)


def _as_id_array(ids: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"token ids must be a 1-D integer sequence, got shape {arr.shape} and dtype {arr.dtype}")
    return arr.astype(np.int64)


class ByteTokenizer:
    """Bytes as tokens: ``vocab_size = 256``, id ``i`` is the byte ``i``."""

    vocab_size = 256

    @classmethod
    def fit(cls, train: bytes | str) -> ByteTokenizer:
        """Registry constructor; the byte vocabulary needs no training text."""
        return cls()

    def encode(self, data: bytes | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``str`` (encoded as UTF-8) or ``bytes`` -> ids ``[N]`` of ``dtype``."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        # bytearray gives torch.frombuffer a writable buffer (it warns on read-only bytes).
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dtype) if data else torch.zeros(0, dtype=dtype)

    def decode(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> str:
        """Ids ``[N]`` -> text; byte runs that are not UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> bytes:
        arr = _as_id_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte token ids must lie in [0, 255], got range [{arr.min()}, {arr.max()}]")
        return arr.astype(np.uint8).tobytes()


class CharTokenizer:
    """Unicode characters as tokens, with the vocabulary taken from the training text.

    Id 0 is reserved for characters not seen in training (validation text may contain
    some); ids ``1..len(chars)`` are the sorted characters. ``vocab_size = len(chars) + 1``.
    """

    UNKNOWN = "\ufffd"

    def __init__(self, chars: str):
        codes = np.unique(np.frombuffer(chars.encode("utf-32-le"), dtype="<u4"))
        if codes.size == 0:
            raise ValueError("CharTokenizer needs at least one character")
        self._codes = codes.astype(np.uint32)
        self.chars = "".join(chr(c) for c in self._codes)
        self.vocab_size = len(self.chars) + 1

    @classmethod
    def fit(cls, train: bytes | str) -> CharTokenizer:
        """Vocabulary = the distinct characters of ``train`` (UTF-8 if given as bytes)."""
        return cls(_to_text(train))

    def encode(self, data: bytes | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Text -> ids ``[N]`` (one per character); unseen characters map to 0."""
        codes = np.frombuffer(_to_text(data).encode("utf-32-le"), dtype="<u4")
        idx = np.searchsorted(self._codes, codes)
        safe = np.minimum(idx, len(self._codes) - 1)
        found = self._codes[safe] == codes
        ids = np.where(found, idx + 1, 0).astype(np.int64)
        return torch.from_numpy(ids).to(dtype)

    def decode(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> str:
        """Ids ``[N]`` -> text; id 0 becomes U+FFFD."""
        arr = _as_id_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size - 1}], got range [{arr.min()}, {arr.max()}]")
        table = np.concatenate([[ord(self.UNKNOWN)], self._codes]).astype("<u4")
        return table[arr].tobytes().decode("utf-32-le")


def _to_text(data: bytes | str) -> str:
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"text is not valid UTF-8 (bad byte at offset {e.start}); use the byte tokenizer") from None


#: Tokenizer constructors, one signature: ``fit(train_bytes_or_text) -> tokenizer``.
TOKENIZERS: dict[str, Callable[[bytes | str], ByteTokenizer | CharTokenizer]] = {"byte": ByteTokenizer.fit, "char": CharTokenizer.fit}


class LMDataset(torch.utils.data.Dataset):
    """Next-token windows over one token array ``tokens [N]`` (any integer dtype).

    Item ``i`` is the ``i``-th non-overlapping window: ``x = tokens[i*T : i*T + T]`` and
    ``y = tokens[i*T + 1 : i*T + T + 1]``, both int64 ``[T]``. There are
    ``(N - 1) // T`` items; the last ``(N - 1) % T`` targets are not covered.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 1:
            raise TypeError(f"tokens must be a 1-D torch.Tensor [N], got {type(tokens).__name__}"
                            + (f" of shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else ""))
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {tokens.numel()}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = (i % len(self)) * self.seq_len
        w = self.tokens[start : start + self.seq_len + 1].long()
        return w[:-1], w[1:]

    def _windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        w = self.tokens[idx].long()
        return w[:, :-1], w[:, 1:]

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows at uniform random offsets: ``x, y [B, T]`` int64.

        Offsets come from ``generator`` alone, so a seeded generator gives the same batches.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        high = self.tokens.numel() - self.seq_len  # last valid start, plus one
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        return self._windows(starts)

    def eval_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every item in order, ``batch_size`` at a time: ``x, y [b, T]`` with ``b <= B``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        for first in range(0, len(self), batch_size):
            n = min(batch_size, len(self) - first)
            yield self._windows((torch.arange(n) + first) * self.seq_len)
