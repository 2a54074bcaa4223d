"""The profile's ``collectives`` section: gloo all-reduce, all-gather and reduce-scatter across spawned local
ranks, as algorithm and bus bandwidth."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch

__all__ = ["measure_collectives"]

_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _collective_rank(rank: int, nproc: int, init_file: str, sizes: list[int], iters: int, result_path: str) -> None:
    """One spawned rank: time each collective at each size; rank 0 writes the rows as JSON."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # nproc ranks share the machine's cores
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=nproc,
                            timeout=timedelta(seconds=300))
    try:
        rows = []
        for size in sizes:
            full = torch.zeros(size // 4)  # zeros: repeated sums stay finite
            shard = torch.zeros(full.numel() // nproc)
            calls = {"all_reduce": lambda: dist.all_reduce(full),
                     "all_gather": lambda: all_gather(full, shard),
                     "reduce_scatter": lambda: reduce_scatter(shard, full)}
            for name in _COLLECTIVES:
                calls[name]()  # warm-up: gloo sets up its buffers on first use of a size
                dist.barrier()  # all ranks start the timed loop together
                t0 = time.perf_counter()
                for _ in range(iters):
                    calls[name]()
                elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective is as fast as its slowest rank
                rows.append((name, full.numel() * 4, max(float(elapsed), 1e-9)))
        if rank == 0:
            tmp = result_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rows, f)
            os.replace(tmp, result_path)  # the parent never reads a half-written file
    finally:
        dist.destroy_process_group()


def measure_collectives(nproc: int, sizes: list[int], iters: int, scratch_dir: str) -> dict:
    """gloo collectives across ``nproc`` spawned local ranks; ``sizes`` are full-tensor bytes."""
    if nproc == 1:
        return {"available": False, "nproc": 1, "reason": "single rank: no collectives"}
    import torch.multiprocessing as torch_mp

    quantum = 4 * nproc  # fp32 elements that split evenly over the ranks
    sizes = sorted({max(quantum, s // quantum * quantum) for s in sizes})
    init_file = os.path.join(scratch_dir, "collectives.init")
    result_path = os.path.join(scratch_dir, "collectives.json")
    torch_mp.spawn(_collective_rank, args=(nproc, init_file, sizes, iters, result_path), nprocs=nproc, join=True)
    with open(result_path) as f:
        timings = json.load(f)
    # Bus bandwidth: bytes each rank sends per byte of result on a ring (nccl-tests' factors).
    bus_factor = {"all_reduce": 2 * (nproc - 1) / nproc,
                  "all_gather": (nproc - 1) / nproc, "reduce_scatter": (nproc - 1) / nproc}
    rows = [{"op": name, "bytes": nbytes, "time_s": seconds, "algbw_gbps": nbytes / seconds / 1e9,
             "busbw_gbps": nbytes / seconds / 1e9 * bus_factor[name]} for name, nbytes, seconds in timings]
    return {"available": True, "backend": "gloo", "nproc": nproc, "iters": iters, "rows": rows,
            "note": "bytes = full tensor (all-gather output, reduce-scatter input); algbw = bytes / time per rank"}

