"""ZeRO-Infinity figures, each beside a baseline measured in the same run.

    python tools/bench_offload.py --json [--dir DIR] [--optim-numel 32M] [--skip-zero3] [--only SECTION]
    python tools/bench_offload.py --only formats --reps 5           # the stored formats' CPU Adam cost
    python tools/bench_offload.py --only quantizers --reps 5        # int8 moments' code vs torchao / bitsandbytes

1. ``optimizer``: one optimizer step with fp32 master / m / v and the gradient on NVMe and the
   bf16 parameter written back too (``AdamPipeline``, host budget of ~3 shards), against
   - the I/O lower bound: the bytes that step moved to and from NVMe divided by the raw
     O_DIRECT bandwidth of the same directory (read and write, measured in this run with the
     engine's thread count; the bound counts reads and writes as not overlapping, as on one disk);
   - the same step done serially per shard (read all, update, write all, wait) through the same store.
   Targets: pipelined <= 1.10x the bound; serial / pipelined shows the overlap.
2. ``adam``: ``CpuAdamW`` with the bf16 copy-back fused in, against ``torch.optim.AdamW(fused=True)``
   followed by the bf16 copy, on the same shard sizes (same threads: torch's intra-op pool).
   Target: torch / ours >= 1.0.
2b. ``formats``: ``CpuAdamW`` per stored format (``optimizer.master`` fp32 | remainder x ``moments``
   fp32 | bf16 | int8), time per element against fp32 master + fp32 moments on the same shards.
   Target: each format's conversions add <= 25% to the fp32 update's time.
2c. ``quantizers``: the int8 moments' block code (:mod:`infinity.optim.moment_codes`: encode with
   stochastic rounding, decode) against torchao's dynamic-code 8-bit quantizer (the one its AdamW8bit
   runs, blocks of 256) and bitsandbytes' blockwise quantizer, where installed, on the same Adam-like
   tensor and one thread: ns per element each way, and the round trip's median relative error.
3. ``zero3``: GPT trained at stage 3 with params, gradients (``--grads``) and optimizer on NVMe
   against the same model fully in memory (stage 3, no offload), one process each (world size 1),
   median step time after a warm-up step, per-phase times, and each process's peak RSS beside the
   full training-state size. Target: offloaded / in-memory <= 1.25x where compute dominates.
   Default model: GPT n_layer=8, n_embd=512, vocab 8192 (~30M params, 451 MiB of training state),
   batch 8x256 tokens: what "compute dominates" means scales with tokens per step, not model size
   (compute grows with params x tokens, the state's I/O with params only); 2048 tokens keeps a run
   to about a minute on a 2-core box. ``--batch 4`` halves compute, and the step's I/O (~830 MB,
   at this disk's bound) then shows more. Offloaded budgets: host 96 MiB, device 64 MiB,
   max_live 64 MiB, so the offloaded run holds ~1/3 of the state's size in its tiers at most.

Every section's figures run on this machine's CPU: the output records it (``hardware``,
``infinity.precision.hardware_record``) and, for ``zero3``, the dtypes the engines ran in.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from hardware_note import line as hardware_line  # noqa: E402
from infinity.config import IOConfig, TiersConfig, parse_size  # noqa: E402
from infinity.io import aligned_empty  # noqa: E402
from infinity.io.syscalls import O_DIRECT  # noqa: E402
from infinity.optim import native  # noqa: E402
from infinity.optim.cpu_adam import CpuAdamW, default_adam_threads  # noqa: E402
from infinity.optim.pipeline import AdamPipeline  # noqa: E402
from infinity.optim.shard_job import ShardJob  # noqa: E402
from infinity.precision import hardware_record  # noqa: E402
from infinity.store import TensorStore, Tier  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


# ---------------------------------------------------------------- 2c. the int8 moments' code


def bench_quantizers(numel: int, reps: int) -> dict:
    """ns per element to quantize and dequantize an Adam first moment (blocks of 256, one thread), ours
    against torchao's and bitsandbytes' where they import, and the median relative error of a round trip
    over elements within 1/64 of their block's largest (where every code keeps its precision). Each runs
    over the tensor in pieces of CPU Adam's work chunk (256K elements, cache-sized), as CpuAdamW calls
    ours."""
    from infinity.optim.moment_codes import BLOCK, MOMENT_FORMATS, decode_, dither, encode_

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    numel = numel // BLOCK * BLOCK
    # Adam-like: gradients whose scale varies over six decades from one parameter to the next
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 0, numel)[torch.randperm(numel, generator=g)]
    top = x.view(-1, BLOCK).abs().amax(1, keepdim=True)
    judged = (x.view(-1, BLOCK).abs() >= top / 64).view(-1)

    piece = 256 * 1024
    spans = [(lo, min(numel, lo + piece)) for lo in range(0, numel, piece)]

    def timed(fn) -> float:   # fn(lo, hi) over each piece
        ts = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            for lo, hi in spans:
                fn(lo, hi)
            if rep:   # the first is a warm-up
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts) / numel * 1e9

    def error(back) -> float:
        return float(((back - x).abs() / x.abs())[judged].median())

    rows = {}
    packed = torch.zeros(MOMENT_FORMATS["int8"].shape(numel), dtype=torch.uint8)
    work, out = torch.empty(piece), torch.empty(numel)

    def ours(lo, hi, noise):
        encode_(work[:hi - lo].copy_(x[lo:hi]), packed[lo // BLOCK:hi // BLOCK], root=False,
                dither=dither(0, 1, 0, lo, hi - lo) if noise else None)

    for name, noise in (("infinity", True), ("infinity-nearest", False)):
        enc = timed(lambda lo, hi: ours(lo, hi, noise))
        dec = timed(lambda lo, hi: decode_(packed[lo // BLOCK:hi // BLOCK], out[lo:hi], squared=False))
        for lo, hi in spans:
            ours(lo, hi, noise)
        rows[name] = {"quantize_ns": enc, "dequantize_ns": dec, "median_rel_error": error(decode_(packed, out, False))}
    try:
        from torchao.optim.quant_utils import create_dynamic_map, dequant_with_qmap, quantize_8bit_with_qmap, scale_tensor
        qmap = torch.tensor(create_dynamic_map(signed=True))
        ao = {}

        def ao_quantize(lo, hi):
            scaled, scale = scale_tensor(x[lo:hi], BLOCK)
            ao[lo] = (quantize_8bit_with_qmap(scaled, qmap), scale)
        rows["torchao"] = {"quantize_ns": timed(ao_quantize),
                           "dequantize_ns": timed(lambda lo, hi: dequant_with_qmap(*ao[lo][:1], qmap, ao[lo][1])),
                           "median_rel_error": error(torch.cat([dequant_with_qmap(ao[lo][0], qmap, ao[lo][1])
                                                                for lo, _ in spans]))}
    except ImportError as e:
        rows["torchao"] = {"skipped": f"not installed ({e})"}
    try:
        import bitsandbytes.functional as bnb
        qb = {}

        def bnb_quantize(lo, hi):
            qb[lo] = bnb.quantize_blockwise(x[lo:hi], blocksize=BLOCK)
        rows["bitsandbytes"] = {"quantize_ns": timed(bnb_quantize),
                                "dequantize_ns": timed(lambda lo, hi: bnb.dequantize_blockwise(*qb[lo])),
                                "median_rel_error": error(torch.cat([bnb.dequantize_blockwise(*qb[lo])
                                                                     for lo, _ in spans]))}
    except Exception as e:   # not installed, or no CPU backend in this build
        rows["bitsandbytes"] = {"skipped": f"{type(e).__name__}: {str(e)[:200]}"}
    torch.set_num_threads(prev)
    return {"numel": numel, "reps": reps, "threads": 1, "block": BLOCK, "rows": rows,
            "baseline": "torchao's / bitsandbytes' blockwise 8-bit quantizer on the same tensor, same thread"}


# ---------------------------------------------------------------- 1. the optimizer step on NVMe

def raw_bandwidth(path: str, nbytes: int, threads: int, block_bytes: int = 8 << 20) -> dict:
    """O_DIRECT sequential pwrite then pread of ``nbytes`` in ``block_bytes``, blocks over ``threads``."""
    nblocks = max(1, nbytes // block_bytes)
    bufs = [aligned_empty(block_bytes) for _ in range(threads)]
    for b in bufs:
        b.fill_(7)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nblocks * block_bytes)

        def run(write: bool) -> float:
            def worker(t):
                view = memoryview(bufs[t].numpy())
                for i in range(t, nblocks, threads):
                    (os.pwritev if write else os.preadv)(fd, [view], i * block_bytes)
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(threads) as pool:
                list(pool.map(worker, range(threads)))
            if write:
                os.fdatasync(fd)
            return nblocks * block_bytes / (time.perf_counter() - t0)

        return {"write_Bps": run(True), "read_Bps": run(False)}
    finally:
        os.close(fd)
        os.unlink(path)


def _optimizer_store(root: str, shard_numel: int, shards: int, host_shards: int, io: IOConfig):
    shard_bytes = shard_numel * (4 * 4 + 2)
    tiers = TiersConfig(device_bytes=1 << 20, host_bytes=host_shards * shard_bytes + (1 << 20), nvme_path=root)
    store = TensorStore(tiers, io)
    jobs = []
    g = torch.Generator().manual_seed(0)
    for i in range(shards):
        p = torch.randn(shard_numel, generator=g)
        store.wait(store.register(f"u{i}.master", p, home="nvme"))
        store.wait(store.register(f"u{i}.param", p.to(torch.bfloat16), home="nvme"))
        store.wait(store.register(f"u{i}.grad", torch.randn(shard_numel, generator=g) * 1e-3, home="nvme"))
        for name in ("exp_avg", "exp_avg_sq"):
            store.wait(store.register(f"u{i}.{name}", (shard_numel,), dtype=torch.float32, home="nvme"))
        jobs.append(ShardJob(f"u{i}", f"u{i}.master", f"u{i}.exp_avg", f"u{i}.exp_avg_sq", f"u{i}.grad",
                             f"u{i}.param", [(0, 0, shard_numel)]))
    for i in range(shards):   # start cold: nothing cached in host memory
        for name in ("master", "param", "grad", "exp_avg", "exp_avg_sq"):
            store.wait(store.evict(f"u{i}.{name}", Tier.HOST))
    return store, jobs


def _nvme_bytes(store, before: dict) -> tuple:
    moved = store.stats()["moved_bytes"]
    read = moved.get("nvme->host", 0) - before.get("nvme->host", 0)
    write = moved.get("host->nvme", 0) - before.get("host->nvme", 0)
    return read, write


def _serial_step(store, adam, jobs, step: int) -> None:
    """Baseline: per shard, read everything, update, write everything back and wait."""
    for job in jobs:
        keys = [job.master, job.exp_avg, job.exp_avg_sq, job.grad, job.param_out]
        t = [store.wait(store.bring(k, Tier.HOST, pin=True)) for k in keys]
        adam.step_(t[0], t[3], t[1], t[2], step=step, out=t[4], **HYPER)
        for k in keys:
            if k != job.grad:
                store.mark_dirty(k, Tier.HOST)
            store.unpin(k, Tier.HOST)
        for k in keys:
            store.wait(store.write_back(k))
            store.wait(store.evict(k, Tier.HOST))   # the serial way keeps nothing cached either


def bench_optimizer(root: str, numel: int, shard_numel: int, threads: int, reps: int) -> dict:
    shards = max(1, numel // shard_numel)
    io = IOConfig()
    raw = raw_bandwidth(os.path.join(root, "raw.bin"), shards * shard_numel * 18, io.threads)
    out = {"numel": shards * shard_numel, "shard_numel": shard_numel, "shards": shards,
           "raw_read_gbps": raw["read_Bps"] / 1e9, "raw_write_gbps": raw["write_Bps"] / 1e9}
    adam = CpuAdamW(threads=threads)
    try:
        store, jobs = _optimizer_store(root, shard_numel, shards, host_shards=3, io=io)
        with store:
            pipe = AdamPipeline(store, adam, lookahead=2)
            times, bounds, reads, writes, waits = [], [], [], [], []
            for step in range(1, reps + 1):
                before = dict(store.stats()["moved_bytes"])
                t0 = time.perf_counter()
                stats = pipe.run(jobs, lambda gi, step=step: dict(HYPER, step=step))
                times.append(time.perf_counter() - t0)
                r, w = _nvme_bytes(store, before)
                reads.append(r)
                writes.append(w)
                bounds.append(r / raw["read_Bps"] + w / raw["write_Bps"])
                waits.append(stats["swap_in_wait_s"])
            io_mode = (store.stats()["io"] or {}).get("mode")
        store, jobs = _optimizer_store(root, shard_numel, shards, host_shards=3, io=io)
        with store:
            serial = []
            for step in range(1, reps + 1):
                t0 = time.perf_counter()
                _serial_step(store, adam, jobs, step)
                serial.append(time.perf_counter() - t0)
    finally:
        adam.close()
    step_s, bound_s, serial_s = statistics.median(times), statistics.median(bounds), statistics.median(serial)
    out.update({
        "io_mode": io_mode, "read_bytes": int(statistics.median(reads)), "write_bytes": int(statistics.median(writes)),
        "pipelined_s": step_s, "io_lower_bound_s": bound_s, "serial_s": serial_s,
        "swap_in_wait_s": statistics.median(waits),
        "ratio_vs_io_bound": step_s / bound_s, "target_ratio_vs_io_bound": 1.10,
        "serial_over_pipelined": serial_s / step_s,
        "baseline": "io_lower_bound_s: NVMe bytes the step moved / raw O_DIRECT bandwidth (same dir, same run, "
                    "engine thread count); serial_s: the same step per shard read-update-write-wait",
    })
    return out


# ---------------------------------------------------------------- 2. CPU Adam vs torch fused

def bench_adam(shard_numel: int, shards: int, threads: int, reps: int) -> dict:
    """Ours and torch's alternate rep by rep, so load from other processes hits both alike."""
    g = torch.Generator().manual_seed(0)
    mk = lambda: [torch.randn(shard_numel, generator=g) for _ in range(shards)]  # noqa: E731
    p, gr = mk(), mk()
    m, v = [torch.zeros(shard_numel) for _ in range(shards)], [torch.zeros(shard_numel) for _ in range(shards)]
    out_lp = [torch.empty(shard_numel, dtype=torch.bfloat16) for _ in range(shards)]
    params = [torch.nn.Parameter(x.clone()) for x in p]
    for prm, x in zip(params, gr):
        prm.grad = x
    opt = torch.optim.AdamW(params, fused=True, **HYPER)
    ours = CpuAdamW(threads=threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    ours_s, torch_s = [], []
    try:
        for step in range(1, reps + 2):   # step 1 is a warm-up (torch allocates its state there)
            t0 = time.perf_counter()
            for i in range(shards):
                ours.step_(p[i], gr[i], m[i], v[i], step=step, out=out_lp[i], **HYPER)
            t1 = time.perf_counter()
            opt.step()
            for prm, lp in zip(params, out_lp):
                lp.copy_(prm.detach())
            t2 = time.perf_counter()
            if step > 1:
                ours_s.append(t1 - t0)
                torch_s.append(t2 - t1)
    finally:
        ours.close()
        torch.set_num_threads(prev)
    same = all(torch.equal(a, b.detach()) for a, b in zip(p, params))
    a, b = statistics.median(ours_s), statistics.median(torch_s)
    return {"shard_numel": shard_numel, "shards": shards, "threads": threads, "cpu_adam_s": a,
            "torch_fused_plus_copy_s": b, "torch_over_ours": b / a, "target_torch_over_ours": 1.0,
            "bitwise_equal_to_torch": same,
            "baseline": "torch.optim.AdamW(fused=True).step() then bf16 copy of each param, same shards, "
                        "torch threads = ours, alternating rep by rep"}


# ---------------------------------------------------------------- 2b. CPU Adam per stored format

FORMATS = (("fp32", "fp32"), ("remainder", "fp32"), ("fp32", "bf16"), ("remainder", "bf16"), ("fp32", "int8"),
           ("remainder", "int8"), ("fp32", "int8/torch"), ("remainder", "int8/torch"))
# "int8/torch": int8 moments by the torch path, which runs where the compiled kernel cannot be built


@contextlib.contextmanager
def _int8_path(moments: str):
    """The compiled int8 kernel off for an ``int8/torch`` row (the torch path), else as it is."""
    if not moments.endswith("/torch"):
        yield
        return
    kernel = native.kernel
    native.kernel = lambda: None
    try:
        yield
    finally:
        native.kernel = kernel


def bench_formats(shard_numel: int, shards: int, threads: int, reps: int) -> dict:
    """``CpuAdamW`` time per element with each stored format (``optimizer.master`` x ``moments``) against
    the fp32 master and fp32 moments, bf16 parameter written back in every case; the formats alternate
    rep by rep so load from other processes hits all alike. The overhead is the formats' conversions
    (join/split of the master, widening/rounding of the moments) over the plain fp32 update."""
    from infinity.profile.cpu_adam import format_states

    g = torch.Generator().manual_seed(0)
    states = {}
    for master, moments in FORMATS:
        rows = []
        for i in range(shards):
            p32 = torch.randn(shard_numel, generator=torch.Generator().manual_seed(i))
            p, m, v, out = format_states(p32, master, moments.split("/")[0])
            rows.append((p, torch.randn(shard_numel, generator=g), m, v, out))
        states[(master, moments)] = rows
    ours = CpuAdamW(threads=threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = {k: [] for k in FORMATS}
    try:
        for step in range(1, reps + 2):   # step 1 is a warm-up
            for key in FORMATS:
                with _int8_path(key[1]):
                    t0 = time.perf_counter()
                    for p, gr, m, v, out in states[key]:
                        ours.step_(p, gr, m, v, step=step, out=out, **HYPER)
                    elapsed = time.perf_counter() - t0
                if step > 1:
                    times[key].append(elapsed)
    finally:
        ours.close()
        torch.set_num_threads(prev)
    numel = shard_numel * shards
    base = statistics.median(times[FORMATS[0]])
    rows = {}
    for (master, moments), ts in times.items():
        t = statistics.median(ts)
        rows[f"{master}/{moments}"] = {"step_s": t, "ns_per_element": t / numel * 1e9, "vs_fp32": t / base,
                                       "overhead": t / base - 1}
    return {"shard_numel": shard_numel, "shards": shards, "threads": threads, "reps": reps, "formats": rows,
            "target_overhead": 0.25, "int8_kernel": "compiled" if native.kernel() else f"torch ({native.native_reason()})",
            "baseline": "CpuAdamW with fp32 master and fp32 moments (bf16 parameter written back), same shards "
                        "and threads, alternating format by format within each rep"}


# ---------------------------------------------------------------- 3. ZeRO-3 on NVMe vs in memory

ZERO3_CHILD = r"""
import json, resource, sys, time, torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
import infinity
from infinity.models import GPT, GPTConfig, gpt_init_
cfg = GPTConfig(**args["gpt"])
torch.manual_seed(0)
if args["offload"]:
    with torch.device("meta"):
        model = GPT(cfg)
else:
    model = GPT(cfg)
numel = sum(p.numel() for p in model.parameters())
conf = {"zero": {"stage": 3}, "precision": {"param_dtype": "fp32"},
        "optimizer": {"threads": args["threads"], "update_at": "auto" if args["offload"] and args["overlap"] else "step"}}
if args["offload"]:
    conf.update(offload={"optimizer": "nvme", "params": "nvme", "grads": args["grads"]},
                tiers={"nvme_path": args["dir"], "host_bytes": args["host_bytes"], "device_bytes": args["device_bytes"]},
                prefetch={"bytes": args["prefetch_bytes"], "max_live_bytes": args["max_live_bytes"]})
model, opt = infinity.initialize(model, conf, init_fn=(lambda m: gpt_init_(m, cfg)) if args["offload"] else None)
engine = infinity.engine_of(model)
g = torch.Generator().manual_seed(1)
times, stats = [], []
for step in range(args["steps"] + 1):
    ids = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq"]), generator=g)
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step:
        times.append(time.perf_counter() - t0)
    stats.append(engine.stats.last_step)
precision = {"param_dtype": engine.config.precision.param_dtype, "compute_dtype": engine.config.precision.compute_dtype}
engine.close()
med = lambda xs: sorted(xs)[len(xs) // 2]
phases = {k: med([s[k] for s in stats[1:]]) for k in ("forward_s", "backward_s", "step_s")}
print(json.dumps({"numel": numel, "step_s": med(times), "times": times, "phases": phases, "precision": precision,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "last_stats": stats[-1], "loss": loss.item()}, default=str))
"""


def bench_zero3(root: str, args) -> dict:
    gpt = dict(n_layer=args.layers, n_head=8, n_embd=args.width, vocab_size=args.vocab, block_size=args.seq)
    common = dict(gpt=gpt, batch=args.batch, seq=args.seq, steps=args.steps, threads=args.threads, dir=root,
                  host_bytes=args.host_bytes, device_bytes=args.device_bytes, prefetch_bytes=args.prefetch_bytes,
                  max_live_bytes=args.max_live_bytes, grads=args.grads, overlap=args.overlap)
    res = {}
    for name, offload in (("in_memory", False), ("nvme", True)):
        # glibc's adaptive mmap threshold otherwise keeps freed unit-sized buffers in the heap, and
        # peak RSS then measures allocator retention; fixed here for both children alike
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        p = subprocess.run([sys.executable, "-c", ZERO3_CHILD, json.dumps(dict(common, offload=offload))],
                           capture_output=True, text=True, timeout=1200, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"zero3 {name} child failed:\n{p.stderr[-4000:]}")
        res[name] = json.loads(p.stdout.strip().splitlines()[-1])
    state = res["nvme"]["numel"] * 16
    return {
        "model": gpt, "batch": args.batch, "seq": args.seq, "steps": args.steps, "numel": res["nvme"]["numel"],
        "in_memory_step_s": res["in_memory"]["step_s"], "nvme_step_s": res["nvme"]["step_s"],
        "nvme_over_in_memory": res["nvme"]["step_s"] / res["in_memory"]["step_s"], "target_ratio": 1.25,
        "grads": args.grads, "update_at": "auto" if args.overlap else "step", "precision": res["nvme"]["precision"],
        "in_memory_phases_s": res["in_memory"]["phases"], "nvme_phases_s": res["nvme"]["phases"],
        "training_state_bytes": state,
        "in_memory_peak_rss_bytes": res["in_memory"]["peak_rss_bytes"],
        "nvme_peak_rss_bytes": res["nvme"]["peak_rss_bytes"],
        "nvme_peak_rss_over_state": res["nvme"]["peak_rss_bytes"] / state,
        "in_memory_peak_rss_over_state": res["in_memory"]["peak_rss_bytes"] / state,
        "nvme_last_step_stats": res["nvme"]["last_stats"].get("offload"),
        "baseline": "the same GPT, seed and batches at stage 3 fully in memory, one process each, world size 1",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--dir", default=None, help="swap directory (default: a temp dir under /work)")
    ap.add_argument("--optim-numel", type=parse_size, default=parse_size("32M"), help="elements in the optimizer bench")
    ap.add_argument("--shard-numel", type=parse_size, default=parse_size("2M"), help="elements per shard")
    ap.add_argument("--threads", type=int, default=default_adam_threads())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-zero3", action="store_true")
    ap.add_argument("--only", choices=("adam", "formats", "quantizers", "optimizer", "zero3"), help="run one section")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-bytes", default="96MiB")
    ap.add_argument("--device-bytes", default="64MiB")
    ap.add_argument("--prefetch-bytes", default="32MiB")
    ap.add_argument("--max-live-bytes", default="64MiB")
    ap.add_argument("--grads", choices=("host", "nvme"), default="nvme", help="ZeRO-3 bench: where gradients live")
    ap.add_argument("--overlap", action="store_true",
                    help="ZeRO-3 bench: the NVMe run with optimizer.update_at auto (updates during backward)")
    args = ap.parse_args(argv)
    base = args.dir or ("/work" if os.path.isdir("/work") else None)
    root = tempfile.mkdtemp(prefix="bench_offload_", dir=base)
    torch.set_num_threads(args.threads)
    try:
        want = lambda name: args.only in (None, name)  # noqa: E731
        result = {"threads": args.threads, "hardware": hardware_record("cpu")}
        if want("adam"):
            result["adam"] = bench_adam(args.shard_numel, max(1, args.optim_numel // args.shard_numel // 4),
                                        args.threads, args.reps)
        if want("formats"):
            result["formats"] = bench_formats(args.shard_numel, max(1, args.optim_numel // args.shard_numel // 4),
                                              args.threads, args.reps)
        if want("quantizers"):
            result["quantizers"] = bench_quantizers(args.shard_numel, args.reps)
        if want("optimizer"):
            result["optimizer"] = bench_optimizer(root, args.optim_numel, args.shard_numel, args.threads, args.reps)
        if want("zero3") and not args.skip_zero3:
            result["zero3"] = bench_zero3(root, args)
        result["peak_rss_bytes_bench"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(hardware_line(result.pop("hardware")))
        for section, figures in result.items():
            print(section, json.dumps(figures, indent=1) if isinstance(figures, dict) else figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
