"""The ``flt`` console script: one entry point, one module per subcommand.

Each module in :mod:`flt.commands` exposes ``add_parser(subparsers)`` (which sets
``func`` on its parser) and keeps its heavy imports inside the function it runs, so
``flt --help`` stays fast.

Every command fails the same way (:mod:`flt.commands.failures`): an expected failure (bad
input, a full disk, out of memory, Ctrl-C) is one line ``flt COMMAND: error: CAUSE`` and
exit status 2 (bad input), 1 (a failure at run time) or 130 (Ctrl-C), without a
traceback; ``flt --debug COMMAND ...`` shows the traceback instead. Any other exception is
a bug in flt and keeps its traceback, under a line that says so.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import NoReturn

from flt.commands.helptext import plain_parser

#: Subcommand modules, in the order ``flt --help`` lists them.
COMMANDS = ("approx", "bench", "train", "evaluate", "compare", "search", "generate", "fit", "linearize")


def version() -> str:
    """The installed distribution's version (``importlib.metadata``), or the package's own
    when flt runs from a checkout that is not installed."""
    from importlib import metadata

    try:
        return metadata.version("flt-attention")
    except metadata.PackageNotFoundError:
        from flt import __version__

        return __version__


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for (keeps ``flt --help`` fast)."""

    # argparse passes `help` by that name.
    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: object = argparse.SUPPRESS, help: str | None = None) -> None:  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> NoReturn:
        print(f"flt {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flt", description="FourierLearner-Transformers: RPE in linear-time attention.")
    parser.add_argument("--version", action=_VersionAction, help="print flt's version and exit")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of any failure instead of the one-line error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            importlib.import_module(f"flt.commands.{name}").add_parser(sub)
        except ImportError as err:
            _add_unavailable(sub, name, err)
    # The descriptions are the modules' docstrings, in reStructuredText: shown as plain text.
    plain_parser(parser)
    return parser


def _add_unavailable(sub: argparse._SubParsersAction, name: str, err: ImportError) -> None:
    """List command ``name``, whose module needs an extra that is not installed (the
    library alone has torch and einops), so that ``flt --help`` and ``flt --version``
    still work; running it, ``--help`` included, is the one-line missing-extra error."""
    from flt.commands.failures import explain

    failure = explain(err, None)
    if failure is None or name in sub.choices:
        raise err
    # `--help` is not this parser's own: it reaches the command, which names the extra.
    p = sub.add_parser(name, add_help=False, help=f"(unavailable) {failure.message}".replace("%", "%%"))
    p.set_defaults(func=_missing_extra(err), unavailable=True)


def _missing_extra(err: ImportError) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise err

    return run


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ImportError as err:
        # The commands need the lab's dependencies (numpy comes with the train extra), which
        # the library alone does not install: name the install instead of a traceback.
        from flt.commands.failures import explain

        failure = explain(err, None)
        if failure is None:
            raise
        print(f"flt: error: {failure.message}", file=sys.stderr, flush=True)
        return failure.code
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    # A command that needs a missing extra takes any arguments and says what to install.
    if unknown and not getattr(args, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # The arguments as given, for commands that print how to run them again (flt train
    # after Ctrl-C prints its command with --resume).
    args.argv = argv
    # An empty --out-dir would read as "not given" and write into the default folder of
    # the current directory (or into the current directory itself).
    if isinstance(getattr(args, "out_dir", None), str) and not args.out_dir.strip():
        from flt.commands.failures import BAD_INPUT, command_name

        print(f"flt {command_name(args)}: error: --out-dir is empty; give the directory to write into", file=sys.stderr, flush=True)
        return BAD_INPUT
    if args.debug:
        return int(args.func(args) or 0)
    from flt.commands.failures import command_name, explain

    try:
        return int(args.func(args) or 0)
    except (Exception, KeyboardInterrupt) as err:
        failure = explain(err, args)
        if failure is None:
            print(f"flt {command_name(args)}: this is a bug in flt (an unexpected {type(err).__name__}); "
                  "please report it with the traceback below", file=sys.stderr, flush=True)
            raise
        print(failure.line(command_name(args)), file=sys.stderr, flush=True)
        return failure.code


if __name__ == "__main__":
    sys.exit(main())
