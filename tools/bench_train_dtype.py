"""``precision.param_dtype: auto`` against forced bf16 and forced fp32 for ``infinity train``'s default job.

Builds the default job three times in one process (``infinity.train.default_config``: ZeRO-3, parameters
and optimizer on NVMe, clipping 1.0; the default model, batch and data), once per ``param_dtype`` (auto,
bf16, fp32; each with its own swap directory), and alternates their steps on the same batches, so load
from other processes hits all three alike. A step is what ``infinity train`` times: forward, backward,
clipping, optimizer step. Prints the median step time of each after the first (which records the gather
order), and auto's over the faster of the forced two: near 1.0 when auto chose well here, well above it
when it did not. The machine (``infinity.precision.hardware_record``) is printed and recorded with the
figures: from a CPU without native bf16 the forced-bf16 figure is some 50-90x the fp32 one.

    .venv/bin/python tools/bench_train_dtype.py [--steps 8] [--model NAME] [--batch-size 8] [--seq-len 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import infinity
from hardware_note import line as hardware_line
from infinity.data import TokenDataset
from infinity.precision import hardware_record
from infinity.train import DEFAULT_BATCH_SIZE, DEFAULT_MODEL, DEFAULT_SEQ_LEN, build_model, default_config, \
    parse_model_spec

VARIANTS = ("auto", "bf16", "fp32")   # precision.param_dtype; compute_dtype stays auto (= what it resolves to)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per variant, after one warm-up step")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    ap.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    ap.add_argument("--swap-dir", default=None, help="where the three swap directories go (default: a temp dir "
                    "under the current directory, on its disk)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()

    spec = parse_model_spec(args.model)
    data = TokenDataset.default(args.seq_len)
    root = tempfile.mkdtemp(prefix="bench-train-dtype-", dir=args.swap_dir or os.getcwd())
    runs = {}
    try:
        for name in VARIANTS:
            config = default_config(os.path.join(root, name)).replace(precision={"param_dtype": name})
            torch.manual_seed(0)
            model, loss_fn = build_model(spec, args.seq_len)
            model, opt = infinity.initialize(model, config)
            runs[name] = {"model": model, "opt": opt, "loss_fn": loss_fn, "times": [], "losses": [],
                          "clip": config.schedule.clip_grad_norm}
        for step in range(args.steps + 1):
            x, y = data.batch(step, args.batch_size)
            for run in runs.values():
                t0 = time.perf_counter()
                loss = run["loss_fn"](run["model"], x, y)
                loss.backward()
                if run["clip"] is not None:
                    run["opt"].clip_grad_norm_(run["clip"])
                run["opt"].step()
                run["opt"].zero_grad()
                if step > 0:   # step 0 records the gather order and warms the allocator
                    run["times"].append(time.perf_counter() - t0)
                run["losses"].append(round(loss.item(), 4))
        engines = {name: infinity.engine_of(run["model"]) for name, run in runs.items()}
        device = next(iter(engines.values())).device
        resolved = {name: {"param_dtype": e.config.precision.param_dtype,
                           "compute_dtype": e.config.precision.compute_dtype} for name, e in engines.items()}
        for e in engines.values():
            e.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    hardware = hardware_record(device)
    median = {name: statistics.median(run["times"]) for name, run in runs.items()}
    faster = min(("bf16", "fp32"), key=median.get)
    tokens = args.batch_size * args.seq_len
    out = {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
           "hardware": hardware, "precision": resolved, "median_step_s": median,
           "tokens_per_s": {name: tokens / t for name, t in median.items()},
           "faster_forced": faster, "auto_over_faster_forced": median["auto"] / median[faster],
           "step_s": {name: run["times"] for name, run in runs.items()},
           "losses": {name: run["losses"] for name, run in runs.items()},
           "load_avg": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(hardware_line(hardware))
    print(f"{args.model}, {args.batch_size} x {args.seq_len} tokens, infinity train's default config, "
          f"median of {args.steps} alternating steps (load average {out['load_avg']:.1f})")
    for name in VARIANTS:
        r = resolved[name]
        dtypes = r["compute_dtype"] if r["param_dtype"] == r["compute_dtype"] else \
            f"{r['compute_dtype']} compute, {r['param_dtype']} stored"
        print(f"{name:5s} {dtypes:22s} {median[name] * 1e3:8.1f} ms/step  {out['tokens_per_s'][name]:8.0f} tokens/s")
    print(f"auto / forced {faster} (the faster forced one): {out['auto_over_faster_forced']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
