"""The decoding benchmark of flt.bench.long at a tiny size: what it measures, not how fast."""

from __future__ import annotations

import json

import pytest
import torch

from flt.bench.long import decode_speed, main, state_bytes
from flt.layers.softmax import KVCache


def test_state_bytes_counts_each_storage_once():
    buf = torch.zeros(4, 8)
    cache = KVCache(buf, buf[:, :2], torch.zeros(1, 3, 1, dtype=torch.float64), 2, [2])
    assert state_bytes([cache, (buf,)]) == 4 * 8 * 4 + 3 * 8


@pytest.mark.usefixtures("one_thread")
def test_decoding_states_are_constant_for_linear_layers_and_grow_for_softmax():
    runs = {(m, n): decode_speed(m, n, new_tokens=2) for m in ("flt", "performer", "softmax+t5") for n in (32, 64)}
    for (mechanism, n), r in runs.items():
        assert r["recurrent"] and r["prompt"] == n and r["new_tokens"] == 2
        assert r["prefill_s"] > 0 and r["tokens_per_s"] > 0
    assert runs["flt", 32]["state"] == ["BandDecodeState"] and runs["softmax+t5", 32]["state"] == ["KVCache"]
    for mechanism in ("flt", "performer"):
        assert runs[mechanism, 32]["state_bytes"] == runs[mechanism, 64]["state_bytes"] > 0
    # The KV cache holds every token (with spare capacity): twice the prompt, about twice the bytes.
    ratio = runs["softmax+t5", 64]["state_bytes"] / runs["softmax+t5", 32]["state_bytes"]
    assert 1.5 < ratio < 2.5


@pytest.mark.usefixtures("one_thread")
def test_the_decode_command_writes_one_row_per_mechanism_and_length(tmp_path, capsys):
    assert main(["--decode", "--mechanisms", "softmax+t5,toeplitz", "--lengths", "16", "--new-tokens", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode.json").read_text())
    assert [(r["mechanism"], r["prompt"], r["recurrent"]) for r in rows] == [("softmax+t5", 16, True), ("toeplitz", 16, False)]
    assert "prefill_s" in rows[0] and "prefill_s" not in rows[1]  # Toeplitz recomputes: no prefill
    with pytest.raises(ValueError, match="new_tokens"):
        decode_speed("flt", 16, new_tokens=0)


def test_the_step_benchmark_writes_its_table_plot_and_the_machine_load(tmp_path, capsys, monkeypatch):
    import flt.bench.long as bench

    loads = iter([0.25, 3.5])
    monkeypatch.setattr(bench, "_load_average", lambda: next(loads))
    argv = ["--mechanisms", "performer", "--lengths", "16,32", "--repeats", "2", "--budget-s", "0.1", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "long.json").read_text())
    assert [(r["mechanism"], r["n"]) for r in rows] == [("performer", 16), ("performer", 32)]
    assert all(r["ms_per_step"] > 0 and r["repeats"] == 2 for r in rows)
    text = (tmp_path / "long.md").read_text()
    assert "load average (1 min) 0.2 before, 3.5 after" in text and "| performer |" in text
    assert (tmp_path / "long.png").stat().st_size > 0
