"""ZeRO++ convergence: the built-in GPT trained with ``infinity train`` at world size 4, each switch vs plain ZeRO-3.

Runs ``infinity train --nproc 4`` once per configuration (plain stage 3, qwZ,
hpZ, qgZ, all three) with the same seed, data, batches and schedule, the 4
ranks laid out as 2 "nodes" x 2 (``zeropp.ranks_per_node: 2``), and reports
each run's final training loss (the mean of the last ``--tail`` steps, since
one step's loss is one batch's), its final validation loss, and both relative
to the plain run (the target: within 1%). The per-step losses go to
``--out DIR`` (one metrics JSONL per run) and, with ``--json``, into the output, with the machine
(``infinity.precision.hardware_record``) and the dtypes each run resolved.

    python tools/zeropp_convergence.py --json                 # 200 steps
    python tools/zeropp_convergence.py --steps 20 --model tiny  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

from hardware_note import line as hardware_line
from infinity.precision import hardware_record

CONFIGS = {
    "zero3": {},
    "qwZ": {"quantize_weights": True},
    "hpZ": {"hierarchical_partition": True},
    "qgZ": {"quantize_grads": True},
    "all": {"quantize_weights": True, "hierarchical_partition": True, "quantize_grads": True},
}


def _run(name: str, pp: dict, args, out_dir: str) -> dict:
    cfg = {"zero": {"stage": 3}, "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
           "optimizer": {"lr": args.lr}, "zeropp": dict({"ranks_per_node": 2}, **pp)}
    cfg_path = os.path.join(out_dir, f"{name}.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    metrics = os.path.join(out_dir, f"{name}.jsonl")
    cmd = [sys.executable, "-m", "infinity.cli", "train", "--config", cfg_path, "--nproc", "4",
           "--steps", str(args.steps), "--model", args.model, "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--eval-every", str(args.steps), "--eval-batches", "4",
           "--metrics", metrics, "--no-save", "--no-progress", "--json", "--seed", "0",
           "--lr-schedule", "cosine", "--warmup-steps", str(min(10, args.steps // 4)),
           "--min-lr", str(args.lr / 10)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: infinity train exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    with open(metrics) as f:
        losses = [json.loads(line)["loss"] for line in f if line.strip()]
    return {"losses": losses, "val_loss": summary.get("val_loss"), "wall_s": time.perf_counter() - t0,
            "final_loss": sum(losses[-args.tail:]) / len(losses[-args.tail:]),
            "precision": {k: summary.get(k) for k in ("param_dtype", "compute_dtype")}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", default="tiny:n_layer=4,n_head=4,n_embd=128,block_size=128")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="global sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tail", type=int, default=10, help="final loss = mean of the last N steps' losses")
    p.add_argument("--only", nargs="*", choices=list(CONFIGS), help="run only these (zero3 is always run)")
    p.add_argument("--out", default=None, help="directory for configs and metrics (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    names = ["zero3"] + [n for n in CONFIGS if n != "zero3" and (not args.only or n in args.only)]
    out_dir = args.out or tempfile.mkdtemp(prefix="zeropp-conv-")
    os.makedirs(out_dir, exist_ok=True)
    runs = {n: _run(n, CONFIGS[n], args, out_dir) for n in names}
    base = runs["zero3"]
    for r in runs.values():
        r["final_vs_zero3"] = r["final_loss"] / base["final_loss"] - 1
        r["val_vs_zero3"] = (r["val_loss"] / base["val_loss"] - 1) if r["val_loss"] and base["val_loss"] else None
        r["within_1pct"] = abs(r["final_vs_zero3"]) <= 0.01
    hardware = hardware_record("cpu")
    if args.json:
        print(json.dumps({"steps": args.steps, "model": args.model, "seq_len": args.seq_len,
                          "batch_size": args.batch_size, "metrics_dir": out_dir, "hardware": hardware, "runs": runs},
                         indent=1))
        return 0
    print(hardware_line(hardware))
    print(f"{args.model}, {args.steps} steps, 4 ranks as 2 nodes x 2; final = mean of last {args.tail} losses")
    for n, r in runs.items():
        curve = " ".join(f"{r['losses'][i]:.2f}" for i in range(0, len(r["losses"]), max(1, len(r["losses"]) // 8)))
        print(f"{n:<6} final {r['final_loss']:.4f} ({r['final_vs_zero3']:+.2%})  val {r['val_loss']:.4f}  "
              f"{r['wall_s']:.0f}s  curve {curve}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
