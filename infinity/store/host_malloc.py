"""Freed host memory goes back to the OS, so a host budget bounds RSS (glibc's malloc).

glibc serves a large allocation from ``mmap`` (returned to the OS on free)
only above its *mmap threshold*, and by default raises that threshold to the
size of each large block freed, up to 32 MiB. A training step frees and
reallocates many blocks of a few MiB (activations, gradients, staging), from
several threads, each with its own arena, so after a few steps those blocks
live in the arenas' heaps and stay there: measured on GPT-2 small with a 1 GiB
host budget, 1.6 GiB of RSS belonged to no owner and the peak grew for the
first steps (2.4, 3.0, 3.6, 3.8 GiB). A fixed threshold stops the raising:
blocks above it are mapped and unmapped every time (page faults: measured a
few % of step time at 4 MiB, ~20% at 128 KiB), blocks below it stay in the heap.

A block above the threshold is fresh memory each time it is made: its first writes fault and zero
its pages (measured here: a copy into a fresh 64 MiB block at ~2 GB/s against ~8.5 GB/s into one
already touched), which :mod:`infinity.plan.cost` prices from the profile's ``memcpy.fresh_gbps`` -
unless :mod:`infinity.store.host_cache`, on beside a fixed threshold, keeps freed blocks for reuse
(torch's tensors only; up to its cap).

Process-wide, like any ``mallopt``; a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["fix_mmap_threshold", "release_free_heap", "mmap_threshold", "AUTO_MMAP_THRESHOLD", "GLIBC_MAX_MMAP_THRESHOLD"]

_M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter number (malloc.h)
AUTO_MMAP_THRESHOLD = 4 * 2**20        # tiers.malloc_mmap_threshold: auto, with anything offloaded (module doc)
GLIBC_MAX_MMAP_THRESHOLD = 32 * 2**20  # where glibc's own raising stops (64-bit DEFAULT_MMAP_THRESHOLD_MAX)


def mmap_threshold(setting, offloaded: bool) -> int | None:
    """The threshold ``tiers.malloc_mmap_threshold`` = ``setting`` fixes (bytes), or None where glibc keeps
    raising its own (``off``, or ``auto`` with nothing offloaded): then, after a few steps, a block is
    fresh memory only above :data:`GLIBC_MAX_MMAP_THRESHOLD`."""
    if setting == "off" or (setting == "auto" and not offloaded):
        return None
    return AUTO_MMAP_THRESHOLD if setting == "auto" else int(setting)


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def fix_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (its maximum is 32 MiB on 64-bit). Returns whether it
    was set (False: not glibc, or mallopt refused the value)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(int(nbytes))))


def release_free_heap() -> bool:
    """Give the free pages of glibc's heaps back to the OS (``malloc_trim(0)``). Work that allocates and
    frees many blocks below the mmap threshold before training starts (``auto``'s quick profile and compute
    timing: 0.4 GiB of free heap at GPT-2 2.7B) would otherwise stay in RSS for the whole run,
    counted in the engine's baseline. Returns whether anything was released (False: none, or not glibc)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))
