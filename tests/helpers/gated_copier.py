"""A stand-in for the store's :class:`~infinity.store.DeviceCopier` whose device->host copies land late.

Host->device copies go to a real copier. Device->host copies run on one worker, in order, each only
once :attr:`GatedCopier.gate` is open and ``delay_s`` has passed; :attr:`GatedCopier.log` records
``("landed", n)`` as each one's bytes arrive (tests append their own events to it), so a test can
check what waited for what.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
import time

import torch

from infinity.store.device_copy import DeviceCopier


class GatedCopier:
    def __init__(self, device="cpu", delay_s: float = 0.0, open_gate: bool = True):
        self.inner = DeviceCopier(torch.device(device))
        self.delay_s = delay_s
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()
        self.log: list = []
        self.submitted = 0
        self._lock = threading.Lock()
        self._jobs: collections.deque = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="gated-copier", daemon=True)
        self._thread.start()

    def to_device(self, dst, src, after=None) -> cf.Future:
        return self.inner.to_device(dst, src, after)

    def to_host(self, dst, src, after=None) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._wake:
            self.submitted += 1
            self._jobs.append((self.submitted, fut, dst, src))
            self._wake.notify_all()
        return fut

    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs)

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if not self._jobs:
                    return
                n, fut, dst, src = self._jobs[0]
            self.gate.wait()
            time.sleep(self.delay_s)
            try:
                dst.copy_(src)
            except BaseException as e:   # noqa: BLE001
                fut.set_exception(e)
            else:
                self.log.append(("landed", n))
                fut.set_result(None)
            with self._wake:
                self._jobs.popleft()

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self) -> None:
        self.gate.set()
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join()
        self.inner.close()
