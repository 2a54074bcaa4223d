"""What the store answers without moving anything, and what it counts.

:class:`StoreInspector` is the part of :class:`~infinity.store.tensor_store.TensorStore`
that reports: whether a key is there, each copy's :class:`Residency`, a key's home,
layout and sizes; the counters of ``stats()`` (bytes moved, evictions, spills, bytes
set aside, scratch, the host pool's and the swap file's own); the per-window peak
bytes of each tier; and the time callers spent blocked in the store (``wait`` books
it, per thread and in all). Like the other parts it is a base class of the store,
not a separate object: it reads the store's bookkeeping under the store's one lock.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

from infinity.store.residency import Residency, Tier

__all__ = ["StoreInspector"]


class StoreInspector:
    """Questions and counters for the store that inherits it (see the module docstring)."""

    def __contains__(self, key: str) -> bool:
        with self._cond:
            return key in self._keys

    def keys(self) -> list[str]:
        with self._cond:
            return sorted(self._keys)

    def residency(self, key: str) -> dict[Tier, Residency]:
        with self._cond:
            rec = self._lookup(key, "residency")
            return {t: rec.copies[t].state for t in Tier}

    def is_dirty(self, key: str) -> bool:
        with self._cond:
            return self._lookup(key, "is_dirty").dirty

    def home(self, key: str) -> Tier:
        with self._cond:
            return self._lookup(key, "home").home

    def layout(self, key: str) -> tuple:
        """``(shape, dtype)`` of the key's tensor."""
        with self._cond:
            rec = self._lookup(key, "layout")
            return rec.shape, rec.dtype

    def working_bytes(self, key: str, tier: Tier | str) -> int:
        """What a working copy of ``key`` in ``tier`` holds against the tier's budget (0 in its home tier)."""
        tier = Tier.parse(tier)
        with self._cond:
            rec = self._lookup(key, "working_bytes")
            return 0 if tier is rec.home else self._cost(rec, tier)

    def nbytes(self, key: str) -> int:
        """The key's tensor size in bytes (what each of its copies holds)."""
        with self._cond:
            return self._lookup(key, "nbytes").nbytes

    def stats(self) -> dict:
        """Counters, JSON-ready. Tier bytes are reserved bytes (host: 4096-rounded pool buffers)."""
        with self._cond:
            out = {
                "keys": len(self._keys),
                "budget_bytes": {t.value: a.budget_bytes for t, a in self._accounts.items()},
                "tier_bytes": {t.value: a.in_use_bytes for t, a in self._accounts.items()},
                "peak_bytes": {t.value: a.peak_bytes for t, a in self._accounts.items()},
                "moved_bytes": dict(sorted(self._moved_bytes.items())),
                "evictions": {t.value: self._evictions[t] for t in (Tier.DEVICE, Tier.HOST)},
                "explicit_evictions": {t.value: self._explicit_evictions[t] for t in (Tier.DEVICE, Tier.HOST)},
                "spills": {t.value: self._spills[t] for t in (Tier.DEVICE, Tier.HOST)},
                "set_aside_bytes": {t.value: self._accounts[t].set_aside_bytes for t in (Tier.DEVICE, Tier.HOST)},
                "scratch_bytes": self._scratch_bytes, "scratch_peak_bytes": self._scratch_peak_bytes,
                "wait_s": self._wait_s,
            }
            extents = self._extents
        out["host_pool"] = self.pool.stats()
        out["io"] = extents.stats() if extents is not None else None
        return out

    def take_peak_bytes(self) -> dict:
        """Per tier, the most bytes held since the last call (a window: one training step); the next
        window starts from what is held now. ``host`` is the host pool's buffers, in use and cached
        (what the tier costs in RAM, at most its budget); ``device`` and ``nvme`` are reserved bytes (a CPU
        device: or its pool's buffers, in use and cached, where more)."""
        with self._cond:
            out = {t.value: a.take_window_peak() for t, a in self._accounts.items()}
        out[Tier.HOST.value] = self.pool.take_window_peak()
        if self.device_pool is not None:
            out[Tier.DEVICE.value] = max(out[Tier.DEVICE.value], self.device_pool.take_window_peak())
        return out

    def _add_wait(self, seconds: float) -> None:
        """Book ``seconds`` blocked on this thread (called under ``_cond``)."""
        self._wait_s += seconds
        self._thread_waits.s = getattr(self._thread_waits, "s", 0.0) + seconds

    def thread_wait_s(self) -> float:
        """Seconds the calling thread has spent blocked in the store since it was built (all threads'
        sum is ``stats()["wait_s"]``): lets a caller attribute waits to what its own thread was doing."""
        return getattr(self._thread_waits, "s", 0.0)

    def wait(self, fut: cf.Future):
        """``fut.result()``, with the time spent blocked counted in ``stats()["wait_s"]``."""
        if fut.done():
            return fut.result()
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            with self._cond:
                self._add_wait(time.perf_counter() - t0)
