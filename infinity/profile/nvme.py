"""The profile's ``nvme`` section: the I/O engine over a sweep of block size x threads x queue depth, each row
beside a plain pread/pwrite loop in the same directory; the engine reading and writing at once at the best
row's settings (``nvme.mixed``); and the best row as a config ``io`` section."""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from infinity.config import IOConfig, format_size
from infinity.io import ExtentFile, IOEngine, aligned_empty
from infinity.io.buffers import tensor_bytes_view
from infinity.io.syscalls import O_DIRECT
from infinity.profile.options import ProfileError, _MiB

__all__ = ["measure_nvme", "measure_nvme_mixed", "best_io", "BEST_IO_MARGIN"]

# Sweep grids. The engine's disk depth is min(threads, queue_depth), so depths above the
# thread count would repeat a row; each thread count is tried at full and at half depth.
_QUICK_BLOCKS = (1 * _MiB, 4 * _MiB)
_QUICK_THREADS = (1, 2)
_FULL_BLOCKS = (1 * _MiB, 4 * _MiB, 8 * _MiB, 16 * _MiB)
_FULL_THREADS = (1, 2, 4, 8)
_TENSORS_PER_POINT = 4  # requests in flight at once in an engine point, each cut into blocks
# The config's default io settings, a row of every sweep: the best row must beat them by this much to be
# chosen. One pass of a shared disk per row is noisy, and a row that wins a pass by a little at a low
# queue depth can starve a step that keeps many requests in flight (measured at 2.7B: a quick profile's
# 4 MiB / 2 threads / depth 1 row spilled and left 20-25 s of I/O to the step phase, 91-95 s a step,
# where the defaults took 60-66 s).
_DEFAULT_IO = IOConfig()
BEST_IO_MARGIN = 0.10


def _sweep_points(quick: bool, point_bytes: int) -> list[tuple[int, int, int]]:
    """(block_bytes, threads, queue_depth) rows. A block must fit four times in a point (and
    so in each of the four tensors moved): with fewer pieces than threads a row would measure
    idle threads, not the block size."""
    blocks = [b for b in (_QUICK_BLOCKS if quick else _FULL_BLOCKS) if b * _TENSORS_PER_POINT <= point_bytes]
    rows = []
    for block in blocks:
        for threads in (_QUICK_THREADS if quick else _FULL_THREADS):
            for depth in sorted({max(1, threads // 2), threads}):
                rows.append((block, threads, depth))
    default = (_DEFAULT_IO.block_bytes, _DEFAULT_IO.threads, _DEFAULT_IO.queue_depth)
    if default not in rows and default[0] * _TENSORS_PER_POINT <= point_bytes:
        rows.append(default)
    return rows


def _drop_file_cache(fd: int) -> None:
    # In buffered mode a read right after the write would come from the page cache,
    # not the disk; DONTNEED evicts this file's clean pages (no root needed).
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _raw_point(path: str, point_bytes: int, block_bytes: int, threads: int, direct: bool) -> tuple[float, float]:
    """(write GB/s, read GB/s) of a plain pwritev/preadv loop, ``threads`` workers taking
    every threads-th block of a preallocated file."""
    blocks = point_bytes // block_bytes
    buffers = [aligned_empty(block_bytes).fill_(t + 1) for t in range(threads)]
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (O_DIRECT if direct else 0))

    def loop(worker: int, write: bool) -> None:
        view = tensor_bytes_view(buffers[worker])
        for b in range(worker, blocks, threads):
            done = 0
            while done < block_bytes:  # short transfers are legal: loop
                offset = b * block_bytes + done
                n = os.pwritev(fd, [view[done:]], offset) if write else os.preadv(fd, [view[done:]], offset)
                if n <= 0:
                    raise OSError(f"{'pwritev' if write else 'preadv'} of {path} at {offset} made no progress")
                done += n

    def timed(write: bool) -> float:
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            for f in [pool.submit(loop, w, write) for w in range(threads)]:
                f.result()
            if write:
                os.fdatasync(fd)  # the engine's write figure includes its flush; so does this one
            return max(time.perf_counter() - t0, 1e-9)

    try:
        write_s = timed(True)
        _drop_file_cache(fd)
        read_s = timed(False)
    finally:
        os.close(fd)
    moved = blocks * block_bytes
    return moved / write_s / 1e9, moved / read_s / 1e9


def _engine_point(directory: str, io: IOConfig, point_bytes: int, src: torch.Tensor,
                  dsts: list[torch.Tensor]) -> tuple[float, float]:
    """(write GB/s, read GB/s) of ExtentFile + IOEngine moving ``len(dsts)`` tensors at once."""
    tensor_bytes = src.numel()
    with IOEngine(io) as engine, ExtentFile(directory, engine, direct=io.direct, checksum=io.checksum,
                                            initial_bytes=point_bytes) as swap:
        t0 = time.perf_counter()
        for f in [swap.write(f"t{i}", src) for i in range(len(dsts))]:
            f.result()
        swap.flush()
        write_s = max(time.perf_counter() - t0, 1e-9)
        fd = os.open(swap.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _drop_file_cache(fd)
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        for f in [swap.read(f"t{i}", dst) for i, dst in enumerate(dsts)]:
            f.result()
        read_s = max(time.perf_counter() - t0, 1e-9)
    if not (torch.equal(dsts[0], src) and torch.equal(dsts[-1], src)):
        raise AssertionError(f"profile: the I/O engine read back other bytes than it wrote in {directory}")
    moved = tensor_bytes * len(dsts)
    return moved / write_s / 1e9, moved / read_s / 1e9


def measure_nvme_mixed(directory: str, io: IOConfig, point_bytes: int, repeats: int = 3) -> dict:
    """The engine reading ``point_bytes`` (written and dropped from the page cache first) while writing as
    many new bytes, both started at once: each direction's GB/s while they share the disk, the median of
    ``repeats`` rounds (one round of a shared disk can read half of the next: a planner fed it would
    predict the step's I/O from a moment, not the disk)."""
    tensors = _TENSORS_PER_POINT
    tensor_bytes = point_bytes // tensors
    src = aligned_empty(tensor_bytes).copy_(torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8))
    dsts = [aligned_empty(tensor_bytes).zero_() for _ in range(tensors)]
    moved = tensor_bytes * tensors
    rounds = []
    with IOEngine(io) as engine, ExtentFile(directory, engine, direct=io.direct, checksum=io.checksum,
                                            initial_bytes=2 * point_bytes) as swap:
        for f in [swap.write(f"old{i}", src) for i in range(tensors)]:
            f.result()
        for r in range(repeats):
            swap.flush()
            fd = os.open(swap.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _drop_file_cache(fd)
            finally:
                os.close(fd)
            done: dict = {}
            t0 = time.perf_counter()
            # each round reads what the last one wrote, so no round reads bytes still in a cache
            old, new = ("old", "new") if r % 2 == 0 else ("new", "old")
            reads = [swap.read(f"{old}{i}", dst) for i, dst in enumerate(dsts)]
            writes = [swap.write(f"{new}{i}", src) for i in range(tensors)]
            for f in reads:
                f.add_done_callback(lambda _f: done.__setitem__("read", time.perf_counter()))
            for f in reads + writes:
                f.result()
            swap.flush()
            write_s = max(time.perf_counter() - t0, 1e-9)
            read_s = max(done["read"] - t0, 1e-9)
            rounds.append((moved / read_s / 1e9, moved / write_s / 1e9))
            if not torch.equal(dsts[-1], src):
                raise AssertionError(f"profile: the I/O engine read back other bytes than it wrote in {directory}")
    return {"block_bytes": io.block_bytes, "queue_depth": io.queue_depth, "threads": io.threads,
            "bytes_each_way": moved, "read_gbps": statistics.median(r for r, _ in rounds),
            "write_gbps": statistics.median(w for _, w in rounds), "rounds": [list(r) for r in rounds],
            "note": f"reads and writes of the same size started together, median of {repeats} rounds; "
                    "write time includes fdatasync"}


def measure_nvme(directory: str, point_bytes: int, quick: bool, direct: bool,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Engine sweep and raw baseline in ``directory``; files are removed before returning."""
    say = progress or (lambda _msg: None)
    point_bytes = point_bytes // _MiB * _MiB
    points = _sweep_points(quick, point_bytes)
    if not points:
        raise ProfileError(f"NVMe sweep: {point_bytes} bytes per point is less than four of the smallest block (1 MiB)")
    tensors = _TENSORS_PER_POINT
    tensor_bytes = point_bytes // tensors
    src = aligned_empty(tensor_bytes).copy_(torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8))
    dsts = [aligned_empty(tensor_bytes).zero_() for _ in range(tensors)]

    raw: dict[tuple[int, int], tuple[float, float]] = {}
    raw_path = os.path.join(directory, "raw.bin")
    for block in sorted({p[0] for p in points}):
        fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, point_bytes)  # preallocated: block allocation is not timed
        finally:
            os.close(fd)
        try:
            for threads in sorted({p[1] for p in points if p[0] == block}):
                say(f"nvme raw: block {format_size(block)}, {threads} thread(s)")
                raw[block, threads] = _raw_point(raw_path, point_bytes, block, threads, direct)
        finally:
            os.unlink(raw_path)

    sweep = []
    for block, threads, depth in points:
        say(f"nvme engine: block {format_size(block)}, {threads} thread(s), queue depth {depth}")
        io = IOConfig(block_bytes=block, queue_depth=depth, threads=threads, direct=direct, checksum=True)
        write_gbps, read_gbps = _engine_point(directory, io, point_bytes, src, dsts)
        raw_write, raw_read = raw[block, threads]
        sweep.append({"block_bytes": block, "queue_depth": depth, "threads": threads,
                      "read_gbps": read_gbps, "write_gbps": write_gbps,
                      "raw_read_gbps": raw_read, "raw_write_gbps": raw_write,
                      "read_ratio": read_gbps / raw_read, "write_ratio": write_gbps / raw_write})
    best = best_io(sweep, direct)
    say(f"nvme engine: reads and writes at once, block {format_size(best['block_bytes'])}")
    mixed = measure_nvme_mixed(directory, IOConfig(**best), point_bytes)
    return {
        "mode": "direct" if direct else "buffered",
        "bytes_per_point": point_bytes,
        "tensor_bytes": tensor_bytes,
        "sweep": sweep,
        "mixed": mixed,
        "raw": {
            "mode": "direct" if direct else "buffered",
            "baseline": "plain os.pwritev/os.preadv loop over 4096-aligned buffers, same directory, "
                        "same block size and thread count, writes include fdatasync, no checksums "
                        "(the engine rows compute CRC-32C)",
            "rows": [{"block_bytes": b, "threads": t, "read_gbps": r, "write_gbps": w}
                     for (b, t), (w, r) in sorted(raw.items())],
        },
    }


def best_io(sweep: list[dict], direct: bool) -> dict:
    """The config ``io`` section of the sweep row with the highest min(read, write) GB/s, where it beats
    the row of the config's default settings (when the sweep has one) by :data:`BEST_IO_MARGIN`; else
    the default's.

    ``direct`` is the mode the sweep ran in, not ``"auto"``: the figures hold for that mode,
    and ``direct: true`` fails loudly on an ``nvme_path`` whose file system refuses O_DIRECT
    instead of silently running buffered at other speeds.
    """
    if not sweep:
        raise ValueError("best_io: the NVMe sweep has no rows")
    def score(row):
        return min(row["read_gbps"], row["write_gbps"])
    best = max(sweep, key=score)
    default = next((r for r in sweep if (r["block_bytes"], r["threads"], r["queue_depth"]) ==
                    (_DEFAULT_IO.block_bytes, _DEFAULT_IO.threads, _DEFAULT_IO.queue_depth)), None)
    if default is not None and score(best) < (1 + BEST_IO_MARGIN) * score(default):
        best = default
    return {"block_bytes": best["block_bytes"], "queue_depth": best["queue_depth"], "threads": best["threads"],
            "direct": bool(direct), "checksum": True}

