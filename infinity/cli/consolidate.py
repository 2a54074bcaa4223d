"""``infinity consolidate``: a sharded checkpoint to one state dict in safetensors files."""

from __future__ import annotations

import json

from infinity.cli.sizes import decimal_size
from infinity.cli.usage import UsageError

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    """Register ``infinity consolidate`` and its arguments on ``sub``, the program's sub-command parsers."""
    p = sub.add_parser(
        "consolidate", help="sharded checkpoint to one state dict in safetensors files",
        description="Write a checkpoint's model state (every state_dict name, buffers included) as safetensors, "
                    "split above --max-shard-bytes with a model.safetensors.index.json, plus config.json for a "
                    "transformers model, streaming in bounded memory (see infinity/checkpoint/consolidate.py).")
    p.add_argument("checkpoint", metavar="CKPT", nargs="+",
                   help="a step directory, or a checkpoint root (its latest step); for a node-local checkpoint, "
                        "every node's (the same step)")
    p.add_argument("out", metavar="OUT", help="output directory (made if missing)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="output dtype (default fp32)")
    p.add_argument("--max-shard-bytes", default="2GiB", metavar="SIZE",
                   help="start a new output file past this size (default 2GiB)")
    p.add_argument("--buffer-bytes", default="64MiB", metavar="SIZE",
                   help="tensor data held in memory at once (default 64MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_consolidate)


def _run_consolidate(args) -> int:
    from infinity.checkpoint import CheckpointError, consolidate
    from infinity.config import parse_size

    max_shard_bytes = parse_size(args.max_shard_bytes, "--max-shard-bytes")
    buffer_bytes = parse_size(args.buffer_bytes, "--buffer-bytes")
    for flag, value, least in (("--max-shard-bytes", max_shard_bytes, 1), ("--buffer-bytes", buffer_bytes, 16)):
        if value < least:
            raise UsageError(f"{flag} must be at least {least} bytes, got {value}")
    try:
        checkpoint = args.checkpoint[0] if len(args.checkpoint) == 1 else args.checkpoint
        summary = consolidate(checkpoint, args.out, args.dtype, max_shard_bytes, buffer_bytes)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"consolidated {summary['checkpoint']} (step {summary['step']}): {summary['tensors']} tensors, "
          f"{decimal_size(summary['bytes'])} as {summary['dtype']} -> {summary['out']}")
    for name in summary["files"]:
        print(f"  {name}")
    return 0

