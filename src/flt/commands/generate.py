"""``flt generate CHECKPOINT``: continue a prompt with a trained language model.

``CHECKPOINT`` is a run directory (its latest checkpoint) or one checkpoint directory.
Linear mechanisms decode with their constant-size recurrent state, so the text may be
longer than the training context; ``--recompute`` recomputes the last ``max_len``
tokens at every step instead (the only way for mechanisms without a state).

Example::

    flt generate runs/lm-flt-small-s0 --prompt "def " --max-new-tokens 300
"""

from __future__ import annotations

import argparse
import math

from flt.commands import THREADS_HELP, default_threads

#: Temperatures outside these divide the logits into infinities (a tiny one: use 0 for
#: greedy) or into a uniform draw that no longer depends on the model (a huge one).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
#: More new tokens than this is a typo: the text is held and printed whole.
MAX_NEW_TOKENS = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from a language-model checkpoint",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="run directory or checkpoint directory of a language model")
    p.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k most likely tokens; 0 = all (default: 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, a non-negative integer (default: 0)")
    p.add_argument("--recompute", action="store_true", help="recompute the context each step instead of the recurrent state")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=int, default=default_threads(), help=THREADS_HELP)
    p.set_defaults(func=run)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse values that would fail (or sample garbage) only once the model is loaded."""
    from flt.options import check_seed, check_threads

    if not 0 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens must lie in [0, {MAX_NEW_TOKENS}], got {args.max_new_tokens}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {args.top_k}")
    if not (math.isfinite(args.temperature) and (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE)):
        raise ValueError(f"--temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                         f"got {args.temperature}")
    check_seed(args.seed, "--seed")
    check_threads(args.threads)


def run(args: argparse.Namespace) -> int:
    from flt.commands.outputs import check_run_path

    check_arguments(args)
    check_run_path(args.checkpoint)
    import torch

    from flt.tasks.lm import LMTask, as_causal_lm, generate_text, tokenizer_from_extra
    from flt.train import load_checkpoint_model
    from flt.train.distributed import resolve_device

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, meta = load_checkpoint_model(args.checkpoint, device=device)
    task = meta["model"].get("task")  # load_checkpoint_model checked that the model record is a dict
    if task != LMTask.name:
        article = "an" if str(task)[:1] in "aeiou" else "a"  # 'image' -> "an 'image' model"
        raise ValueError(f"{args.checkpoint} holds {article} {task!r} model; generation needs a language model ({LMTask.name!r})")
    tokenizer = tokenizer_from_extra(meta.get("extra", {}))
    text = generate_text(
        as_causal_lm(model), tokenizer, args.prompt, args.max_new_tokens, device=device, temperature=args.temperature,
        top_k=args.top_k or None, seed=args.seed, recurrent=False if args.recompute else None,
    )
    print(text)
    return 0
