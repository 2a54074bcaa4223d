"""The profile's ``contention`` section: how much a CPU compute probe slows while the I/O engine reads and writes
at once, and the engine's own CPU seconds per GB moved."""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from infinity.config import IOConfig
from infinity.io import ExtentFile, IOEngine, aligned_empty
from infinity.precision import DTYPES
from infinity.profile.nvme import _TENSORS_PER_POINT
from infinity.profile.timing import _median_s

__all__ = ["measure_io_contention", "CONTENTION_PROBE_S"]

# One pass of the contention probe: long enough that a disk round's burst of CPU falls inside it, short
# enough that its repeats (alone and beside the disk) stay a few seconds at any rate.
CONTENTION_PROBE_S = 0.25


def _contention_rows(gflops: float, width: int) -> int:
    """Rows for one probe pass of :data:`CONTENTION_PROBE_S` at ``gflops`` (a multiple of 16, 16 to 2048)."""
    flops_per_row = 2 * 2 * width * 4 * width   # two matmuls through the 4x wider layer
    rows = int(CONTENTION_PROBE_S * gflops * 1e9 / flops_per_row) // 16 * 16
    return min(max(rows, 16), 2048)


def _contention_probe(dtype: str, gflops: float, width: int = 2048) -> tuple[Callable[[], object], str]:
    """One pass of a transformer block's shapes in ``dtype``: two matmuls through a 4x wider layer, a
    LayerNorm and a GELU (the memory-bound ops, which feel a busy memory bus most), its rows sized so the
    pass takes about :data:`CONTENTION_PROBE_S` at ``gflops``; and the probe in words."""
    rows = _contention_rows(gflops, width)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g).to(DTYPES[dtype])
    w1 = torch.randn(width, 4 * width, generator=g).to(DTYPES[dtype])
    w2 = torch.randn(4 * width, width, generator=g).to(DTYPES[dtype])

    def once() -> None:
        h = torch.nn.functional.gelu(x @ w1)
        torch.nn.functional.layer_norm(h @ w2, (width,))
    return once, f"{dtype} ({rows} x {width}) @ ({width} x {4 * width}), GELU, @ ({4 * width} x {width}), LayerNorm"


def measure_io_contention(directory: str, io: IOConfig, point_bytes: int, repeats: int,
                          dtype: str, gflops: float) -> dict:
    """The probe's time alone and while the engine streams reads and writes of ``point_bytes`` at once
    (rounds of reading one set of tensors and writing another, each flushed, until the probe is done),
    median of ``repeats`` each; and the engine's process CPU seconds per GB moved, streaming alone.
    The probe computes in ``dtype`` (the one the CPU's compute runs in), sized from its ``gflops``."""
    probe, described = _contention_probe(dtype, gflops)
    probe()   # first-touch pages and kernels' set-up are not timed
    alone = _median_s(probe, repeats)
    tensors = _TENSORS_PER_POINT
    tensor_bytes = point_bytes // tensors
    src = aligned_empty(tensor_bytes).copy_(torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8))
    dsts = [aligned_empty(tensor_bytes) for _ in range(tensors)]
    with IOEngine(io) as engine, ExtentFile(directory, engine, direct=io.direct, checksum=io.checksum,
                                            initial_bytes=2 * point_bytes) as swap:
        for f in [swap.write(f"a{i}", src) for i in range(tensors)]:
            f.result()
        swap.flush()
        stop = threading.Event()
        moved = [0]
        failed: list = []

        def stream() -> None:
            rounds = 0
            try:
                while not stop.is_set():
                    old, new = ("a", "b") if rounds % 2 == 0 else ("b", "a")
                    futures = [swap.read(f"{old}{i}", dst) for i, dst in enumerate(dsts)]
                    futures += [swap.write(f"{new}{i}", src) for i in range(tensors)]
                    for f in futures:
                        f.result()
                    swap.flush()
                    moved[0] += 2 * tensor_bytes * tensors
                    rounds += 1
            except BaseException as e:   # noqa: BLE001 - raised on the caller's thread below
                failed.append(e)

        def streaming(body: Callable[[], object]) -> tuple:
            stop.clear()
            moved[0] = 0
            cpu0, t0 = time.process_time(), time.perf_counter()
            thread = threading.Thread(target=stream, name="infinity-profile-contention", daemon=True)
            thread.start()
            try:
                result = body()
            finally:
                stop.set()
                thread.join()
            if failed:
                raise failed[0]
            return result, time.process_time() - cpu0, time.perf_counter() - t0

        _, io_cpu_s, io_s = streaming(lambda: time.sleep(max(1.0, 2 * alone)))
        io_bytes = moved[0]
        beside, _, beside_wall = streaming(lambda: _median_s(probe, repeats))
        beside_bytes = moved[0]
    return {"probe": described, "dtype": dtype,
            "compute_alone_s": alone, "compute_beside_io_s": beside, "slowdown": max(1.0, beside / alone),
            "io_gbps": io_bytes / io_s / 1e9, "io_gbps_beside_compute": beside_bytes / beside_wall / 1e9,
            "io_cpu_s_per_gb": io_cpu_s / max(io_bytes / 1e9, 1e-9),
            "block_bytes": io.block_bytes, "threads": io.threads, "queue_depth": io.queue_depth,
            "note": "probe times are medians; io_gbps counts both directions; the slowdown is floored at 1"}

