"""Train a tiny Llama with softmax attention on the embedded Python-documentation corpus
through ``transformers``, and save it with ``save_pretrained``: the model that
``flt linearize`` turns into an FLT model (docs/integrations.md, "Linearising a trained model").

    python examples/train_tiny_llama.py --out-dir /tmp/tiny-llama [--steps 1500] [--layers 4] \\
        [--width 128] [--heads 4] [--seq-len 128] [--batch-size 16] [--threads 1]
    python examples/train_tiny_llama.py --smoke --out-dir /tmp/tiny-llama-smoke   # seconds

Tokens are bytes (``vocab_size = 256``, no tokenizer files: ``flt linearize --bytes`` reads
such a checkpoint as bytes). Batches are random windows drawn from ``(seed, step)``
(:func:`flt.train.linearize.window_batch`); AdamW with a linear warm-up and a cosine
decay; validation perplexity by :func:`flt.train.linearize.perplexity`, the function
``flt linearize`` reports with, written with the settings to ``OUT/train_summary.json``.
Measured run time and perplexity are in docs/integrations.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flt.tasks.preset import RunConfig
from flt.train.linearize import (
    byte_ids,
    load_text,
    next_token_loss,
    perplexity,
    window_batch,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="where save_pretrained writes the model")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="2 layers of width 32, 20 steps: a check that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.layers, args.width, args.heads, args.seq_len = 20, 2, 32, 2, 32
        args.batch_size, args.warmup_steps, args.eval_every, args.eval_batches = 4, 2, 10, 2
    return args


def tiny_llama(layers: int, width: int, heads: int, seed: int) -> LlamaForCausalLM:
    """A byte-level Llama: SwiGLU width ``8/3 * width``, tied embeddings, room for 8k-token prompts."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=(8 * width // 3 + 7) // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=16384, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = tiny_llama(args.layers, args.width, args.heads, args.seed)
    train_text, valid_text, corpus = load_text(None)
    train_ids, valid_ids = byte_ids(train_text), byte_ids(valid_text)
    schedule = RunConfig(steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    history, start = [], time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        loss = next_token_loss(model, window_batch(train_ids, step, args.batch_size, args.seq_len, args.seed))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.steps:
            valid = perplexity(model, valid_ids, seq_len=args.seq_len, batch_size=args.batch_size, max_batches=args.eval_batches)
            history.append({"step": step, "train_loss": float(loss.detach()), **valid, "elapsed_s": time.perf_counter() - start})
            print(f"step {step}: train loss {float(loss.detach()):.4f}  valid ppl {valid['ppl']:.3f}", flush=True)
    out = Path(args.out_dir)
    model.save_pretrained(out)
    summary = {"settings": {k: v for k, v in vars(args).items() if k != "smoke"}, "corpus": corpus,
               "parameters": sum(p.numel() for p in model.parameters()), "history": history,
               "valid": history[-1], "train_time_s": time.perf_counter() - start}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print(f"saved {out} ({summary['parameters']:,} parameters, {summary['train_time_s']:.0f} s)")


if __name__ == "__main__":
    main()
