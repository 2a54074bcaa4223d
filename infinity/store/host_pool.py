"""Reusable host buffers under one byte budget.

Allocating page-locked memory costs far more than copying into it (CUDA pins
page by page), and a training step asks for the same shard sizes again and
again, so freed buffers are kept and handed out again to a request of the same
rounded size. The pool never holds more than ``capacity_bytes`` in total
(buffers in use plus cached free ones): when a new size does not fit, cached
buffers are freed, oldest first. And at the end of each window (a training
step, :meth:`end_window`) the cache is cut down: a pool that only gave memory
back under pressure would keep its whole budget as RSS for good once it had
filled (say while the first step caches what it reads, or as shards of several
sizes pass through), though a step reuses far less. Unpinned buffers are all
freed then (on the next step's first use of a size, the read into it faults its
pages in, on an I/O thread); pinned ones, costly to make, are kept up to the
most the window had in use at once.

Every buffer is 4096-aligned so it can be the target of an O_DIRECT read, and
its size is rounded up to 4096; the rounded size is what counts against the
budget. Unpinned buffers come from ``infinity.io.aligned_empty`` (up to 4095
bytes of uncounted slack each). Pinned ones, when the pool has a
:class:`~infinity.store.pinned_host.HostRegistrar` (the store gives it one on
CUDA), are whole pages mapped and page-locked by
:class:`~infinity.store.pinned_host.PinnedHostMemory`, not torch's caching host
allocator: what is pinned is exactly what the budget counts, and a buffer the
pool frees is unlocked and returned to the OS at once.
"""

from __future__ import annotations

import threading

import torch

from infinity.io import aligned_empty
from infinity.store.pinned_host import PAGE_BYTES, HostRegistrar, PinnedHostMemory
from infinity.store.residency import StoreError

__all__ = ["HostBufferPool", "ALIGN_BYTES"]

ALIGN_BYTES = 4096


class HostBufferPool:
    """Aligned uint8 host buffers, reused by size, within ``capacity_bytes``; page-locked through
    ``registrar`` when one is given (None: pageable)."""

    def __init__(self, capacity_bytes: int, registrar: HostRegistrar | None = None):
        if capacity_bytes < 0:
            raise ValueError(f"HostBufferPool: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pinned = PinnedHostMemory(registrar) if registrar is not None else None
        self.pin = self.pinned is not None
        self._granule_bytes = PAGE_BYTES if self.pin else ALIGN_BYTES   # page-locking works in whole pages
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []   # cached buffers, oldest release first
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.peak_allocated_bytes = 0
        self.window_peak_bytes = 0            # the most allocated since the last take_window_peak()
        self.window_in_use_peak = 0           # the most in use at once since the last end_window()
        self.hits = 0                         # acquires served from the cache
        self.misses = 0                       # acquires that allocated

    def buffer_bytes(self, nbytes: int) -> int:
        """What a request of ``nbytes`` costs against the budget (rounded up to 4096; pinned: to pages)."""
        return -(-nbytes // self._granule_bytes) * self._granule_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``buffer_bytes(nbytes)`` bytes, 4096-aligned; contents undefined."""
        size = self.buffer_bytes(nbytes)
        dropped: list[torch.Tensor] = []
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):   # newest first: likeliest still in cache
                if self._free[i].numel() == size:
                    buf = self._free.pop(i)
                    self.cached_bytes -= size
                    self.in_use_bytes += size
                    self.window_in_use_peak = max(self.window_in_use_peak, self.in_use_bytes)
                    self.hits += 1
                    return buf
            if self.in_use_bytes + size > self.capacity_bytes:
                raise StoreError(
                    f"host buffer pool: cannot hand out {size} bytes: {self.in_use_bytes} of "
                    f"{self.capacity_bytes} bytes are in use")
            while self._free and self.in_use_bytes + self.cached_bytes + size > self.capacity_bytes:
                dropped.append(self._free.pop(0))
                self.cached_bytes -= dropped[-1].numel()
            self.in_use_bytes += size
            self.window_in_use_peak = max(self.window_in_use_peak, self.in_use_bytes)
            self.misses += 1
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.in_use_bytes + self.cached_bytes)
            self.window_peak_bytes = max(self.window_peak_bytes, self.in_use_bytes + self.cached_bytes)
        try:
            # Free and allocate outside the lock: (un)pinning a large buffer can take milliseconds.
            self._free_buffers(dropped)
            return self.pinned.allocate(size) if self.pinned is not None else aligned_empty(size)
        except BaseException:
            with self._lock:
                self.in_use_bytes -= size
            raise

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer from :meth:`acquire` back; the caller must not touch it afterwards."""
        size = buf.numel()
        with self._lock:
            assert size <= self.in_use_bytes, (size, self.in_use_bytes)
            self.in_use_bytes -= size
            self._free.append(buf)
            self.cached_bytes += size

    def trim(self) -> int:
        """Free every cached buffer (pinned: unlocked and unmapped); returns the bytes freed."""
        with self._lock:
            freed_bytes, dropped = self.cached_bytes, self._free
            self._free = []
            self.cached_bytes = 0
        self._free_buffers(dropped)
        return freed_bytes

    def close(self) -> int:
        """Free every buffer, cached or still handed out (pinned: unlocked; a buffer still referenced
        stays valid memory, just pageable). For an owner shutting down with no copy in flight, e.g.
        after an error left buffers unreleased. Returns the bytes freed."""
        freed_bytes = self.trim()
        if self.pinned is not None:
            freed_bytes += self.pinned.free_all()
        with self._lock:
            self.in_use_bytes = 0
        return freed_bytes

    def end_window(self) -> int:
        """End a window (module doc): free cached buffers, oldest first, until the pool holds no more
        than what is in use now (unpinned) or the most it had in use at once during the window
        (pinned); returns the bytes freed."""
        with self._lock:
            keep = self.window_in_use_peak if self.pin else self.in_use_bytes
            freed_bytes, dropped = 0, []
            while self._free and self.in_use_bytes + self.cached_bytes > keep:
                dropped.append(self._free.pop(0))
                self.cached_bytes -= dropped[-1].numel()
                freed_bytes += dropped[-1].numel()
            self.window_in_use_peak = self.in_use_bytes
        self._free_buffers(dropped)
        return freed_bytes

    def _free_buffers(self, dropped: list) -> None:
        """Outside the lock: unpin buffers taken off the cache (unpinned ones just lose their last
        reference). Every one is idle: a buffer reaches the cache only once its copies have landed."""
        if self.pinned is not None:
            for buf in dropped:
                self.pinned.free(buf)
        dropped.clear()

    def take_window_peak(self) -> int:
        """The most bytes allocated (in use + cached: what the pool costs in RAM) since the last call;
        the next window starts from what is allocated now."""
        with self._lock:
            now = self.in_use_bytes + self.cached_bytes
            peak, self.window_peak_bytes = max(self.window_peak_bytes, now), now
        return peak

    def stats(self) -> dict:
        """Counters, JSON-ready; ``pinned_bytes``: page-locked now (0 when unpinned), which equals
        ``in_use_bytes + cached_bytes`` for a pinned pool."""
        pinned = self.pinned.stats() if self.pinned is not None else {
            "pinned_bytes": 0, "peak_pinned_bytes": 0, "registrations": 0, "unregistrations": 0}
        with self._lock:
            return {"capacity_bytes": self.capacity_bytes, "in_use_bytes": self.in_use_bytes,
                    "cached_bytes": self.cached_bytes, "peak_allocated_bytes": self.peak_allocated_bytes,
                    "hits": self.hits, "misses": self.misses, "pinned": self.pin, **pinned}
