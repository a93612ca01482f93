"""The scripts of the linearisation measurement: ``examples/train_tiny_llama.py`` saves a
softmax model ``flt linearize`` reads, and ``scripts/decode_state_size.py`` reports an
``FLTCache`` whose size does not grow with the prompt while the softmax KV cache does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cli

pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
EXAMPLES = SCRIPTS.parent / "examples"
ENV = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent / "src")}


def _run(*argv) -> str:
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, env=ENV, check=True).stdout


@pytest.mark.slow  # three subprocesses: about 20 s of CPU
def test_tiny_llama_trains_and_linearized_state_stays_constant(tmp_path):
    softmax = tmp_path / "softmax"
    _run(EXAMPLES / "train_tiny_llama.py", "--smoke", "--out-dir", softmax)
    trained = json.loads((softmax / "train_summary.json").read_text())
    assert trained["valid"]["step"] == 20 and trained["valid"]["ppl"] < 256  # below the uniform guess over bytes
    _run("-m", "flt", "linearize", softmax, "--bytes", "--out-dir", tmp_path / "run", "--attention", "flt:near_field=4:num_features=16",
         "--seq-len", "32", "--batch-size", "2", "--transfer-steps", "1", "--finetune-steps", "1", "--eval-batches", "1",
         "--threads", "1", "--no-progress", "--no-plots")
    _run(SCRIPTS / "decode_state_size.py", "--linearized", tmp_path / "run" / "model", "--softmax", softmax,
         "--lengths", "16", "64", "--new-tokens", "2", "--out", tmp_path / "sizes.json")
    short, long = json.loads((tmp_path / "sizes.json").read_text())["rows"]
    assert short["fltcache_bytes"] == long["fltcache_bytes"] > 0
    assert long["softmax_kv_bytes"] > 3 * short["softmax_kv_bytes"]
    assert short["same_tokens_as_default_cache"] and long["same_tokens_as_default_cache"]
