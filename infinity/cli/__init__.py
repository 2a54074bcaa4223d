"""The ``infinity`` program: argument handling and output, no logic of its own.

Each sub-command is a module of this package (``estimate``, ``profile``, ``plan``, ``consolidate``,
``train``, ``sample``, ``report``) with one ``add_parser(subparsers)`` that registers its arguments and a
``_run_<name>(args) -> int`` that calls into the library and prints. ``main`` returns the exit code; bad
arguments or inputs print one line on stderr and return 2 (:class:`~infinity.cli.usage.UsageError`); a run
that fails for a reason outside the program (a full disk, a corrupt checkpoint or swap file, a rank that hung
or died) prints one line and returns 1. ``--debug`` (before or after the sub-command) shows the traceback
instead; an error of any other kind is a bug and always keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from infinity.cli import consolidate, estimate, plan, profile, report, sample, train
from infinity.cli.usage import Parser, UsageError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="infinity", description="Train models whose training state is larger than device memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for command in (train, estimate, profile, plan, consolidate, sample, report):   # the order --help lists
        command.add_parser(sub)
    # --debug after the sub-command too; SUPPRESS keeps the main parser's value when it is not repeated
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks instead of one-line errors")
    return parser


def _run_errors() -> tuple:
    """Failures of a run whose cause is outside the program: reported in one line (exit 1) unless --debug.
    Imported only once something failed, so that ``infinity --help`` stays light."""
    from infinity.checkpoint import CheckpointError
    from infinity.comm.watchdog import CollectiveTimeout
    from infinity.store import StoreError
    return (CheckpointError, StoreError, CollectiveTimeout, OSError)   # OSError covers SwapIOError


def main(argv: Sequence[str] | None = None) -> int:
    from infinity.config import ConfigError

    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:          # --help exits through argparse
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except (UsageError, ConfigError) as e:
        if args.debug:
            raise
        print(f"infinity {args.command}: {e}", file=sys.stderr)
        return 2
    except _run_errors() as e:
        # the input was fine, the world was not (disk, files, other ranks); anything else is a bug and
        # keeps its traceback
        if args.debug:
            raise
        print(f"infinity {args.command}: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    """The error's own first line; an OSError without a message of its own says its errno's."""
    text = (str(e).strip().splitlines() or [""])[0]
    return text or type(e).__name__

