"""Step time and peak RSS per rank of infinity's ZeRO stages 0-3 next to torch DDP and FSDP2.

Every configuration runs in a fresh pair of gloo processes (peak RSS is a
process high-water mark, so sharing processes would blur it): build the GPT,
wrap it, run ``--warmup`` untimed and ``--steps`` timed steps (forward,
backward, optimizer step, zero_grad) on ``--batch`` x ``--seq`` tokens per
rank, and report the median step time and each rank's peak RSS. Baselines,
measured in the same run: ``torch.nn.parallel.DistributedDataParallel`` and
FSDP2 ``fully_shard`` (per block, then the root), both with
``torch.optim.AdamW``. Targets: stage 3 <= 1.0 x FSDP2, stage 0 <= 1.05 x DDP.

Peak RSS and glibc: by default glibc raises its mmap threshold to the size of
the last freed large block (up to 32 MiB), after which per-unit buffers come
from the heap, fragment it, and are never returned, so peak RSS measures the
allocator rather than the live state. Every configuration (baselines too)
therefore runs with ``MALLOC_MMAP_THRESHOLD_`` fixed at
``--malloc-mmap-threshold-bytes`` (1 MiB; 0 leaves glibc's default).

    python tools/bench_zero.py --json            # GPT ~125M, 2 ranks
    python tools/bench_zero.py --model tiny --steps 3 --seq 64
    python tools/bench_zero.py --json --rounds 3    # round-robin, medians over rounds (noisy machines)
    python tools/bench_zero.py --world 4 --configs zero3,zero3_tp2,zero1_tp2,zero3_tp4   # ZeRO x TP

``zeroS_tpN``: stage S with ``parallel.tensor: N`` (data parallel = world / N):
the ranks of one dp row train on the same batch, so tokens per step are
``world / N`` x batch x seq, against ``world`` x batch x seq for the plain
configurations (compare step time per token, printed as ``tok/s``).

The output records the machine (``infinity.precision.hardware_record``) and each infinity
configuration's resolved dtypes; the baselines run fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from hardware_note import line as hardware_line
from infinity.precision import hardware_record

PLAIN_CONFIGS = ("ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3")
TP_CONFIGS = ("zero1_tp2", "zero3_tp2", "zero3_tp4")   # opt-in: they need --world divisible by the tp ways
CONFIGS = PLAIN_CONFIGS + TP_CONFIGS
OPT = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _build(model_name: str):
    from infinity.models import GPT, gpt_config
    torch.manual_seed(0)
    return GPT(gpt_config(model_name))


def _wrap(name: str, model, param_dtype: str):
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), **OPT)
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), **OPT)
    import infinity
    stage = int(name.split("_")[0][-1])
    cfg = {"zero": {"stage": stage}, "precision": {"param_dtype": param_dtype},
           "optimizer": {k: list(v) if isinstance(v, tuple) else v for k, v in OPT.items()},
           "parallel": {"tensor": _tp_of(name)}}
    model, opt = infinity.initialize(model, cfg)
    return model, opt


def _tp_of(name: str) -> int:
    """``zero3_tp2`` -> 2; 1 without a ``_tpN`` suffix."""
    return int(name.split("_tp")[1]) if "_tp" in name else 1


def _rank(rank: int, world: int, init_file: str, args, name: str, out_q) -> None:
    import torch.distributed as dist
    try:
        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        model, opt = _wrap(name, _build(args.model), args.param_dtype)
        g = torch.Generator().manual_seed(rank // _tp_of(name))   # a dp row's tp ranks share their batch
        vocab = 256
        times = []
        for step in range(args.warmup + args.steps):
            ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times.append(dt)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        extra = {}
        if name.startswith("zero"):
            import infinity
            engine = infinity.engine_of(model)
            extra = {"last_step": engine.stats.last_step,
                     "precision": {"param_dtype": engine.config.precision.param_dtype,
                                   "compute_dtype": engine.config.precision.compute_dtype}}
        out_q.put((rank, {"step_s": times, "peak_rss_bytes": rss, **extra}))
        dist.destroy_process_group()
    except BaseException:
        out_q.put((rank, {"error": traceback.format_exc()}))


def run_config(name: str, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.world, os.path.join(tmp, "init"), args, name, q))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + args.timeout_s
        while len(results) < args.world and time.monotonic() < deadline:
            try:
                r, res = q.get(timeout=1.0)
                results[r] = res
            except Exception:
                if not any(p.is_alive() for p in procs) and q.empty():
                    break
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [res["error"] for res in results.values() if "error" in res]
    if errors or len(results) < args.world:
        reason = errors[0].strip().splitlines()[-1] if errors else "a rank gave no result (timeout or crash)"
        return {"error": reason, "traceback": errors[0] if errors else None}
    per_rank_median = [statistics.median(results[r]["step_s"]) for r in range(args.world)]
    dp = args.world // _tp_of(name)
    out = {"step_s": max(per_rank_median),  # a step is as slow as its slowest rank
           "tokens_per_s": dp * args.batch * args.seq / max(per_rank_median),
           "step_s_per_rank": [results[r]["step_s"] for r in range(args.world)],
           "peak_rss_bytes": [results[r]["peak_rss_bytes"] for r in range(args.world)]}
    if "last_step" in results[0]:
        ls = results[0]["last_step"]
        out["rank0_last_step"] = {k: ls[k] for k in ("forward_s", "backward_s", "step_s", "comm_wait_s")}
        out["rank0_collective_bytes"] = {k: v for k, v in ls["collectives"]["bytes"].items() if v}
        out["precision"] = results[0]["precision"]
    return out


def _merge(runs: list) -> dict:
    """One configuration over several rounds: median step over every timed step, max peak RSS."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    world = len(runs[0]["peak_rss_bytes"])
    per_rank = [[t for r in runs for t in r["step_s_per_rank"][rank]] for rank in range(world)]
    out = dict(runs[-1])
    out.pop("step_s_per_rank")
    out["step_s"] = max(statistics.median(ts) for ts in per_rank)
    out["round_step_s"] = [r["step_s"] for r in runs]
    out["peak_rss_bytes"] = [max(r["peak_rss_bytes"][rank] for r in runs) for rank in range(world)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="125m", help="infinity.models GPT size (tiny, 125m, ...)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per rank")
    ap.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16"), help="infinity compute dtype")
    ap.add_argument("--configs", default=",".join(PLAIN_CONFIGS), help=f"comma list from {','.join(CONFIGS)}")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--malloc-mmap-threshold-bytes", type=int, default=2**20,
                    help="MALLOC_MMAP_THRESHOLD_ for every rank (0 = glibc's dynamic default); see module doc")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations round-robin this many times (fresh processes each) and take "
                         "medians over all rounds, so load from other jobs hits every configuration alike")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        ap.error(f"unknown config {bad[0]!r}; valid: {', '.join(CONFIGS)}")
    odd = [c for c in names if args.world % _tp_of(c)]
    if odd:
        ap.error(f"config {odd[0]!r} needs --world divisible by {_tp_of(odd[0])}, got {args.world}")
    torch.set_num_threads(args.threads)   # the record says the ranks' threads
    hardware = hardware_record("cpu")
    if not args.json:
        print(hardware_line(hardware), flush=True)
    if args.malloc_mmap_threshold_bytes:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold_bytes)  # inherited by the ranks
    rounds: dict = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            rounds[name].append(run_config(name, args))
    results = {name: _merge(runs) for name, runs in rounds.items()}
    for name in names:
        if not args.json:
            r = results[name]
            if "error" in r:
                print(f"{name:9s} FAILED: {r['error']}", flush=True)
            else:
                rss = " ".join(f"{b / 2**30:.2f}" for b in r["peak_rss_bytes"])
                print(f"{name:9s} step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:8.0f} tok/s   "
                      f"peak RSS/rank GiB: {rss}", flush=True)
    ratios = {}
    for name, base in (("zero0", "ddp"), ("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "fsdp2"),
                       ("zero3", "ddp"), ("zero1_tp2", "zero3"), ("zero3_tp2", "zero3"), ("zero3_tp4", "zero3")):
        a, b = results.get(name, {}), results.get(base, {})
        if "step_s" in a and "step_s" in b:
            ratios[f"{name}/{base}_step"] = a["step_s"] / b["step_s"]
            ratios[f"{name}/{base}_tokens_per_s"] = a["tokens_per_s"] / b["tokens_per_s"]
            ratios[f"{name}/{base}_rss"] = max(a["peak_rss_bytes"]) / max(b["peak_rss_bytes"])
    report = {"model": args.model, "world": args.world, "batch": args.batch, "seq": args.seq,
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "threads_per_rank": args.threads,
              "param_dtype": args.param_dtype, "hardware": hardware,
              "malloc_mmap_threshold_bytes": args.malloc_mmap_threshold_bytes, "results": results, "ratios": ratios}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for k, v in ratios.items():
            print(f"{k:22s} {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
