"""Memory for stage 3's full parameter buffers, reused from one gather to the next on a CPU device.

A unit's full buffer is filled at each gather and emptied at each release: every unit twice a step.
Freed and allocated again, each buffer is new memory from the kernel, which faults in and zeroes
every 4 KiB page of it: at 2.7B that is 10.6 GB a step, and on two cores about as much CPU time as
the bytes' own copies (measured with ``perf``: page faults and page clearing were ~20% of the
step's CPU time). A released buffer is kept instead and handed to the next gather of the same size.

The storage object itself is never replaced (the parameters and autograd's saved tensors are views
of it): its memory is swapped in and out (``UntypedStorage._swap_data_ptr_``, what
``torch.utils.swap_tensors`` uses), as ``resize_`` would reallocate it in place.

What is kept is bounded by use: a released buffer stays only while the bytes handed out plus those
kept do not exceed the most ever handed out at once, so the pool never holds more memory than the
gathers did at their peak without it (``prefetch.max_live_bytes`` caps that peak).

On CUDA torch's caching allocator already reuses device memory: there ``reuse=False`` and fill /
empty are ``resize_``.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["StoragePool"]


class StoragePool:
    """Fills and empties storages (``fill`` / ``empty``), keeping emptied memory for the next fill of
    the same size (``reuse``; module doc). Thread-safe."""

    def __init__(self, reuse: bool):
        self.reuse = reuse
        self._lock = threading.Lock()
        self._idle: list[torch.UntypedStorage] = []   # kept memory, oldest first
        self._lent: dict[int, int] = {}   # data_ptr -> nbytes of the memory handed out by fill
        self.lent_bytes = 0
        self.idle_bytes = 0
        self.peak_lent_bytes = 0
        self._window_peak = 0   # the most held (lent + idle) since the last take_window_peak()
        self.hits = 0
        self.misses = 0

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory (contents undefined)."""
        if storage.nbytes() != 0:
            raise ValueError(f"StoragePool.fill: the storage holds {storage.nbytes()} bytes; it must be empty")
        if not self.reuse:
            storage.resize_(nbytes)
            return
        dropped = []
        with self._lock:
            i = next((i for i in range(len(self._idle) - 1, -1, -1) if self._idle[i].nbytes() == nbytes), None)
            block = None if i is None else self._idle.pop(i)   # the newest of its size: likeliest in cache
            if block is not None:
                self.idle_bytes -= nbytes
                self.hits += 1
            else:
                self.misses += 1
                # kept memory of other sizes goes first where it would take the pool past its peak
                peak = max(self.peak_lent_bytes, self.lent_bytes + nbytes)
                while self._idle and self.lent_bytes + nbytes + self.idle_bytes > peak:
                    dropped.append(self._idle.pop(0))
                    self.idle_bytes -= dropped[-1].nbytes()
        del dropped   # freed outside the lock
        if block is None:
            block = torch.UntypedStorage(nbytes, device=storage.device)
        storage._swap_data_ptr_(block)   # storage gets the memory, block the empty one
        with self._lock:
            self._lent[storage.data_ptr()] = nbytes
            self.lent_bytes += nbytes
            self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
            self._window_peak = max(self._window_peak, self.lent_bytes + self.idle_bytes)

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory away (it holds 0 bytes after); memory from :meth:`fill` is kept for reuse
        while within the peak, any other is freed."""
        if storage.nbytes() == 0:
            return
        with self._lock:
            nbytes = self._lent.pop(storage.data_ptr(), None) if self.reuse else None
        if nbytes is None:
            storage.resize_(0)
            return
        block = torch.UntypedStorage(0, device=storage.device)
        block._swap_data_ptr_(storage)   # block gets the memory, storage the empty one
        with self._lock:
            self.lent_bytes -= nbytes
            if self.lent_bytes + self.idle_bytes + nbytes <= self.peak_lent_bytes:
                self._idle.append(block)
                self.idle_bytes += nbytes
                block = None
        del block

    def trim(self) -> int:
        """Free the kept memory; returns its bytes."""
        with self._lock:
            freed, self._idle, self.idle_bytes = self.idle_bytes, [], 0
        return freed

    def take_window_peak(self) -> int:
        """The most memory held (lent and kept) since the last call (a window: one training step); the next
        window starts from what is held now."""
        with self._lock:
            now = self.lent_bytes + self.idle_bytes
            peak, self._window_peak = max(self._window_peak, now), now
        return peak

    def stats(self) -> dict:
        with self._lock:
            return {"reuse": self.reuse, "lent_bytes": self.lent_bytes, "idle_bytes": self.idle_bytes,
                    "peak_lent_bytes": self.peak_lent_bytes, "hits": self.hits, "misses": self.misses}
