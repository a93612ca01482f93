"""Memory of decoding after prompts of several lengths: a linearised model's ``FLTCache``
state against its softmax original's KV cache.

    python scripts/decode_state_size.py --linearized RUN/model --softmax MODEL_DIR \\
        [--lengths 1024 8192] [--new-tokens 8] [--threads 1] [--out sizes.json]

The prompts are the first ``L`` tokens of the validation text of the embedded
Python-documentation corpus (bytes, as ``examples/train_tiny_llama.py`` trains on). Each
model generates ``--new-tokens`` greedy tokens after the prompt; the bytes its cache holds
afterwards are reported: ``FLTCache.state_bytes()`` (flt's constant-size state, with
``near_field`` also the last ``w + 1`` keys and values) and, for the softmax model, the keys
and values of its ``DynamicCache``. The linearised model also generates through its
default cache once, as a check that both caches give the same tokens.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from flt.train.linearize import byte_ids, load_text
from flt.integrations.transformers import FLTCache, from_pretrained


def kv_bytes(cache) -> int:
    """Bytes of the keys and values a ``transformers`` cache holds."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--linearized", required=True, help="the model/ folder of an flt linearize run")
    p.add_argument("--softmax", help="the softmax checkpoint it came from (its KV cache is measured too)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    valid = byte_ids(load_text(None)[1])
    linear = from_pretrained(args.linearized).eval()
    softmax = AutoModelForCausalLM.from_pretrained(args.softmax).eval() if args.softmax else None
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            prompt = valid[:length].view(1, -1)
            cache = FLTCache()
            out = linear.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, cache=cache)
            same = torch.equal(out, linear.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False))
            row = {"prompt_tokens": length, "fltcache_bytes": cache.state_bytes(), "same_tokens_as_default_cache": same}
            if softmax is not None:
                kv = DynamicCache(config=softmax.config)
                softmax.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, cache=kv)
                row["softmax_kv_bytes"] = kv_bytes(kv)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
