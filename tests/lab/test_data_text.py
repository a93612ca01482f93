"""Text data: the bundled corpus, local corpora, tokenizers and next-token windows."""

from __future__ import annotations

import os

import pytest
import torch

from flt.data import (
    TOKENIZERS,
    ByteTokenizer,
    CharTokenizer,
    DataError,
    LMDataset,
    MissingDataError,
    load_python_docs,
    load_text_files,
)
from flt.data.text import _python_docs_documents


@pytest.fixture(scope="module")
def docs():
    return load_python_docs()


def test_python_docs_is_deterministic_and_sized(docs):
    again = load_python_docs()
    assert again == docs
    total = len(docs.train) + len(docs.valid)
    assert 1_000_000 < total < 3_500_000
    assert 0.03 < len(docs.valid) / total < 0.25
    docs.train.decode("utf-8")
    docs.valid.decode("utf-8")


def test_python_docs_split_is_by_document(docs):
    # Every sizeable document lies wholly in exactly one split.
    for name, text in _python_docs_documents():
        if len(text) < 2000:
            continue
        in_train, in_valid = text in docs.train, text in docs.valid
        assert in_train != in_valid, name


def test_python_docs_max_bytes_takes_prefixes(docs):
    small = load_python_docs(max_bytes=10_000, valid_fraction=0.1)
    assert len(small.train) + len(small.valid) <= 10_000
    assert len(small.valid) == 1000
    assert docs.train.startswith(small.train) and docs.valid.startswith(small.valid)


@pytest.mark.parametrize("kwargs", [{"max_bytes": 1}, {"max_bytes": 1.5e6}, {"valid_fraction": 0.0}, {"valid_fraction": 1.0}])
def test_python_docs_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        load_python_docs(**kwargs)


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "plain ASCII, accents é, CJK 漢字, emoji 🙂"
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text.encode()),)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode()
    assert tok.encode(b"\xff\x00").tolist() == [255, 0]
    assert tok.encode("").shape == (0,)
    with pytest.raises(ValueError):
        tok.decode([256])


def test_char_tokenizer_roundtrip_and_unknowns():
    train = "abcab é漢"
    tok = CharTokenizer.fit(train.encode("utf-8"))
    assert tok.vocab_size == len(set(train)) + 1
    ids = tok.encode(train)
    assert ids.shape == (len(train),) and int(ids.min()) >= 1
    assert tok.decode(ids) == train
    # Characters absent from training map to id 0 and decode as U+FFFD.
    assert tok.encode("az").tolist() == [tok.encode("a").item(), 0]
    assert tok.decode(tok.encode("az")) == "a\ufffd"
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    with pytest.raises(DataError, match="UTF-8"):
        CharTokenizer.fit(b"ok \xff")


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_registry_tokenizers_roundtrip_corpus(name, docs):
    tok = TOKENIZERS[name](docs.train)
    text = docs.valid[:20_000].decode("utf-8", errors="ignore")
    ids = tok.encode(text)
    assert int(ids.max()) < tok.vocab_size
    if name == "char":
        assert int((ids == 0).sum()) == sum(ch not in tok.chars for ch in text)
        text = "".join(ch for ch in text if ch in tok.chars)
        ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_lm_windows_shift_by_one_and_sampling_is_seeded():
    tokens = torch.arange(1000) * 7  # distinct values, so a window's first token gives its offset
    ds = LMDataset(tokens, seq_len=16)
    x, y = ds.sample(8, generator=torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = x[:, 0] // 7
    offsets = starts[:, None] + torch.arange(16)
    assert torch.equal(x, tokens[offsets]) and torch.equal(y, tokens[offsets + 1])
    x2, y2 = ds.sample(8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = ds.sample(8, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(x, x3)


def test_lm_sampling_reaches_both_ends():
    tokens = torch.arange(11, dtype=torch.uint8)
    ds = LMDataset(tokens, seq_len=4)
    x, y = ds.sample(400, generator=torch.Generator().manual_seed(0))
    assert int(x[:, 0].min()) == 0 and int(y[:, -1].max()) == 10


def test_lm_eval_batches_cover_tokens_in_order():
    tokens = torch.arange(103)
    ds = LMDataset(tokens, seq_len=10)
    assert len(ds) == 10
    batches = list(ds.eval_batches(4))
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x.flatten(), tokens[:100]) and torch.equal(y.flatten(), tokens[1:101])
    assert torch.equal(ds[3][0], tokens[30:40]) and torch.equal(ds[3][1], tokens[31:41])
    assert torch.equal(ds[-1][0], tokens[90:100])
    with pytest.raises(IndexError):
        ds[10]


def test_lm_dataset_rejects_bad_input():
    with pytest.raises(ValueError, match="at least"):
        LMDataset(torch.arange(5), seq_len=5)
    with pytest.raises(TypeError):
        LMDataset(torch.rand(50), seq_len=4)
    with pytest.raises(TypeError):
        LMDataset(torch.arange(50).view(5, 10), seq_len=4)
    with pytest.raises(ValueError):
        LMDataset(torch.arange(50), seq_len=0)
    with pytest.raises(ValueError):
        LMDataset(torch.arange(50), seq_len=4).sample(0)


def _write(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_wikitext_directory(tmp_path):
    for split, text in [("train", " = Title = \n a b c \n"), ("valid", " d e \n"), ("test", " f \n")]:
        _write(tmp_path / f"wiki.{split}.tokens", text.encode())
    s = load_text_files(tmp_path)
    assert (s.train, s.valid, s.test) == (b" = Title = \n a b c \n", b" d e \n", b" f \n")
    os.remove(tmp_path / "wiki.test.tokens")
    assert load_text_files(tmp_path).test is None
    os.remove(tmp_path / "wiki.valid.tokens")
    with pytest.raises(MissingDataError, match="wiki.valid.tokens"):
        load_text_files(tmp_path)


def test_separate_files(tmp_path):
    tr = _write(tmp_path / "a.txt", b"train text")
    va = _write(tmp_path / "b.txt", b"valid text")
    s = load_text_files(tr, va)
    assert (s.train, s.valid, s.test) == (b"train text", b"valid text", None)


def test_single_file_enwik8_proportions(tmp_path):
    data = bytes(range(32, 127)) * 20 + b"\n"  # 1901 bytes
    s = load_text_files(_write(tmp_path / "enwik8", data))
    assert (len(s.train), len(s.valid)) == (1901 * 90 // 100, 1901 * 95 // 100 - 1901 * 90 // 100)
    assert s.train + s.valid + s.test == data


def test_single_file_cuts_at_character_boundaries(tmp_path):
    data = ("é" * 500).encode()  # every character is 2 bytes, 1000 bytes in all
    data = b"x" + data  # odd offset: the proportional cut points fall inside characters
    s = load_text_files(_write(tmp_path / "t.txt", data))
    for part in (s.train, s.valid, s.test):
        part.decode("utf-8")
    assert s.train + s.valid + s.test == data
    raw = load_text_files(tmp_path / "t.txt", require_utf8=False)
    assert len(raw.train) == len(data) * 90 // 100


def test_text_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text_files(missing)
    with pytest.raises(MissingDataError, match="nope.txt"):
        load_text_files(_write(tmp_path / "ok.txt", b"fine"), missing)
    empty = _write(tmp_path / "empty.txt", b"")
    with pytest.raises(DataError, match="empty.txt"):
        load_text_files(empty)
    latin1 = _write(tmp_path / "latin1.txt", "caf\xe9 au lait".encode("latin-1") * 10)
    with pytest.raises(DataError, match="latin1.txt.*UTF-8"):
        load_text_files(latin1)
    assert load_text_files(latin1, require_utf8=False).train
    tiny = _write(tmp_path / "tiny.txt", b"abc")
    with pytest.raises(DataError, match="tiny.txt.*empty"):
        load_text_files(tiny)
    with pytest.raises(ValueError):
        load_text_files(tiny, split=(1, 0, 1))
