"""Per-step engine statistics: time in forward / backward / step / comm waits, bytes per collective.

Host times (``*_s``) say how long the Python side of each phase took. On CUDA
those are the times to *queue* the work, not to run it, so the phases are also
timed on the device (``*_device_s``): a CUDA timing event is recorded on the
current stream where each phase starts and stops, and the pairs are read at the
step's end. Reading them waits once per step for the step's kernels to finish
(a loop that reads the loss, or offloaded training, waits there anyway).

Every second of a phase is attributed (``last_step["attribution"]``, :class:`StepAttribution`):
the engine runs each of its hook verbs and ``step()`` inside :meth:`EngineStats.engine_time`,
so a phase's wall time splits into time outside the engine (the model's own forward and
backward ops: ``compute_s``) and time inside it; inside, the waits the running thread booked
on collectives (``comm_s``) and on the tiered store (``io_wait_s``: its transfers, and room in it
another thread holds) are read from per-thread clocks, the step's wait for the Adam pipeline is split
into ``adam_s`` and the pipeline's own I/O waits (``io_wait_s``), and what is left is
``unattributed_s`` (hook bookkeeping, gradient copies into flat buffers, casts, the clip norm). The five terms sum to the phase's wall time
by construction; each is non-negative. On CUDA these are host times (time to queue the work).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable

import torch

from infinity.comm.collectives import CommCounters

__all__ = ["EngineStats", "DeviceTimer", "StepAttribution", "TERMS", "engine_verb"]

PHASES = ("forward", "backward", "step")
# the attributed terms of a phase, in the order they are printed; they sum to its wall time
TERMS = ("compute_s", "io_wait_s", "adam_s", "comm_s", "unattributed_s")


def _no_clock() -> float:
    return 0.0


class StepAttribution:
    """Where one step's wall time went, per phase (module doc). :meth:`charge` books the engine's own
    time; :meth:`take` turns the phases' wall times and the Adam pipeline's stats into the terms."""

    def __init__(self):
        self.engine_s = dict.fromkeys(PHASES, 0.0)    # time inside the engine's verbs
        self.comm_s = dict.fromkeys(PHASES, 0.0)      # of it, blocked on collectives (this thread)
        self.io_s = dict.fromkeys(PHASES, 0.0)        # of it, blocked on the store (this thread)

    def charge(self, phase: str, engine_s: float, comm_s: float, io_s: float) -> None:
        self.engine_s[phase] += engine_s
        self.comm_s[phase] += comm_s
        self.io_s[phase] += io_s

    def take(self, wall_s: dict, pipeline: dict) -> dict:
        """``{phase: {wall_s, compute_s, io_wait_s, adam_s, comm_s, unattributed_s}, "total": ...}``.
        ``pipeline``: the step's Adam pipeline stats (``adam_s``, ``swap_in_wait_s``,
        ``swap_out_wait_s``; empty: no update ran). The step's time inside the engine that is not a
        wait of its own thread was spent waiting for the pipeline: its final write-back wait is
        counted first (it always falls in the step), then Adam, then its swap-in waits; with
        ``optimizer.update_at`` part of the pipeline ran during backward, hidden behind it."""
        out = {}
        for phase in PHASES:
            wall = wall_s[phase]
            engine = min(self.engine_s[phase], wall)
            comm = min(self.comm_s[phase], engine)
            io = min(self.io_s[phase], engine - comm)
            adam = 0.0
            if phase == "step":
                left = engine - comm - io
                tail = min(pipeline.get("swap_out_wait_s", 0.0), left)
                adam = min(pipeline.get("adam_s", 0.0), left - tail)
                swap_in = min(pipeline.get("swap_in_wait_s", 0.0), left - tail - adam)
                io += tail + swap_in
            out[phase] = {"wall_s": wall, "compute_s": wall - engine, "io_wait_s": io, "adam_s": adam,
                          "comm_s": comm, "unattributed_s": max(0.0, engine - comm - io - adam)}
        out["total"] = {k: sum(out[p][k] for p in PHASES) for k in ("wall_s",) + TERMS}
        return out


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


def engine_verb(verb):
    """Run a verb of an object whose ``stats`` is an :class:`EngineStats` inside
    :meth:`EngineStats.engine_time`: its time is the engine's, not the model's compute, and its thread's
    waits are attributed to the phase it runs in."""
    @functools.wraps(verb)
    def timed(self, *args, **kwargs):
        with self.stats.engine_time():
            return verb(self, *args, **kwargs)
    return timed


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
    ``attribution``: per phase and in total, the step's wall time split into ``compute_s``,
    ``io_wait_s``, ``adam_s``, ``comm_s`` and ``unattributed_s`` (module doc; :class:`StepAttribution`).
    ``device_timer``: a :class:`DeviceTimer` (default: one on a CUDA ``device``, none elsewhere).
    ``io_clock``: the calling thread's seconds blocked on the tiered store so far
    (:meth:`~infinity.store.TensorStore.thread_wait_s`; default: no store, always 0).
    """

    def __init__(self, counters: CommCounters, device: torch.device | None = None,
                 device_timer: DeviceTimer | None = None, io_clock: Callable[[], float] | None = None):
        self.counters = counters
        self.io_clock = io_clock or _no_clock
        self.attribution = StepAttribution()
        self._block: list | None = None   # [t0, comm clock, io clock] of the engine verb running now
        self._pipeline: dict = {}
        if device_timer is None and device is not None and device.type == "cuda" and torch.cuda.is_available():
            device_timer = DeviceTimer(device)
        self.device_timer = device_timer
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.step_s = 0.0
        self.steps = 0
        self.last_step: dict = {}
        self._marks: dict = {}

    @contextlib.contextmanager
    def engine_time(self):
        """Around each engine verb: its time, and the waits its thread booked meanwhile, go to the phase
        open when it ends (a phase that starts or stops inside takes only its own part). Nested verbs
        count once (the outermost block)."""
        if self._block is not None:
            yield
            return
        self._block = self._clocks()
        try:
            yield
        finally:
            self._charge_block()
            self._block = None

    def _clocks(self) -> list:
        return [time.perf_counter(), self.counters.thread_wait_s(), self.io_clock()]

    def _open_phase(self) -> str | None:
        return next((p for p in ("backward", "forward", "step") if p in self._marks), None)

    def _charge_block(self) -> float:
        """Book the running verb's time so far to the open phase (if any) and restart its clocks; returns
        the time now (a phase starting or stopping uses the same instant, so the terms sum exactly)."""
        if self._block is None:
            return time.perf_counter()
        now = self._clocks()
        phase = self._open_phase()
        if phase is not None:
            self.attribution.charge(phase, *(b - a for a, b in zip(self._block, now)))
        self._block = now
        return now[0]

    def pipeline_stats(self, stats: dict) -> None:
        """This step's Adam pipeline stats (``adam_s``, ``swap_in_wait_s``, ``swap_out_wait_s``)."""
        self._pipeline = dict(stats)

    def start(self, what: str) -> None:
        self._marks[what] = self._charge_block()   # the verb's time before the phase began is not the phase's
        if self.device_timer is not None:
            self.device_timer.start(what)

    def stop(self, what: str) -> None:
        now = self._charge_block()   # the verb's time up to here is the phase's
        t0 = self._marks.pop(what, None)
        if t0 is not None:
            setattr(self, what + "_s", getattr(self, what + "_s") + now - t0)
            if self.device_timer is not None:
                self.device_timer.stop(what)

    def end_step(self) -> None:
        self.steps += 1
        snap = self.counters.snapshot()
        self.last_step = {
            "forward_s": self.forward_s, "backward_s": self.backward_s, "step_s": self.step_s,
            "comm_wait_s": snap.pop("wait_s"), "collectives": snap, "steps": self.steps,
            "attribution": self.attribution.take(
                {"forward": self.forward_s, "backward": self.backward_s, "step": self.step_s}, self._pipeline),
        }
        self._pipeline = {}
        wait_device_s = snap.pop("wait_device_s")
        if wait_device_s is not None:   # NCCL: how long the compute stream waited for communication
            self.last_step["comm_wait_device_s"] = wait_device_s
        if self.device_timer is not None:
            self.last_step.update(self.device_timer.take())
        self.reset()

    def reset(self) -> None:
        self.forward_s = self.backward_s = self.step_s = 0.0
        self.attribution = StepAttribution()
        self._pipeline = {}
        self.counters.reset()
        if self.device_timer is not None:
            self.device_timer.reset()
