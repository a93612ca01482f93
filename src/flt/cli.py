"""The ``flt`` console script: one entry point, one module per subcommand.

Each module in :mod:`flt.commands` exposes ``add_parser(subparsers)`` (which sets
``func`` on its parser) and keeps its heavy imports inside the function it runs, so
``flt --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand modules, in the order ``flt --help`` lists them.
COMMANDS = ("approx", "bench", "train", "evaluate", "compare", "search", "generate", "fit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flt", description="FourierLearner-Transformers: RPE in linear-time attention.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"flt.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    # The arguments as given, for commands that print how to run them again (flt train
    # after Ctrl-C prints its command with --resume).
    args.argv = argv
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as err:
        # Bad input from the user: one clear line, no traceback.
        print(f"flt {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
