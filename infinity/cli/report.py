"""``infinity report``: what this machine and install can do (:mod:`infinity.report`), as text or JSON."""

from __future__ import annotations

import json
from pathlib import Path

from infinity.cli.usage import UsageError

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    """Register ``infinity report`` and its arguments on ``sub``, the program's sub-command parsers."""
    p = sub.add_parser(
        "report", help="what this machine and install can do (as DeepSpeed's ds_report)",
        description="torch, Python, CUDA and device capabilities, the compute dtype precision auto would pick "
                    "and why, whether the native libraries build here, and with --dir a swap directory's file "
                    "system, O_DIRECT, free space and a short read/write figure.")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="also probe this swap directory (writes and reads one file there, then removes it)")
    p.add_argument("--bytes", default="256MiB", metavar="SIZE",
                   help="bytes the --dir probe writes and reads (default 256MiB; 0 = no read/write figure)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_report)


def _run_report(args) -> int:
    from infinity.config import parse_size
    from infinity.report import build_report, report_lines

    size = parse_size(args.bytes, "--bytes")
    if args.dir is not None and not Path(args.dir).is_dir():
        raise UsageError(f"--dir {args.dir}: not a directory")
    report = build_report(args.dir, size)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(report_lines(report)))
    return 0

