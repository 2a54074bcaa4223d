"""The profile's host memory figures: ``memcpy`` (copies into touched memory and into fresh memory) and
``host_device`` (host-to-device and device-to-host copies from pinned and pageable memory, CUDA only)."""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

from infinity.profile.options import _MiB
from infinity.profile.timing import _best_s

__all__ = ["measure_memcpy", "measure_host_device", "FRESH_BYTES"]

FRESH_BYTES = 64 * _MiB   # a fresh-memory copy point: above glibc's largest mmap threshold (32 MiB)


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

