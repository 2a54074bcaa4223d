"""A host registrar for CPU tests: records what would be page-locked instead of asking a driver."""

from __future__ import annotations

import threading


class RecordingRegistrar:
    """Implements ``infinity.store.pinned_host.HostRegistrar``: ``locked`` maps each registered
    address to its bytes; ``calls`` lists ("register", ptr, nbytes) / ("unregister", ptr) in order.
    ``fail_after`` registrations succeed, then register raises (a driver out of lockable memory)."""

    def __init__(self, fail_after: int | None = None):
        self.locked: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.fail_after = fail_after
        self._lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            if self.fail_after is not None and sum(c[0] == "register" for c in self.calls) >= self.fail_after:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (fake: out of lockable memory)")
            assert ptr not in self.locked, f"{ptr:#x} registered twice"
            self.locked[ptr] = nbytes
            self.calls.append(("register", ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        with self._lock:
            assert ptr in self.locked, f"{ptr:#x} unregistered but never registered"
            del self.locked[ptr]
            self.calls.append(("unregister", ptr))

    @property
    def locked_bytes(self) -> int:
        with self._lock:
            return sum(self.locked.values())
