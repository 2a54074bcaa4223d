"""Page-locked host memory that costs exactly what was asked for, and goes back when freed.

``torch.empty(..., pin_memory=True)`` takes its memory from torch's caching host
allocator, which rounds every request up to a power of two (a 64 MiB + 4 KiB
shard pins 128 MiB) and keeps freed blocks pinned for the life of the process
(``CachingHostAllocator.h``: ``roundSize`` / the free list), so a pool that
frees a buffer lowers neither the pinned bytes nor RSS, and the store's host
accounting under-reports by up to 2x. Here each buffer is an anonymous ``mmap``
of the request rounded up to whole pages, page-locked by a :class:`HostRegistrar`
(on CUDA ``cudaHostRegister``, through ``torch.cuda.cudart()``, as torch's own
``torch/cuda/_pin_memory_utils.py`` does) and unregistered when the owner frees
it; the mapping itself is unmapped when the last tensor viewing it is gone, so
a view someone still holds stays valid (just no longer page-locked).

Trade-off: registering pins page by page (slower than a cached block, so the
host pool keeps buffers it will hand out again), but what is pinned is what the
budget counts, and trimming the pool really returns it.
"""

from __future__ import annotations

import mmap
import threading
from typing import Protocol

import torch

__all__ = ["HostRegistrar", "CudaHostRegistrar", "PinnedHostMemory", "PAGE_BYTES", "round_to_pages"]

# Whole pages: what page-locking works in. At least 4096, so a buffer is also O_DIRECT-aligned.
PAGE_BYTES = max(mmap.PAGESIZE, 4096)

_CUDA_HOST_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: page-locked for every CUDA context
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


def round_to_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


class HostRegistrar(Protocol):
    """Page-locks and unlocks ranges of host memory (CUDA: the driver; tests: a recorder)."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``[ptr, ptr + nbytes)``; raise with the cause if the driver refuses."""

    def unregister(self, ptr: int) -> None:
        """Undo :meth:`register` of the range starting at ``ptr``."""


class CudaHostRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` on ``device``'s context.

    The calls run with ``device`` current (``torch.cuda.device``, which restores the previous device
    without creating a context on it): from a thread that never set its device, the runtime would
    otherwise create a context on GPU 0 for them (~0.5 GiB of another rank's GPU).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def register(self, ptr: int, nbytes: int) -> None:   # CUDA-only
        with torch.cuda.device(self.device):
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            why = ("part of the range is registered already (memory unmapped without cudaHostUnregister)"
                   if code == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED else
                   "the driver could not page-lock it (host RAM exhausted by other pinned memory?); lower "
                   "tiers.host_bytes")
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed with cudaError {code}: {why}")

    def unregister(self, ptr: int) -> None:   # CUDA-only
        with torch.cuda.device(self.device):
            code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if code != 0:
            raise RuntimeError(f"cudaHostUnregister at {ptr:#x} failed with cudaError {code}")


class PinnedHostMemory:
    """Allocates page-aligned uint8 host tensors of whole pages and page-locks them with ``registrar``.

    ``pinned_bytes`` is what is registered now (each buffer's size rounded up to pages);
    ``peak_pinned_bytes`` the most ever. Thread-safe.
    """

    def __init__(self, registrar: HostRegistrar):
        self.registrar = registrar
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}   # data_ptr -> registered bytes
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        self.registrations = 0
        self.unregistrations = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A page-locked uint8 tensor of ``round_to_pages(nbytes)`` bytes, page-aligned, zero-filled
        (fresh anonymous pages); give it back with :meth:`free`."""
        size = round_to_pages(nbytes)
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)   # anonymous, page-aligned, zero-filled
        if hasattr(mmap, "MADV_DONTFORK"):
            # A forked child (a DataLoader worker) would make these pages copy-on-write, and the parent's
            # next write would move it to a fresh page while the GPU's DMA still targets the old one.
            mapping.madvise(mmap.MADV_DONTFORK)
        # The tensor keeps the mapping alive (frombuffer holds a reference); unmapped with the last view.
        buf = torch.frombuffer(mapping, dtype=torch.uint8)
        del mapping
        ptr = buf.data_ptr()
        self.registrar.register(ptr, size)
        with self._lock:
            self._registered[ptr] = size
            self.pinned_bytes += size
            self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)
            self.registrations += 1
        return buf

    def free(self, buf: torch.Tensor) -> None:
        """Unregister a buffer from :meth:`allocate`. The caller drops its reference afterwards and must
        have no copy in flight from or into it (the DMA would race the unlock)."""
        if buf.numel() == 0:
            return
        ptr = buf.data_ptr()
        with self._lock:
            if ptr not in self._registered:
                raise AssertionError(f"PinnedHostMemory.free: {ptr:#x} was not allocated here (or freed twice)")
        self.registrar.unregister(ptr)   # if the driver refuses, the bytes stay counted: they stay locked
        with self._lock:
            self.pinned_bytes -= self._registered.pop(ptr)
            self.unregistrations += 1

    def free_all(self) -> int:
        """Unregister every buffer still registered (its owner is shutting down; no copy may be in
        flight). Returns the bytes unlocked."""
        with self._lock:
            ptrs = list(self._registered)
        freed_bytes = 0
        for ptr in ptrs:
            self.registrar.unregister(ptr)
            with self._lock:
                size = self._registered.pop(ptr)
                self.pinned_bytes -= size
                self.unregistrations += 1
            freed_bytes += size
        return freed_bytes

    def stats(self) -> dict:
        with self._lock:
            return {"pinned_bytes": self.pinned_bytes, "peak_pinned_bytes": self.peak_pinned_bytes,
                    "registrations": self.registrations, "unregistrations": self.unregistrations}
