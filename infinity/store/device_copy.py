"""Host <-> device copies that run off the caller's thread, one lane per direction.

Each direction (host->device, device->host) is a :class:`CopyLane`: one worker
thread, its own side stream on CUDA, and a bounded FIFO. Two lanes, because a
parameter copy to the device that the next gather waits for must not queue
behind gradient copies to the host (and the two directions use separate copy
engines, so they overlap); FIFO within a lane, so copies of one direction land
in the order they were asked for. The bound caps how many copies (and the
buffers they hold) one lane has queued: a caller blocks while its lane is full,
except the copier's own threads, whose completion callbacks may start the next
copy of a transfer and must never wait on themselves.

On CUDA the worker sets its device and makes its lane's stream its current
stream once (both are per thread: a thread that never sets its device works
on, and creates a context on, GPU 0), issues each copy non-blocking after the
event it must follow, and sleeps on a blocking event (``cudaEventBlockingSync``)
until the bytes have landed, instead of spinning a core CPU Adam needs. The
store's completions are a ``Future`` either way. On CPU (the "device" is plain
memory) the worker simply copies; that keeps the tier machinery genuinely
asynchronous there too, so races show up in CPU tests.

Trade-off of ``max_pending``: more lets a burst of requests queue without
blocking their callers, and holds that many more copies' buffers until they run.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading

import torch

__all__ = ["DeviceCopier", "CopyLane", "MAX_PENDING_COPIES"]

MAX_PENDING_COPIES = 64   # per lane: queued or running

_worker = threading.local()   # .lane is set on a copier worker thread


class CopyLane:
    """One direction's worker: copies ``src`` into ``dst`` in FIFO order, at most ``max_pending`` at once."""

    def __init__(self, name: str, device: torch.device, cuda: bool, max_pending: int = MAX_PENDING_COPIES):
        if max_pending < 1:
            raise ValueError(f"CopyLane {name}: max_pending must be >= 1, got {max_pending}")
        self.name, self.device, self.cuda, self.max_pending = name, device, cuda, max_pending
        self.stream = torch.cuda.Stream(device) if cuda else None   # CUDA-only: this lane's side stream
        self._cond = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._pending = 0          # queued + running
        self.peak_pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"infinity-copy-{name}", daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor, src: torch.Tensor, ready) -> cf.Future:
        """Queue a copy to run once ``ready`` has passed (CUDA: an event, waited on the lane's stream;
        CPU: None, or anything with ``synchronize()``, waited on the worker). Blocks while the lane is
        full, unless called from a copier thread."""
        fut: cf.Future = cf.Future()
        with self._cond:
            may_wait = getattr(_worker, "lane", None) is None
            while may_wait and self._pending >= self.max_pending and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError(f"device copier lane {self.name}: closed")
            self._jobs.append((fut, dst, src, ready))
            self._pending += 1
            self.peak_pending = max(self.peak_pending, self._pending)
            self._cond.notify_all()
        return fut

    def pending(self) -> int:
        with self._cond:
            return self._pending

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _work(self) -> None:
        _worker.lane = self
        if self.cuda:   # CUDA-only: device and current stream are per thread; set once for this one
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                fut, dst, src, ready = self._jobs.popleft()
            error, cancelled = None, not fut.set_running_or_notify_cancel()
            if not cancelled:
                try:
                    self._copy(dst, src, ready)
                except BaseException as e:   # noqa: BLE001 - the waiter gets it
                    error = e
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
            # completed outside the lock: the store's callbacks may submit the transfer's next copy
            if not cancelled and error is not None:
                fut.set_exception(error)
            elif not cancelled:
                fut.set_result(None)
            # the tensors go now, not when the next copy comes: a freed copy's memory must not linger
            del fut, dst, src, ready, error

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, ready) -> None:
        if not self.cuda:
            if ready is not None:
                ready.synchronize()
            dst.copy_(src)
            return
        # CUDA-only from here on. Without the wait the side stream could read ``src`` (or overwrite
        # ``dst``) before the kernels queued before the request have finished with them.
        self.stream.wait_event(ready)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record(self.stream)
        # The store marks the copy resident (and may free or reuse the source) when the future is
        # done, so it must not be done before the bytes have landed; a blocking event sleeps meanwhile.
        done.synchronize()


class DeviceCopier:
    """Copies between equally shaped tensors off the caller's thread: :meth:`to_device` and :meth:`to_host`
    return a Future[None] that is done when ``dst`` holds the bytes."""

    def __init__(self, device: torch.device, max_pending: int = MAX_PENDING_COPIES):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._to_device = CopyLane("to-device", self.device, self.cuda, max_pending)
        self._to_host = CopyLane("to-host", self.device, self.cuda, max_pending)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> cf.Future:
        """Copy into a device tensor (host->device; device->device too) on the to-device lane."""
        return self._to_device.submit(dst, src, self._ready(after))

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> cf.Future:
        """Copy into a host tensor (device->host) on the to-host lane."""
        return self._to_host.submit(dst, src, self._ready(after))

    def _ready(self, after):
        """What the copy must follow: ``after``, or on CUDA an event recorded now on the caller's stream."""
        if self.cuda and after is None:
            # CUDA-only: the side stream must not read ``src`` (or overwrite ``dst``) before the
            # kernels the caller already queued on its stream have finished with them.
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        return after

    def stats(self) -> dict:
        return {"peak_pending": {"to_device": self._to_device.peak_pending, "to_host": self._to_host.peak_pending}}

    def close(self) -> None:
        self._to_device.close()
        self._to_host.close()
