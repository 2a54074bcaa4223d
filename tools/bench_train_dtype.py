"""bf16 vs fp32 compute for ``infinity train``'s default model on this machine.

Builds the default model twice through ``infinity.initialize`` (ZeRO-3, one
process), once per ``precision.param_dtype``, and alternates their steps on the
same batches, so load from other processes hits both alike. Prints the median
step time of each, fp32 being the baseline, and the ratio.

    .venv/bin/python tools/bench_train_dtype.py [--steps 8] [--model NAME] [--batch-size 8] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import infinity
from infinity.data import TokenDataset
from infinity.train import DEFAULT_BATCH_SIZE, DEFAULT_MODEL, DEFAULT_SEQ_LEN, build_model, parse_model_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    ap.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    args = ap.parse_args()

    spec = parse_model_spec(args.model)
    data = TokenDataset.default(args.seq_len)
    runs = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        model, loss_fn = build_model(spec, args.seq_len)
        model, opt = infinity.initialize(model, {"zero": {"stage": 3}, "precision": {"param_dtype": dtype}})
        runs[dtype] = (model, opt, loss_fn, [])
    for step in range(args.steps + 1):
        x, y = data.batch(step, args.batch_size)
        for dtype, (model, opt, loss_fn, times) in runs.items():
            t0 = time.perf_counter()
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            if step > 0:   # step 0 records the gather order and warms the allocator
                times.append(time.perf_counter() - t0)
    fp32 = statistics.median(runs["fp32"][3])
    bf16 = statistics.median(runs["bf16"][3])
    tokens = args.batch_size * args.seq_len
    print(f"{args.model}, {args.batch_size} x {args.seq_len} tokens, {torch.get_num_threads()} threads, "
          f"median of {args.steps} alternating steps")
    print(f"fp32 (baseline)  {fp32 * 1e3:8.1f} ms/step  {tokens / fp32:8.0f} tokens/s")
    print(f"bf16             {bf16 * 1e3:8.1f} ms/step  {tokens / bf16:8.0f} tokens/s")
    print(f"bf16 / fp32 speed ratio: {fp32 / bf16:.2f}x")


if __name__ == "__main__":
    main()
