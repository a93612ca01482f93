"""``flt linearize MODEL_DIR``: turn a trained softmax decoder into an FLT model by
attention transfer and fine-tuning (:mod:`flt.train.linearize`).

``MODEL_DIR`` is any local ``transformers`` checkpoint of a causal LM of the Llama family
(Llama, Qwen2, Mistral) or GPT-2 (``save_pretrained``; nothing is downloaded), with its
tokenizer, or, with ``--bytes``, a model trained on bytes without one. Its
attention is converted to ``--attention`` (the syntax of ``flt train``: a mechanism and
its options), then the cores are trained to reproduce each softmax layer's output
(``--transfer outputs``, the default), its attention weights (``--transfer weights``: the
KL divergence of the core's weights from the softmax's, row by row) or both (``--transfer
both``), for ``--transfer-steps`` steps (cores only, original weights frozen), then ``--finetune``
parameters train on next-token loss (``--finetune-steps``). The run directory holds
``metrics.jsonl``, ``checkpoints/``, ``summary.json`` (validation perplexity: softmax,
converted, after transfer, after fine-tuning), ``learning_curves.png`` and ``model/``
(the linearised model, to load with the transformers integration's
:func:`~flt.integrations.transformers.from_pretrained`, docs/integrations.md). Needs the
``hf`` extra.

Examples::

    python examples/train_tiny_llama.py --out-dir runs/tiny-llama
    flt linearize runs/tiny-llama --bytes --out-dir runs/tiny-llama-flt --transfer-steps 100 --finetune-steps 200
    flt linearize runs/tiny-llama --bytes --attention flt:near_field=8 --out-dir runs/tiny-llama-band8   # a narrower band
    flt linearize runs/tiny-llama --bytes --transfer weights --out-dir runs/tiny-llama-weights   # match attention weights
    flt linearize runs/tiny-llama --bytes --attention performer:feature_map=hedgehog:num_features=64 --out-dir runs/tiny-llama-hedgehog
    flt linearize runs/tiny-llama --bytes --out-dir runs/tiny-llama-flt --resume   # continue a stopped run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from flt.commands import THREADS_HELP, default_threads

if TYPE_CHECKING:
    from flt.train.linearize import LinearizeConfig

#: Flags that set a :class:`flt.train.linearize.LinearizeConfig` field of the same
#: name: ``{field: (type, help)}``; the defaults are the config's.
CONFIG_FLAGS = {
    "seq_len": (int, "tokens per training and validation window"),
    "batch_size": (int, "windows per step (and per validation batch)"),
    "transfer_steps": (int, "steps of attention transfer (0: none)"),
    "finetune_steps": (int, "steps of fine-tuning (0: none)"),
    "transfer_lr": (float, "peak learning rate of attention transfer"),
    "finetune_lr": (float, "peak learning rate of fine-tuning"),
    "warmup_steps": (int, "linear warm-up at the start of each stage"),
    "eval_every": (int, "steps between validations (each stage's end is validated too)"),
    "eval_batches": (int, "validation batches per evaluation, the same windows every time"),
    "checkpoint_every": (int, "steps between checkpoints (each stage's end is saved too)"),
    "seed": (int, "seed of the random features (unless --attention sets one) and of the batches"),
    "valid_fraction": (float, "share of --data kept for validation"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from flt.train.linearize import TRANSFER, LinearizeConfig

    defaults = LinearizeConfig()
    p = subparsers.add_parser(
        "linearize", help="convert a trained transformers decoder to FLT: attention transfer, then fine-tuning",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a local transformers checkpoint (save_pretrained) of a softmax decoder")
    p.add_argument("--data", metavar="PATH", help="a UTF-8 text file, its last --valid-fraction for validation "
                   "(default: the embedded Python-documentation corpus)")
    p.add_argument("--out-dir", required=True, help="run directory")
    p.add_argument("--attention", default="flt", metavar="NAME[:KEY=VALUE...]",
                   help="the mechanism the attention becomes, with its options, as in flt train --attention (default: flt with "
                   f"{':'.join(f'{k}={json.dumps(v)}' for k, v in defaults.attention_options.items())}; for flt, options given "
                   "override these one by one; other mechanisms take only the options given)")
    p.add_argument("--attn-opt", action="append", metavar="KEY=VALUE", help="attention option (repeatable)")
    p.add_argument("--transfer", choices=TRANSFER, default=defaults.transfer,
                   help="what attention transfer matches: each softmax layer's output, its attention weights (KL per row, "
                   "as Hedgehog and LoLCATs), or both (default: outputs)")
    p.add_argument("--bytes", action="store_true", help="train on the text's bytes as token ids 0..255: for a model trained "
                   "on bytes, whose MODEL_DIR has no tokenizer (without --bytes, such a MODEL_DIR is refused)")
    p.add_argument("--finetune", choices=("all", "attention", "cores"), default="all",
                   help="what trains in fine-tuning: the whole model, the attention modules, or the flt cores (default: all)")
    for name, (kind, text) in CONFIG_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"{text} (default: {getattr(defaults, name)})")
    p.add_argument("--resume", action="store_true", help="continue the run in --out-dir from its latest checkpoint (same options)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: cpu)")
    p.add_argument("--threads", type=int, default=default_threads(), help=THREADS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> LinearizeConfig:
    """The :class:`~flt.train.linearize.LinearizeConfig` the flags describe; the
    attention options are checked here, before any model loads."""
    from flt.options import merge_options, parse_assignments, parse_attention
    from flt.train.linearize import LinearizeConfig, check_attention

    name, entry = parse_attention(args.attention)
    options = merge_options(entry, parse_assignments(args.attn_opt, "--attn-opt"), entry_source=f"--attention {args.attention}")
    changes = {k: getattr(args, k) for k in CONFIG_FLAGS if getattr(args, k) is not None}
    defaults = LinearizeConfig()
    if name == defaults.attention:  # the options given override the default mechanism's defaults one by one
        options = {**defaults.attention_options, **options}
    changes["attention_options"] = options
    # Recorded absolute, so that --resume from another directory finds the same text.
    data = None if args.data is None else os.path.abspath(args.data)
    config = LinearizeConfig(attention=name, data=data, finetune=args.finetune, transfer=args.transfer, byte_tokens=args.bytes,
                             **changes)
    return check_attention(config)


def run(args: argparse.Namespace) -> int:
    import torch

    from flt.commands.outputs import check_output_dir, plots_available

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    config = config_from_args(args)
    check_output_dir(args.out_dir)
    plots = not args.no_plots and plots_available("linearize")
    from flt.train.linearize import LinearizeInterrupted, linearize

    try:
        linearize(args.model_dir, args.out_dir, config, resume=args.resume, device=args.device,
                  progress=not args.no_progress, plots=plots)
    except LinearizeInterrupted as stop:
        where = f"last checkpoint {stop.checkpoint}; resume with --resume" if stop.checkpoint else "no checkpoint yet"
        print(f"flt linearize: interrupted after step {stop.step} of {stop.steps}; {where}", file=sys.stderr, flush=True)
        return 130
    return 0
