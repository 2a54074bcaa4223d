"""Run a command as a two-node torchrun job on this machine: two network namespaces, a veth link between them.

Each "node" is a network namespace with its own address on a private /30
(10.77.0.1 and 10.77.0.2, which exist only inside the namespaces) and its own
directory (swap files, checkpoints, logs); ``torchrun --nnodes 2`` is started
once in each, and the run is bounded by ``--timeout-s``. The link can be
limited (``--rate``, tc tbf) and delayed (``--delay-ms``, tc netem, where the
kernel has it). Prints each node's exit code and the tail of its log, and the
bytes that crossed the link (the veth's kernel counters). Namespaces, link,
processes and (unless ``--keep DIR``) files are removed at the end, also on
failure, timeout or Ctrl-C. Needs root and iproute2.

In the command, ``{node}``, ``{node_dir}`` and ``{addr}`` are replaced per node:

    sudo python tools/two_nodes.py --rate 1gbit -- -m infinity.cli train --model tiny --steps 5 \\
        --swap-dir {node_dir}/swap --save-dir {node_dir}/ckpt --save-node-local

The harness itself is ``tests/helpers/two_nodes.py`` (the tests use the same one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))

from two_nodes import HarnessError, TwoNodes, unavailable_reason  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--rate", default=None, help="tc rate of each direction, e.g. 1gbit (default: unlimited)")
    p.add_argument("--delay-ms", type=float, default=None, help="one-way delay added on each end (tc netem)")
    p.add_argument("--rendezvous", choices=("static", "c10d"), default="static",
                   help="static: --node-rank/--master-addr; c10d: node 0 hosts the store (--rdzv-conf is_host)")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="both nodes are killed after this (default 600)")
    p.add_argument("--keep", metavar="DIR", default=None, help="put the node directories under DIR and keep them")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: a script and its arguments, or -m module ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --, e.g. -- -m infinity.cli train --steps 5")
    reason = unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    # SIGTERM (a scheduler, `kill`) must unwind through the harness's cleanup like Ctrl-C does
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with TwoNodes(args.keep, rate=args.rate, delay_ms=args.delay_ms, keep_files=args.keep is not None) as nodes:
            result = nodes.run(command, timeout_s=args.timeout_s, nproc_per_node=args.nproc_per_node,
                               rendezvous=args.rendezvous, max_restarts=args.max_restarts)
    except HarnessError as e:
        print(f"two_nodes: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"returncodes": result.returncodes, "timed_out": result.timed_out,
                          "elapsed_s": result.elapsed_s, "link_bytes": result.link_bytes,
                          "rate": args.rate, "delay_ms": args.delay_ms, "logs_tail": [l[-4000:] for l in result.logs]}))
    else:
        print(result.describe())
        lb = result.link_bytes
        print(f"link: {lb['total']:,} bytes crossed ({lb['a_to_b']:,} node 0 -> 1, {lb['b_to_a']:,} node 1 -> 0) "
              f"in {result.elapsed_s:.1f} s")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
