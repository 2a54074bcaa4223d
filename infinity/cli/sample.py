"""``infinity sample``: continue a prompt with a model saved by ``infinity train``, a progress bar on stderr for
long samples."""

from __future__ import annotations

import json
import math
import sys

from infinity.cli.usage import UsageError

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    """Register ``infinity sample`` and its arguments on ``sub``, the program's sub-command parsers."""
    p = sub.add_parser(
        "sample", help="continue a prompt with a model saved by infinity train",
        description="Load a checkpoint saved by `infinity train` (a step directory, or a save directory: its "
                    "latest), consolidate its weights into a temporary directory, and continue --prompt on the "
                    "CPU (see infinity/train/sample.py). The model must fit in memory.")
    p.add_argument("checkpoint", metavar="CKPT", help="a step directory, or a save directory (its latest step)")
    p.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    p.add_argument("--tokens", type=int, default=64, metavar="N", help="tokens to add (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="draw among the K likeliest (default 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_sample)


_SAMPLE_BAR_TOKENS = 256   # samples this long (seconds on a CPU) get a progress bar


def _run_sample(args) -> int:
    from infinity.checkpoint import CheckpointError
    from infinity.train import TrainError
    from infinity.train.sample import sample_checkpoint

    if args.tokens < 1 or args.top_k < 1 or not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--tokens and --top-k must be >= 1 and --temperature a finite number >= 0, got "
                         f"--tokens {args.tokens}, --top-k {args.top_k}, --temperature {args.temperature}")
    bars = []

    def progress(total: int):   # a bar on stderr for long samples; stdout keeps only the text (or JSON)
        if args.json or total < _SAMPLE_BAR_TOKENS:
            return None
        from tqdm import tqdm
        bars.append(tqdm(total=total, desc="sample", unit="tok", file=sys.stderr, dynamic_ncols=True))
        return lambda: bars[0].update(1)

    try:
        out = sample_checkpoint(args.checkpoint, args.prompt, args.tokens, args.temperature, args.top_k, args.seed,
                                say=lambda line: print(f"infinity sample: {line}", file=sys.stderr), progress=progress)
    except (TrainError, CheckpointError, ValueError) as e:
        raise UsageError(str(e)) from None
    finally:
        for bar in bars:
            bar.close()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(out["text"])
    return 0

