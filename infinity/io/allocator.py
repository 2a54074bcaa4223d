"""Where the next extent goes inside an extent file: a first-fit free list.

Pure bookkeeping, no I/O: :class:`ExtentFile` grows the file and tells the
allocator about the new space. Every offset and length is a multiple of 4096 so
that each extent can be read and written with O_DIRECT.
"""

from __future__ import annotations

import bisect

from infinity.io.buffers import ALIGN_BYTES

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Free space as sorted, non-adjacent ``(offset, length)`` runs; freed runs coalesce."""

    def __init__(self):
        self._offsets: list[int] = []  # run starts, sorted
        self._lengths: list[int] = []  # run lengths, same order

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a run of ``nbytes`` taken from the lowest free run that fits, or None."""
        self._check(0, nbytes)
        if nbytes == 0:
            raise AssertionError("empty extents take no space and are never allocated")
        for i, length in enumerate(self._lengths):
            if length >= nbytes:
                offset = self._offsets[i]
                if length == nbytes:
                    del self._offsets[i], self._lengths[i]
                else:
                    self._offsets[i] += nbytes
                    self._lengths[i] -= nbytes
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        """Give a run back (freed extent or new file space), merging with its neighbours."""
        self._check(offset, nbytes)
        if nbytes == 0:
            return
        i = bisect.bisect_left(self._offsets, offset)
        # Overlap with a free neighbour means a double free: the table and the list disagree.
        if i < len(self._offsets) and self._offsets[i] < offset + nbytes:
            raise AssertionError(f"extent [{offset}, {offset + nbytes}) overlaps free run at {self._offsets[i]}")
        if i > 0 and self._offsets[i - 1] + self._lengths[i - 1] > offset:
            raise AssertionError(f"extent [{offset}, {offset + nbytes}) overlaps free run at {self._offsets[i - 1]}")
        merge_left = i > 0 and self._offsets[i - 1] + self._lengths[i - 1] == offset
        merge_right = i < len(self._offsets) and offset + nbytes == self._offsets[i]
        if merge_left and merge_right:
            self._lengths[i - 1] += nbytes + self._lengths[i]
            del self._offsets[i], self._lengths[i]
        elif merge_left:
            self._lengths[i - 1] += nbytes
        elif merge_right:
            self._offsets[i] = offset
            self._lengths[i] += nbytes
        else:
            self._offsets.insert(i, offset)
            self._lengths.insert(i, nbytes)

    def free_bytes(self) -> int:
        return sum(self._lengths)

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._offsets, self._lengths))

    @staticmethod
    def _check(offset: int, nbytes: int) -> None:
        if offset % ALIGN_BYTES or nbytes % ALIGN_BYTES or nbytes < 0:
            raise AssertionError(f"extent offset {offset} and length {nbytes} must be multiples of {ALIGN_BYTES}")
