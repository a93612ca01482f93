"""Converting a Hugging Face decoder to FLT, and linearising a trained one.

Part 1 converts a small Llama in place: every attention module gets an FLT core, every
projection keeps its weights. FLT's exact path with ``f = 0`` is softmax itself, so the
converted model reproduces the original's logits; the linear estimator then generates from
a state of constant size (``FLTCache``). Part 2 trains a byte-level softmax Llama
(``examples/train_tiny_llama.py``) and runs ``flt linearize`` on it: attention transfer
(each FLT core learns to reproduce its softmax layer), then fine-tuning, with the
perplexity before and after. Needs the hf extra (``pip install "flt-attention[hf]"``,
Python 3.11+).

    python examples/linearize_hf.py            # a 4-layer model: a few minutes on a CPU
    python examples/linearize_hf.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flt import cli
from flt.integrations.transformers import FLTCache, convert


def convert_in_place() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config).double().eval()
    ids = torch.randint(1, 100, (1, 24))
    softmax_logits = model(ids).logits

    convert(model, "flt", path="exact", qk_norm=False)  # the attention FLT estimates, with f = 0
    gap = (model(ids).logits - softmax_logits).abs().max().item()
    print(f"exact path: largest logit difference from the softmax original {gap:.1e}")
    assert gap < 1e-9

    # The linear estimator: an exact band of 8 tokens, random features beyond it.
    convert(model, "flt", near_field=8, num_features=64, seed=0)
    cache = FLTCache()
    out = model.generate(ids[:, :4], max_new_tokens=16, do_sample=False, cache=cache)
    print(f"generated {out.shape[1] - 4} tokens from a {cache.state_bytes()}-byte state")


def linearize(smoke: bool, work: Path) -> None:
    softmax, run = work / "softmax", work / "linearized"
    size = ["--smoke"] if smoke else ["--steps", "1500", "--layers", "4", "--width", "128"]
    subprocess.run([sys.executable, str(Path(__file__).with_name("train_tiny_llama.py")), "--out-dir", str(softmax), *size], check=True)
    steps = ["--transfer-steps", "2", "--finetune-steps", "2", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1"] if smoke else []
    # The tiny Llama was trained on bytes and saved without a tokenizer: --bytes says so.
    code = cli.main(["linearize", str(softmax), "--out-dir", str(run), "--attention", "flt:near_field=16", "--bytes",
                     *steps, "--threads", "1", "--no-progress", "--no-plots"])
    if code:
        raise SystemExit(code)
    summary = json.loads((run / "summary.json").read_text())
    print("perplexities:", {name: round(ppl, 2) for name, ppl in summary["ppl"].items()})
    # run / "model" loads with flt.integrations.transformers.from_pretrained.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models and a few steps")
    args = parser.parse_args()
    convert_in_place()
    with tempfile.TemporaryDirectory() as work:
        linearize(args.smoke, Path(work))


if __name__ == "__main__":
    main()
