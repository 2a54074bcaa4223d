"""Adam moments' stored format and convergence: the built-in GPT on real text with fp32, bf16 and int8 moments.

Runs ``infinity train`` (world size 1, stage 1, the optimizer's update through CPU Adam) once per
moment format in ``infinity.config.MOMENT_FORMATS`` with the same seed, data, batches and schedule,
plus the fp32 run again with another seed: the run-to-run spread that a format's difference is to
be read against. The corpus is the default one (the Python standard library's source: real text, byte
tokens), ``--corpus-bytes`` of it. Reports each run's final validation loss (one fixed held-out set)
and its ratio to the fp32 run's (targets: within 0.5% for bf16, 1% for int8), and writes the loss
curves to ``--out``/moments_convergence.png and .json.

The default model is the built-in GPT at 7 x 512 (22.2M parameters, the 20-30M the moment-format
study asks for) in bf16 compute (the master and the update math stay fp32), 8 x 64 byte tokens a step,
2000 steps: on this 2-core machine about 0.75 s a step on one core, so ``--jobs 2`` runs the four runs
in about an hour.

    python tools/moments_convergence.py --out /tmp/conv             # the defaults below
    python tools/moments_convergence.py --steps 20 --out /tmp/conv  # a quick look
    python tools/moments_convergence.py --jobs 2 --out /tmp/conv    # two runs at once, one core each

``--jobs N`` runs N of the runs at once, each pinned to its own share of the cores (``infinity train``
sizes its threads from its CPU affinity): the runs are independent, so their losses are the same as
run one by one, and only the wall time changes. The JSON records the machine
(``infinity.precision.hardware_record``) and the dtypes each run resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import yaml

from hardware_note import line as hardware_line
from infinity.config import MOMENT_FORMATS
from infinity.precision import hardware_record

TARGETS = {"bf16": 0.005, "int8": 0.01}   # final validation loss vs fp32's, relative


def _run(name: str, moments: str, seed: int, args, cores=None) -> dict:
    cfg = {"zero": {"stage": 1}, "precision": {"param_dtype": args.param_dtype, "reduce_dtype": "fp32"},
           "optimizer": {"lr": args.lr, "moments": moments}}
    cfg_path = os.path.join(args.out, f"{name}.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    metrics = os.path.join(args.out, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "infinity.cli", "train", "--config", cfg_path, "--steps", str(args.steps),
           "--model", args.model, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--corpus-bytes", args.corpus_bytes, "--eval-every", str(args.eval_every),
           "--eval-batches", str(args.eval_batches), "--metrics", metrics, "--no-save", "--no-progress",
           "--json", "--seed", str(seed), "--lr-schedule", "cosine", "--warmup-steps", str(max(1, args.steps // 20)),
           "--min-lr", str(args.lr / 10)]
    t0 = time.perf_counter()
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pin)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: infinity train exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    return {"moments": moments, "seed": seed, "losses": losses, "val_curve": val,
            "val_loss": summary.get("val_loss"), "wall_s": time.perf_counter() - t0,
            "precision": {k: summary.get(k) for k in ("param_dtype", "compute_dtype")}}


def _plot(runs: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, av) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        k = max(1, len(r["losses"]) // 100)   # a running mean: one step's loss is one small batch's
        smooth = [sum(r["losses"][i:i + k]) / len(r["losses"][i:i + k]) for i in range(0, len(r["losses"]), k)]
        ax.plot([i * k for i in range(len(smooth))], smooth, label=name)
        if r["val_curve"]:
            av.plot(*zip(*r["val_curve"]), marker="o", label=f"{name}: {r['val_loss']:.4f}")
    ax.set(xlabel="step", ylabel="training loss (running mean)", title=title)
    av.set(xlabel="step", ylabel="validation loss", title="validation (one fixed held-out set)")
    ax.legend()
    av.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--model", default="tiny:n_layer=7,n_head=8,n_embd=512,block_size=64",
                   help="the built-in GPT's spec (default: 22.2M parameters)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--param-dtype", default="bf16", choices=("fp32", "bf16"),
                   help="compute dtype (the master and the update math are fp32 either way)")
    p.add_argument("--corpus-bytes", default="8MiB", help="bytes of the default corpus (>= 5 MB of real text)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=64)
    p.add_argument("--only", nargs="*", choices=[m for m in MOMENT_FORMATS if m != "fp32"],
                   help="run only these low-precision formats (the fp32 runs always run)")
    p.add_argument("--out", required=True, help="directory for configs, metrics, the PNG and the JSON")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each on its own share of the cores")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    plan = [("fp32", "fp32", 0), ("fp32-seed1", "fp32", 1)]
    plan += [(m, m, 0) for m in MOMENT_FORMATS if m != "fp32" and (not args.only or m in args.only)]
    cores = sorted(os.sched_getaffinity(0))
    jobs = max(1, min(args.jobs, len(cores), len(plan)))
    shares = [set(cores[i::jobs]) for i in range(jobs)] if jobs > 1 else [None]
    free = list(shares)

    def one(item):
        name, moments, seed = item
        share = free.pop()
        try:
            r = _run(name, moments, seed, args, share)
        finally:
            free.append(share)
        print(f"{name}: val {r['val_loss']:.4f} in {r['wall_s']:.0f}s", flush=True)
        return name, r

    with ThreadPoolExecutor(jobs) as pool:
        runs = dict(pool.map(one, plan))
    base = runs["fp32"]["val_loss"]
    spread = runs["fp32-seed1"]["val_loss"] / base - 1
    for name, r in runs.items():
        r["val_vs_fp32"] = r["val_loss"] / base - 1
        target = TARGETS.get(r["moments"]) if name != "fp32-seed1" else None
        r["target"] = target
        r["within_target"] = None if target is None else abs(r["val_vs_fp32"]) <= target
    result = {"steps": args.steps, "model": args.model, "param_dtype": args.param_dtype,
              "hardware": hardware_record("cpu"), "seq_len": args.seq_len, "batch_size": args.batch_size,
              "corpus_bytes": args.corpus_bytes, "lr": args.lr, "fp32_seed_spread": spread, "runs": runs}
    with open(os.path.join(args.out, "moments_convergence.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(runs, os.path.join(args.out, "moments_convergence.png"),
          f"{args.model}, {args.steps} steps x {args.batch_size} x {args.seq_len} tokens")
    print(hardware_line(result["hardware"]))
    print(f"{args.model}, {args.steps} steps, batch {args.batch_size} x {args.seq_len}; fp32 seed spread "
          f"{spread:+.2%}")
    for name, r in runs.items():
        verdict = "" if r["target"] is None else f" (target {r['target']:.1%}: {'ok' if r['within_target'] else 'MISSED'})"
        print(f"{name:<11} val {r['val_loss']:.4f} {r['val_vs_fp32']:+.2%}{verdict}  {r['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
