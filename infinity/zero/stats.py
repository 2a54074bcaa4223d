"""Per-step engine statistics: time in forward / backward / step / comm waits, bytes per collective."""

from __future__ import annotations

import time

from infinity.comm.collectives import CommCounters

__all__ = ["EngineStats"]


class EngineStats:
    """Accumulates over the current step; :attr:`last_step` is the snapshot of the last finished one.

    ``last_step`` keys: ``forward_s``, ``backward_s``, ``step_s``, ``comm_wait_s``,
    ``collectives`` (calls / elements / bytes / sent_bytes / received_bytes / intra_node_bytes /
    cross_node_bytes per kind; see :mod:`infinity.comm.collectives`),
    ``steps`` (optimizer steps so far, skipped ones included); the engine adds
    ``live_peak_bytes`` (stage 3: high-water mark of gathered parameter bytes, what
    ``prefetch.max_live_bytes`` caps) and ``live_cap_releases`` (units released to stay under it).
    """

    def __init__(self, counters: CommCounters):
        self.counters = counters
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.step_s = 0.0
        self.steps = 0
        self.last_step: dict = {}
        self._marks: dict = {}

    def start(self, what: str) -> None:
        self._marks[what] = time.perf_counter()

    def stop(self, what: str) -> None:
        t0 = self._marks.pop(what, None)
        if t0 is not None:
            setattr(self, what + "_s", getattr(self, what + "_s") + time.perf_counter() - t0)

    def end_step(self) -> None:
        self.steps += 1
        snap = self.counters.snapshot()
        self.last_step = {
            "forward_s": self.forward_s, "backward_s": self.backward_s, "step_s": self.step_s,
            "comm_wait_s": snap.pop("wait_s"), "collectives": snap, "steps": self.steps,
        }
        self.reset()

    def reset(self) -> None:
        self.forward_s = self.backward_s = self.step_s = 0.0
        self.counters.reset()
