"""Checkpoint save / load / consolidate throughput next to raw sequential writes and reads of the same bytes.

One process (world size 1, stage 1): a GPT is initialized, then saved,
loaded and consolidated ``--repeat`` times into ``--dir``. Each figure is the
median GB/s of checkpoint bytes (fp32 master + two Adam moments, 12 bytes a
parameter) next to the baseline measured in the same run: one file of the
same size written with ``write`` + ``fsync`` (save), read back with
``readinto`` (load; the page cache is warm for both, as it is right after a
save), and for consolidate the fp32 parameter bytes (4 a parameter) written
the same way. The ratio is checkpoint / baseline (1.0 = disk-bound). The machine
(``infinity.precision.hardware_record``) and the engine's dtypes are recorded beside the figures.

    python tools/bench_checkpoint.py --model 125m --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hardware_note import line as hardware_line
from infinity.precision import hardware_record


def _raw_write(path: Path, nbytes: int, chunk_bytes: int = 64 * 2**20) -> float:
    buf = bytearray(os.urandom(min(chunk_bytes, nbytes)))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, len(buf))
            f.write(memoryview(buf)[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _raw_read(path: Path, chunk_bytes: int = 64 * 2**20) -> float:
    buf = bytearray(chunk_bytes)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="built-in GPT size (tiny, 125m, ...)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    import infinity
    from infinity.checkpoint import consolidate, load_checkpoint, save_checkpoint
    from infinity.models import GPT, gpt_config

    scratch = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        model, opt = infinity.initialize(GPT(gpt_config(args.model)), {"zero": {"stage": 1}})
        engine = infinity.engine_of(model)
        n_params = sum(u.numel for u in engine.units)
        precision = {"param_dtype": engine.config.precision.param_dtype,
                     "compute_dtype": engine.config.precision.compute_dtype}
        state_bytes, param_bytes = 12 * n_params, 4 * n_params
        times: dict = {k: [] for k in ("save", "load", "consolidate", "raw_write", "raw_read", "raw_write_params")}
        for i in range(args.repeat):
            t0 = time.perf_counter()
            step_dir = save_checkpoint(scratch / "ckpt", model, opt, step=i, keep_last=1)
            times["save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load_checkpoint(step_dir, model, opt)
            times["load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            consolidate(step_dir, scratch / f"out{i}")
            times["consolidate"].append(time.perf_counter() - t0)
            shutil.rmtree(scratch / f"out{i}")
            raw = scratch / "raw.bin"
            times["raw_write"].append(_raw_write(raw, state_bytes))
            times["raw_read"].append(_raw_read(raw))
            times["raw_write_params"].append(_raw_write(raw, param_bytes))
            raw.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def gbps(key, nbytes):
        return nbytes / statistics.median(times[key]) / 1e9

    rows = {
        "save": (gbps("save", state_bytes), gbps("raw_write", state_bytes)),
        "load": (gbps("load", state_bytes), gbps("raw_read", state_bytes)),
        "consolidate": (gbps("consolidate", param_bytes), gbps("raw_write_params", param_bytes)),
    }
    out = {"model": args.model, "params": n_params, "state_bytes": state_bytes,
           "hardware": hardware_record("cpu"), "precision": precision,
           "rows": {k: {"gbps": a, "baseline_gbps": b, "ratio": a / b} for k, (a, b) in rows.items()}}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(hardware_line(out["hardware"]))
    print(f"GPT {args.model}: {n_params:,} params, {state_bytes / 1e9:.3f} GB of optimizer state")
    for k, (a, b) in rows.items():
        print(f"  {k:12s} {a:6.2f} GB/s   baseline {b:6.2f} GB/s   ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
