"""Per-step engine statistics: time in forward / backward / step / comm waits, bytes per collective.

Host times (``*_s``) say how long the Python side of each phase took. On CUDA
those are the times to *queue* the work, not to run it, so the phases are also
timed on the device (``*_device_s``): a CUDA timing event is recorded on the
current stream where each phase starts and stops, and the pairs are read at the
step's end. Reading them waits once per step for the step's kernels to finish
(a loop that reads the loss, or offloaded training, waits there anyway).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from infinity.comm.collectives import CommCounters

__all__ = ["EngineStats", "DeviceTimer"]

PHASES = ("forward", "backward", "step")


class DeviceTimer:
    """Device-side time of named phases, from pairs of timing events on the current stream.

    ``make_event()`` returns an event with ``record()`` (on the calling thread's current stream),
    ``synchronize()`` and ``elapsed_time(end)`` (milliseconds), as ``torch.cuda.Event(enable_timing=True)``
    does. Backward's phase may stop on autograd's device thread, whose current stream is the one
    backward's kernels run on.
    """

    def __init__(self, device: torch.device, make_event: Callable | None = None):
        self.device = device
        # CUDA-only; blocking: the step's end sleeps on the last event instead of spinning a core
        self._make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True, blocking=True))
        self._open: dict = {}                       # phase -> start event
        self._pairs: list = []                      # (phase, start, stop) this step

    def _record(self):
        event = self._make_event()
        event.record()   # on this thread's current stream: the one the phase's kernels are queued on
        return event

    def start(self, what: str) -> None:
        self._open[what] = self._record()

    def stop(self, what: str) -> None:
        start = self._open.pop(what, None)
        if start is not None:
            self._pairs.append((what, start, self._record()))

    def take(self) -> dict:
        """Seconds per phase since the last call (``<phase>_device_s``); waits for the last stop event."""
        pairs, self._pairs = self._pairs, []
        out = {f"{p}_device_s": 0.0 for p in PHASES}
        if pairs:
            pairs[-1][2].synchronize()   # events complete in stream order: the last one covers the rest
        for what, start, stop in pairs:
            stop.synchronize()   # a pair on another stream (recorded from another thread) may trail
            out[f"{what}_device_s"] = out.get(f"{what}_device_s", 0.0) + start.elapsed_time(stop) / 1e3
        return out

    def reset(self) -> None:
        self._open.clear()
        self._pairs = []


class EngineStats:
    """Accumulates over the current step; :attr:`last_step` is the snapshot of the last finished one.

    ``last_step`` keys: ``forward_s``, ``backward_s``, ``step_s`` (host time), on CUDA also
    ``forward_device_s``, ``backward_device_s``, ``step_device_s`` (device time, module doc),
    ``comm_wait_s`` (host) and under NCCL ``comm_wait_device_s`` (the compute stream's wait, see
    :mod:`infinity.comm.collectives`), ``collectives`` (calls / elements / bytes / sent_bytes / received_bytes /
    intra_node_bytes / cross_node_bytes per kind; see :mod:`infinity.comm.collectives`),
    ``steps`` (optimizer steps so far, skipped ones included); the engine adds
    ``live_peak_bytes`` (stage 3: high-water mark of gathered parameter bytes, what
    ``prefetch.max_live_bytes`` caps) and ``live_cap_releases`` (units released to stay under it).
    ``device_timer``: a :class:`DeviceTimer` (default: one on a CUDA ``device``, none elsewhere).
    """

    def __init__(self, counters: CommCounters, device: torch.device | None = None,
                 device_timer: DeviceTimer | None = None):
        self.counters = counters
        if device_timer is None and device is not None and device.type == "cuda" and torch.cuda.is_available():
            device_timer = DeviceTimer(device)
        self.device_timer = device_timer
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.step_s = 0.0
        self.steps = 0
        self.last_step: dict = {}
        self._marks: dict = {}

    def start(self, what: str) -> None:
        self._marks[what] = time.perf_counter()
        if self.device_timer is not None:
            self.device_timer.start(what)

    def stop(self, what: str) -> None:
        t0 = self._marks.pop(what, None)
        if t0 is not None:
            setattr(self, what + "_s", getattr(self, what + "_s") + time.perf_counter() - t0)
            if self.device_timer is not None:
                self.device_timer.stop(what)

    def end_step(self) -> None:
        self.steps += 1
        snap = self.counters.snapshot()
        self.last_step = {
            "forward_s": self.forward_s, "backward_s": self.backward_s, "step_s": self.step_s,
            "comm_wait_s": snap.pop("wait_s"), "collectives": snap, "steps": self.steps,
        }
        wait_device_s = snap.pop("wait_device_s")
        if wait_device_s is not None:   # NCCL: how long the compute stream waited for communication
            self.last_step["comm_wait_device_s"] = wait_device_s
        if self.device_timer is not None:
            self.last_step.update(self.device_timer.take())
        self.reset()

    def reset(self) -> None:
        self.forward_s = self.backward_s = self.step_s = 0.0
        self.counters.reset()
        if self.device_timer is not None:
            self.device_timer.reset()
