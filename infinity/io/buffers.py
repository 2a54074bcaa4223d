"""Host buffers that O_DIRECT accepts, and raw views of tensor memory.

O_DIRECT needs the buffer address, the file offset and the length all aligned to
the logical block size of the device; 4096 covers every disk we expect.
``torch.empty`` only promises 64-byte alignment, so :func:`aligned_empty`
over-allocates and slices.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["ALIGN_BYTES", "aligned_empty", "is_aligned", "round_up", "tensor_bytes_view"]

ALIGN_BYTES = 4096


def round_up(nbytes: int, multiple: int = ALIGN_BYTES) -> int:
    return -(-nbytes // multiple) * multiple


def is_aligned(value: int, multiple: int = ALIGN_BYTES) -> bool:
    return value % multiple == 0


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte is 4096-aligned.

    The returned tensor is a slice of a slightly larger allocation (at most 4095 bytes
    more) and keeps that allocation alive. Never page-locked: pinned host buffers are
    the store's (``infinity.store.pinned_host``), which pins exactly what it counts.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be an int >= 0, got {nbytes!r}")
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN_BYTES
    return raw[start:start + nbytes]


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a contiguous CPU tensor's storage (any dtype).

    The view does not keep the tensor alive: the caller holds a reference for as long
    as the view is used.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")
