"""Bandwidth profile of this machine, behind ``infinity profile`` (DESIGN §1).

Sections of the profile (GB/s = 1e9 bytes per second throughout):

- ``machine``: cores, RAM, the swap directory's file system and whether it takes O_DIRECT.
- ``compute``: matmul GFLOP/s of each dtype at transformer linear-layer shapes (:data:`COMPUTE_SHAPES`:
  (d, d) and (d, 4d) for d 768 and 2048), forward and both gradients, by
  :func:`infinity.precision.measure_rates` (bounded: a dtype far slower than the fastest is stopped after a
  few rows), on the CPU (fp32, bf16) and on a CUDA device (fp32, bf16, fp16); what
  ``precision.param_dtype: auto`` chooses from those rates with the parameters offloaded and not; and the
  hardware (CPU model and its bf16 instructions, torch, the CUDA device). Later compute probes run in the
  dtype ``auto`` computes in here, so none runs in an emulated one.
- ``memcpy``: host memory copy bandwidth, bytes copied per second (each byte read once and
  written once), by ``Tensor.copy_`` on torch's intra-op threads and by one thread's libc
  ``memcpy``. The ceiling for host-tier moves and for the engine's staging copies.
- ``host_device``: host-to-device and device-to-host copies from pinned and from pageable
  memory; CUDA only, otherwise ``{"available": false, "reason": ...}``.
- ``nvme``: the project's own :class:`~infinity.io.IOEngine` + :class:`~infinity.io.ExtentFile`
  (checksums on, as the config defaults) over a sweep of block_bytes x threads x queue_depth,
  each row next to the baseline measured in the same run: a plain pread/pwrite loop over
  4096-aligned buffers with O_DIRECT (buffered where the file system refuses it), with the
  same block size and thread count, in the same directory. Writes include ``fdatasync``.
- ``cpu_adam``: :class:`~infinity.optim.cpu_adam.CpuAdamW` next to
  ``torch.optim.AdamW(fused=True)`` on one flat fp32 shard: parameters per second and GB/s of
  state streamed (16 bytes per parameter: fp32 param, grad, exp_avg, exp_avg_sq).
- ``collectives``: gloo all-reduce, all-gather and reduce-scatter across ``nproc`` local
  processes: algorithm bandwidth (bytes of the full tensor per second, per rank) and bus
  bandwidth (the same scaled by the ring's traffic factor, as nccl-tests report it).
- ``nvme.mixed``: the engine at the best row's settings reading one set of tensors while it
  writes another, both at once (what the optimizer step's pipeline does): each direction's GB/s
  while sharing the disk. The planner's "read and write at once" rates.
- ``contention``: how much compute on the CPU slows while the engine reads and writes at once (at the
  best row's settings), as an overlapped offloaded step runs them beside a CPU device's compute: a
  probe (matmuls and a LayerNorm + GELU at transformer shapes, on torch's intra-op threads, in the
  CPU's ``auto`` compute dtype, its rows sized from the ``compute`` rate to a fraction of a second)
  timed alone and beside the streaming disk, their ratio (``slowdown``), and the engine's own CPU
  seconds per GB moved (checksums, the I/O threads). The planner's slowdown of a CPU device's compute
  for the part of a phase the disk is busy.
- ``io``: the best sweep row (highest ``min(read, write)``) as a config ``io`` section;
  ``Config.from_dict({"io": profile["io"]})`` loads it as it is.

Sizes: ``--quick`` runs fewer sweep points and repeats, never smaller ones: below
:data:`STEADY_BYTES` per figure, set-up cost (thread start, the first pages, a
disk's request latency) and caches dominate (64 MiB runs put the I/O engine at
0.4-0.7x the raw disk and CPU Adam at 3x torch's, in L3). A ``--bytes`` below it
is measured as asked and marked: ``settings.lower_bound`` is true and
``settings.note`` says the figures are not steady-state rates.

Figures are the best of a few repeats (NVMe points run once: the disk is the slow part).
The profile asks what the machine can do; on a shared machine the best run is the one
least disturbed by its neighbours.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import psutil
import torch

from infinity.config import MASTER_FORMATS, MOMENT_FORMATS, IOConfig, format_size
from infinity.io import ExtentFile, IOEngine, SwapIOError, aligned_empty, probe_direct_io
from infinity.io.buffers import tensor_bytes_view
from infinity.io.new_files import replaced
from infinity.io.syscalls import O_DIRECT
from infinity.optim.cpu_adam import CpuAdamW, default_adam_threads
from infinity.optim.moment_codes import moment_format
from infinity.optim.split_master import split_bf16_
from infinity.precision import DTYPES, choose, hardware_record, measure_rates
from infinity.store.memory_grant import host_memory

__all__ = [
    "ProfileError",
    "ProfileOptions",
    "run_profile",
    "write_profile",
    "measure_memcpy",
    "measure_host_device",
    "measure_compute",
    "describe_compute",
    "cpu_compute_dtype",
    "measure_nvme",
    "measure_cpu_adam",
    "measure_collectives",
    "best_io",
    "measure_nvme_mixed",
    "PROFILE_JSON",
    "PROFILE_PLOT",
    "STEADY_BYTES",
    "COMPUTE_SHAPES",
]

PROFILE_JSON = "profile.json"
PROFILE_PLOT = "profile_nvme.png"

_MiB = 2**20
_MIN_SIZE_BYTES = 16 * _MiB  # a quarter of it is the smallest NVMe point: four 1 MiB blocks
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
# The smallest base size whose figures are steady-state rates (module doc): an NVMe point of a quarter
# of it (32 MiB requests), CPU Adam over 32M parameters (512 MiB of state, far past any cache).
STEADY_BYTES = 512 * _MiB
FRESH_BYTES = 64 * _MiB   # a fresh-memory copy point: above glibc's largest mmap threshold (32 MiB)
# Linear-layer weight shapes of the compute section: (d, d) and (d, 4d) at a small and a mid-sized width.
# Ascending, so the probe's first pass (at its middle shape, a few rows) is not at the largest one.
COMPUTE_SHAPES = ((768, 768), (768, 3072), (2048, 2048), (2048, 8192))
# Seconds the compute section's full-size rounds may take per device, all dtypes together (at least two
# rounds run whatever the budget: the shapes above are small enough for that to stay in seconds).
COMPUTE_BUDGET_S = {True: 0.5, False: 2.0}   # by --quick
COMPUTE_ROWS = 256   # tokens: the matmul kernels' steady rate, milliseconds a step at fp32's
# One pass of the contention probe: long enough that a disk round's burst of CPU falls inside it, short
# enough that its repeats (alone and beside the disk) stay a few seconds at any rate.
CONTENTION_PROBE_S = 0.25


class ProfileError(ValueError):
    """A profile option or the swap directory is unusable; the message names which and why."""


@dataclass(frozen=True)
class ProfileOptions:
    """What ``infinity profile`` measures and how big.

    ``size_bytes``: memcpy buffer and Adam state size; each NVMe sweep point moves a
    quarter of it, the largest collective a sixteenth. Bigger = steadier figures, longer
    run, more host memory (about 2x ``size_bytes`` at peak). Default :data:`STEADY_BYTES` with
    ``quick`` (fewer points, never smaller ones: the module doc), 1 GiB otherwise; below
    :data:`STEADY_BYTES` the figures are marked as lower bounds. ``directory``: parent of the scratch directory for the NVMe sweep
    (None = the current directory; /tmp is often tmpfs, which is not the disk to measure).
    """

    quick: bool = False
    nproc: int = 2
    directory: str | None = None
    size_bytes: int | None = None

    def __post_init__(self):
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise ProfileError(f"--nproc must be an integer >= 1 (ranks for the collectives), got {self.nproc!r}")
        if self.size_bytes is not None and self.size_bytes < _MIN_SIZE_BYTES:
            raise ProfileError(f"--bytes must be at least {format_size(_MIN_SIZE_BYTES)} (each NVMe point "
                               f"moves a quarter of it, in at least four 1 MiB blocks), got {self.size_bytes} bytes")
        if self.directory is not None and not os.path.isdir(self.directory):
            what = "is not a directory" if os.path.exists(self.directory) else "does not exist"
            raise ProfileError(f"--dir {self.directory}: {what}")

    @property
    def base_bytes(self) -> int:
        if self.size_bytes is not None:
            return self.size_bytes
        return STEADY_BYTES if self.quick else 2**30

    @property
    def lower_bound(self) -> bool:
        """Whether the figures are below steady state (a base size under :data:`STEADY_BYTES`)."""
        return self.base_bytes < STEADY_BYTES

    @property
    def repeats(self) -> int:
        return 3 if self.quick else 5


# ---------------------------------------------------------------- machine and memory

def _fs_type(path: str) -> str:
    """File system type of the mount holding ``path`` (longest mount point that contains it)."""
    path = os.path.realpath(path)
    best_mount, kind = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best_mount):  # >=: a later mount on the same point shadows
            best_mount, kind = mount, part.fstype
    return kind


def machine_info(directory: str, direct: bool) -> dict:
    """The machine, as far as this process may use it: RAM is its cgroup's memory grant where that is
    smaller than the machine's (``memory_grant``: the grant as :mod:`infinity.store.memory_grant` reads it,
    None without one), since the planner sizes budgets from it."""
    mem = host_memory()
    info = {
        "cpu_count": os.cpu_count(),
        "cores_available": default_adam_threads(1),
        "ram_bytes": mem.total_bytes,
        "ram_available_bytes": mem.available_bytes,
        "memory_grant": mem.to_dict()["grant"],
        "dir": directory,
        "fs_type": _fs_type(directory),
        "direct_io": "direct" if direct else "buffered",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if info["cuda"]:  # CUDA-only: which device the host_device figures are for
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def _wall_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn``."""
    return max(min(_wall_times(fn, repeats)), 1e-9)


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``."""
    return max(statistics.median(_wall_times(fn, repeats)), 1e-9)


def measure_memcpy(nbytes: int, repeats: int = 3) -> dict:
    """Host copies: into memory already touched (``gbps``, ``single_thread_gbps``: page faults not timed)
    and into a block mapped for the copy (``fresh_gbps``: its pages faulted in and zeroed by the
    kernel as the copy first writes them, what a new tensor above the mmap threshold costs; see
    :mod:`infinity.store.host_malloc`), at least :data:`FRESH_BYTES`. The block is an anonymous mapping of
    its own, not an allocation: whatever reuses freed blocks (glibc's heap under a raised threshold,
    :mod:`infinity.store.host_cache`) would hand back touched memory."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # both written first: page faults are not timed
    torch_s = _best_s(lambda: dst.copy_(src), repeats)
    libc_s = _best_s(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes), repeats)
    del dst
    fresh_n = max(nbytes, FRESH_BYTES)
    fresh_src = src if fresh_n == nbytes else torch.ones(fresh_n, dtype=torch.uint8)
    fresh_s = _best_s(lambda: _copy_into_fresh(fresh_src), repeats)
    return {"bytes": nbytes, "threads": torch.get_num_threads(),
            "gbps": nbytes / torch_s / 1e9, "single_thread_gbps": nbytes / libc_s / 1e9,
            "fresh_bytes": fresh_n, "fresh_gbps": fresh_n / fresh_s / 1e9}


def _copy_into_fresh(src: torch.Tensor) -> None:
    """``src`` copied into a new anonymous mapping of its size (unmapped after)."""
    block = mmap.mmap(-1, src.numel())
    dst = torch.frombuffer(block, dtype=torch.uint8)
    dst.copy_(src)
    del dst
    block.close()


def measure_host_device(nbytes: int, repeats: int = 3) -> dict:
    if not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device: torch.cuda.is_available() is False"}
    return _host_device_cuda(nbytes, repeats)


def _host_device_cuda(nbytes: int, repeats: int) -> dict:
    """H2D and D2H GB/s from pinned and pageable host memory, timed with CUDA events."""
    device_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {"available": True, "device": torch.cuda.get_device_name(), "bytes": nbytes}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host_buf = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        for direction in ("h2d", "d2h"):
            dst, src = (device_buf, host_buf) if direction == "h2d" else (host_buf, device_buf)
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()  # warm-up finished, so it does not overlap the timed copies
            best_s = math.inf
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=pinned)
                end.record()
                end.synchronize()  # elapsed_time needs both events complete
                best_s = min(best_s, start.elapsed_time(end) / 1e3)
            out[f"{direction}_{kind}_gbps"] = nbytes / max(best_s, 1e-9) / 1e9
        del host_buf
    return out


# ---------------------------------------------------------------- compute

def _choice_record(choice) -> dict:
    return {"param_dtype": choice.param_dtype, "compute_dtype": choice.compute_dtype, "reason": choice.reason}


def _device_compute(device: torch.device, dtypes: tuple, budget_s: float) -> dict:
    """One device's matmul rates at :data:`COMPUTE_SHAPES` (:func:`~infinity.precision.measure_rates`:
    a dtype far slower at its first look is not measured at the full shapes, and is listed in
    ``stopped_early``) and the ``auto`` answers they give."""
    t0 = time.perf_counter()
    rates = measure_rates(COMPUTE_SHAPES, dtypes, rows=COMPUTE_ROWS, budget_s=budget_s, device=device)
    rates["elapsed_s"] = time.perf_counter() - t0
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    rates["auto"] = {key: _choice_record(choose(device, COMPUTE_SHAPES, params_offloaded=offloaded,
                                                capability=capability, rates=rates))
                     for key, offloaded in (("params_offloaded", True), ("params_not_offloaded", False))}
    return rates


def measure_compute(quick: bool) -> dict:
    """The ``compute`` section (module doc): ``{"hardware": ..., "cpu": {...}, "cuda": {...}}``, each device's
    entry :func:`infinity.precision.measure_rates`'s (``gflops``, ``stopped_early``, ``rows``, ``shapes``)
    with the first look's (``screen``), its ``elapsed_s`` and ``auto`` (``params_offloaded`` /
    ``params_not_offloaded``: the stored and compute dtype ``auto`` takes, and why). ``cuda`` only where a
    CUDA device is."""
    budget_s = COMPUTE_BUDGET_S[bool(quick)]
    cuda = torch.cuda.is_available()
    out = {"hardware": hardware_record("cuda" if cuda else "cpu"),
           "cpu": _device_compute(torch.device("cpu"), ("fp32", "bf16"), budget_s)}
    if cuda:
        out["cuda"] = _device_compute(torch.device("cuda"), ("fp32", "bf16", "fp16"), budget_s)
    return out


def cpu_compute_dtype(compute: dict) -> str:
    """The dtype a CPU device computes in here (``auto``'s answer; the same offloaded or not)."""
    return compute["cpu"]["auto"]["params_offloaded"]["compute_dtype"]


def describe_compute(compute: dict) -> list[str]:
    """The ``compute`` section as text lines, one per device: its rates and ``auto``'s answer."""
    cpu = compute["hardware"]["cpu"]
    native = next((f for f in ("amx_bf16", "avx512_bf16") if cpu.get(f)), "no bf16 instructions")
    lines = [f"cpu {cpu['model']} ({native}, torch kernels {cpu['torch_cpu_capability']}, {cpu['threads']} threads)"]
    for name in ("cpu", "cuda"):
        if name not in compute:
            continue
        dev = compute[name]
        rates = ", ".join(f"{d} {g:.1f}" + (" (stopped early)" if d in dev["stopped_early"] else "")
                          for d, g in dev["gflops"].items())
        off, on = dev["auto"]["params_offloaded"], dev["auto"]["params_not_offloaded"]
        auto = (f"{on['compute_dtype']}" if off == on else
                f"{on['param_dtype']}; offloaded params stored {off['param_dtype']}, computed {off['compute_dtype']}")
        lines.append(f"{name} matmul GFLOP/s {rates}; auto -> {auto}")
    return lines


# ---------------------------------------------------------------- NVMe sweep

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


# ---------------------------------------------------------------- CPU Adam

_ADAM_HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
_ADAM_STATE_BYTES_PER_PARAM = 16  # fp32 param + grad + exp_avg + exp_avg_sq, each streamed once a step


def measure_cpu_adam(numel: int, repeats: int = 3, threads: int | None = None) -> dict:
    """CpuAdamW and torch.optim.AdamW(fused=True) on the same flat fp32 shard, same run."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(1e-3)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    adam = CpuAdamW(threads=threads)
    step = [0]

    def ours():
        step[0] += 1
        adam.step_(param, grad, exp_avg, exp_avg_sq, step=step[0], **_ADAM_HYPER)

    try:
        ours()  # warm-up: the thread pool starts, the kernels load
        ours_s = _best_s(ours, repeats)
    finally:
        adam.close()
    del exp_avg, exp_avg_sq  # the baseline makes its own moments; keep peak memory at one optimizer's
    formats = measure_adam_formats(param, grad, repeats, threads)
    weight = torch.nn.Parameter(param)
    weight.grad = grad
    lr, betas, eps, wd = (_ADAM_HYPER[k] for k in ("lr", "betas", "eps", "weight_decay"))
    baseline = torch.optim.AdamW([weight], lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True)
    baseline.step()  # warm-up: allocates exp_avg / exp_avg_sq
    torch_s = _best_s(baseline.step, repeats)
    state_bytes = numel * _ADAM_STATE_BYTES_PER_PARAM
    return {
        "numel": numel,
        "state_bytes_per_param": _ADAM_STATE_BYTES_PER_PARAM,
        "threads": adam.threads,
        "torch_threads": torch.get_num_threads(),
        "gbps": state_bytes / ours_s / 1e9,
        "params_per_s": numel / ours_s,
        "torch_fused_gbps": state_bytes / torch_s / 1e9,
        "torch_fused_params_per_s": numel / torch_s,
        "ratio": torch_s / ours_s,
        "baseline": "torch.optim.AdamW(fused=True), same shard, same run",
        "formats": formats,
    }


def format_states(master_fp32: torch.Tensor, master: str, moments: str) -> tuple:
    """``(param, exp_avg, exp_avg_sq, out)`` for :meth:`CpuAdamW.step_` with states stored as
    ``optimizer.master`` / ``optimizer.moments`` say: the master as given (a copy) or its int16
    remainder beside ``out``, its bf16 parameter; zeroed moments in their stored format (fp32, bf16, or
    int8's rows of blocks)."""
    numel = master_fp32.numel()
    out = torch.empty(numel, dtype=torch.bfloat16)
    if master == "remainder":
        param = torch.empty(numel, dtype=torch.int16)
        split_bf16_(master_fp32, out, param)
    else:
        param = master_fp32.clone()
    fmt = moment_format(moments)
    return param, *(torch.zeros(fmt.shape(numel), dtype=fmt.dtype) for _ in range(2)), out


def measure_adam_formats(param: torch.Tensor, grad: torch.Tensor, repeats: int, threads: int | None) -> dict:
    """CpuAdamW with each stored format the config accepts other than fp32 / fp32 (``optimizer.master``
    x ``optimizer.moments``, keyed ``master/moments``), the bf16 parameter written back as a bf16 run's
    update does: ``{format: {"params_per_s": ...}}``. The planner prices each format's update by it."""
    numel = param.numel()
    rows = {}
    adam = CpuAdamW(threads=threads)
    try:
        for master, moments in itertools.product(MASTER_FORMATS, MOMENT_FORMATS):
            if (master, moments) == ("fp32", "fp32"):
                continue
            p, m, v, out = format_states(param, master, moments)
            step = [0]

            def run():
                step[0] += 1
                adam.step_(p, grad, m, v, step=step[0], out=out, **_ADAM_HYPER)

            run()   # warm-up: the format's work buffers
            rows[f"{master}/{moments}"] = {"params_per_s": numel / _best_s(run, repeats)}
    finally:
        adam.close()
    return rows


# ---------------------------------------------------------------- collectives

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


# ---------------------------------------------------------------- the whole profile

def run_profile(options: ProfileOptions, progress: Callable[[str], None] | None = None) -> dict:
    """Measure every section; ``progress`` gets one line per step (None: silent)."""
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    parent = os.path.abspath(options.directory or os.getcwd())
    try:
        scratch = tempfile.mkdtemp(prefix=".infinity-profile-", dir=parent)
    except OSError as e:
        raise ProfileError(f"--dir {parent}: cannot make a scratch directory there ({e.strerror})") from None
    try:
        try:
            direct = probe_direct_io(scratch)
        except SwapIOError as e:
            raise ProfileError(f"--dir {parent}: {e}") from None
        base = options.base_bytes
        profile = {"machine": machine_info(parent, direct)}
        say("compute: matmul GFLOP/s per dtype at transformer shapes")
        profile["compute"] = measure_compute(options.quick)
        for line in describe_compute(profile["compute"]):
            say(f"  {line}")
        say(f"memcpy: {format_size(base)}")
        profile["memcpy"] = measure_memcpy(base, options.repeats)
        say("host<->device copies")
        profile["host_device"] = measure_host_device(base, options.repeats)
        try:
            profile["nvme"] = measure_nvme(scratch, base // 4, options.quick, direct, say)
        except OSError as e:  # a full or failing disk: name the directory, not a traceback
            raise ProfileError(f"--dir {parent}: NVMe sweep failed: {e}") from None
        say("compute beside the disk: a probe alone and while the engine reads and writes at once")
        try:
            dtype = cpu_compute_dtype(profile["compute"])
            profile["contention"] = measure_io_contention(scratch, IOConfig(**best_io(profile["nvme"]["sweep"], direct)),
                                                          base // 4, options.repeats, dtype,
                                                          profile["compute"]["cpu"]["gflops"][dtype])
        except OSError as e:
            raise ProfileError(f"--dir {parent}: the contention probe's I/O failed: {e}") from None
        say(f"cpu adam: {base // _ADAM_STATE_BYTES_PER_PARAM:,} params")
        profile["cpu_adam"] = measure_cpu_adam(base // _ADAM_STATE_BYTES_PER_PARAM, options.repeats)
        say(f"collectives: {options.nproc} gloo rank(s)")
        profile["collectives"] = measure_collectives(
            options.nproc, [base // 256, base // 64, base // 16], 3 if options.quick else 10, scratch)
        profile["io"] = best_io(profile["nvme"]["sweep"], direct)
        profile["settings"] = {"quick": options.quick, "bytes": base, "nproc": options.nproc,
                               "repeats": options.repeats, "elapsed_s": time.perf_counter() - started,
                               "lower_bound": options.lower_bound}
        if options.lower_bound:
            profile["settings"]["note"] = (
                f"--bytes {format_size(base)} is below {format_size(STEADY_BYTES)}: set-up cost and caches "
                "dominate such small points, so these figures are not steady-state rates (disk rates read "
                "low, CPU Adam and memcpy may read high from cache); profile without --bytes for a plan")
        return profile
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_profile(profile: dict, out_dir: str | os.PathLike) -> dict:
    """Write ``profile.json`` and the NVMe sweep plot into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    json_path, plot_path = out / PROFILE_JSON, out / PROFILE_PLOT
    with replaced(json_path, "w") as f:  # a reader never sees half a profile; no planted symlink is followed
        f.write(json.dumps(profile, indent=2) + "\n")
    _plot_nvme(profile["nvme"], plot_path)
    return {"json": str(json_path), "plot": str(plot_path)}


def _plot_nvme(nvme: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, kind in zip(axes, ("write", "read")):
        for threads, depth in sorted({(r["threads"], r["queue_depth"]) for r in nvme["sweep"]}):
            rows = [r for r in nvme["sweep"] if (r["threads"], r["queue_depth"]) == (threads, depth)]
            ax.plot([r["block_bytes"] / _MiB for r in rows], [r[f"{kind}_gbps"] for r in rows],
                    marker="o", label=f"engine t{threads} q{depth}")
        for threads in sorted({r["threads"] for r in nvme["raw"]["rows"]}):
            rows = [r for r in nvme["raw"]["rows"] if r["threads"] == threads]
            ax.plot([r["block_bytes"] / _MiB for r in rows], [r[f"{kind}_gbps"] for r in rows],
                    linestyle="--", marker="x", label=f"raw t{threads}")
        blocks_mib = sorted({r["block_bytes"] / _MiB for r in nvme["sweep"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(blocks_mib, [f"{b:g}" for b in blocks_mib])
        ax.set_ylim(bottom=0)  # ratios between lines read true only from a zero baseline
        ax.set_xlabel("block size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{kind} ({nvme['mode']})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"NVMe sweep: {format_size(nvme['bytes_per_point'])} per point, checksums on")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
