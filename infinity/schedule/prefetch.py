"""Trace-based prefetching: schedules come from what was seen (DESIGN §3).

The first step records the order in which units are used (forward and
backward). Later steps walk that trace: each time a unit is used, the
prefetcher says which units further along the trace to start fetching now,
keeping at most ``prefetch_bytes`` of not-yet-used units in flight ahead of the
current one. If a step uses units in another order (data-dependent control
flow), prefetching stops for the rest of that step — results stay correct,
since a unit that was not prefetched is simply fetched on demand — and the
order seen in that step becomes the new trace.

Whether to keep or re-record the trace is decided by all ranks together
(``end_step(agree)``): a rank prefetching along a trace another rank dropped
would issue collectives in a different order, which deadlocks or corrupts.

The trace is the engine's one recorded unit order: the stage-3 gather-ahead
follows it (:meth:`upcoming`) as the store prefetch does (:meth:`on_use`). Only
training forwards and backwards are recorded (the engine does not report uses
outside a step, e.g. ``torch.no_grad()`` evaluation), and a step's record is
bounded (``max_seen``): uses past it are not recorded and that step keeps the
old trace, so forwards that never reach a backward cannot grow it or replace
the trace. :meth:`abandon_step` drops a step that ended in an error.

Trade-off of ``prefetch_bytes``: more hides more latency on a slow tier but
holds that many more bytes in the faster tier.
"""

from __future__ import annotations

import enum
from typing import Callable, Hashable, Mapping

from infinity.transitions import Transitions

__all__ = ["TracePrefetcher", "TraceState"]


class TraceState(enum.Enum):
    RECORDING = "recording"  # no trace yet (first step, or the last one diverged): only record
    FOLLOWING = "following"  # this step matches the trace so far: prefetch along it
    DIVERGED = "diverged"    # this step left the trace: record only, re-decide at end_step


_MOVES = Transitions("prefetch trace", {
    TraceState.RECORDING: {TraceState.RECORDING, TraceState.FOLLOWING},   # end_step (a trace or none yet)
    TraceState.FOLLOWING: {TraceState.DIVERGED, TraceState.FOLLOWING, TraceState.RECORDING},
    TraceState.DIVERGED: {TraceState.FOLLOWING, TraceState.RECORDING},     # end_step / abandon_step
})


class TracePrefetcher:
    """Says which units to fetch next, from the order seen in earlier steps.

    ``unit_bytes[u]`` is what bringing unit ``u`` costs in the target tier.
    ``max_seen``: uses recorded per step at most (default: four per unit, room for
    a forward, a backward and re-entrant uses, and 64 at least); past it the step keeps the old trace.
    """

    def __init__(self, unit_bytes: Mapping[Hashable, int], prefetch_bytes: int, max_seen: int | None = None):
        if prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes must be >= 0, got {prefetch_bytes}")
        self.unit_bytes = dict(unit_bytes)
        self.prefetch_bytes = prefetch_bytes
        self.max_seen = max_seen if max_seen is not None else max(64, 4 * len(self.unit_bytes) + 4)
        self._overflowed = False         # this step used more than max_seen: not a trace
        self.trace: list = []            # the order being followed
        self.state = TraceState.RECORDING
        self._seen: list = []            # the order seen this step
        self._issued_upto = 0            # trace[:_issued_upto] have been handed out to fetch
        self.steps_recorded = 0
        self.steps_diverged = 0

    # ------------------------------------------------------------ per use

    def on_use(self, unit) -> list:
        """Record that ``unit`` is about to be used; return units to start fetching now."""
        if unit not in self.unit_bytes:
            raise KeyError(f"TracePrefetcher: unknown unit {unit!r}")
        pos = len(self._seen)
        if pos >= self.max_seen:
            self._overflowed = True
            if self.state is TraceState.FOLLOWING:
                self._go(TraceState.DIVERGED)
            return []
        self._seen.append(unit)
        if self.state is not TraceState.FOLLOWING:
            return []
        if pos >= len(self.trace) or self.trace[pos] != unit:
            self._go(TraceState.DIVERGED)
            return []
        return self._next_fetches(pos)

    @property
    def seen(self) -> list:
        """The units used so far in this step, in order (at most ``max_seen``)."""
        return list(self._seen)

    def _go(self, state: TraceState) -> None:
        self.state = _MOVES.check(self.state, state, "TracePrefetcher")

    def _next_fetches(self, pos: int) -> list:
        """Extend the issued window past ``pos`` while its bytes fit the budget."""
        self._issued_upto = max(self._issued_upto, pos + 1)
        ahead_bytes = sum(self.unit_bytes[u] for u in self._distinct(pos + 1, self._issued_upto))
        fetch = []
        while self._issued_upto < len(self.trace):
            nxt = self.trace[self._issued_upto]
            already = nxt in self._distinct(pos + 1, self._issued_upto) or nxt == self.trace[pos]
            cost = 0 if already else self.unit_bytes[nxt]
            if ahead_bytes + cost > self.prefetch_bytes:
                break
            ahead_bytes += cost
            self._issued_upto += 1
            if not already:
                fetch.append(nxt)
        return fetch

    def _distinct(self, lo: int, hi: int) -> list:
        out = []
        for u in self.trace[lo:hi]:
            if u not in out:
                out.append(u)
        return out

    def upcoming(self, count: int) -> list:
        """The next ``count`` units along the trace after the last one used (for the optimizer walk)."""
        if self.state is not TraceState.FOLLOWING:
            return []
        pos = len(self._seen)
        return self.trace[pos:pos + count]

    # ------------------------------------------------------------ per step

    def end_step(self, agree: Callable[[bool], bool] = lambda ok: ok) -> bool:
        """Close a step. ``agree(ok)`` must return True only if every rank's ``ok`` is True.

        Returns whether the trace was kept. On any rank's divergence (or an
        incomplete trace) every rank adopts the order it saw this step — which
        is the same on all ranks whenever units are gathered collectively.
        """
        ok = self.state is TraceState.FOLLOWING and len(self._seen) == len(self.trace)
        # an overflowed record (uses without a step) is no trace: it votes to keep the old one
        keep = agree(ok or (self._overflowed and bool(self.trace)))
        if not keep:
            self.trace = list(self._seen)
            self.steps_recorded += 1
            if self.state is not TraceState.RECORDING:
                self.steps_diverged += 1
        self._restart()
        return keep

    def abandon_step(self) -> None:
        """Forget this step's uses (it ended in an error): the trace stays, the next step starts afresh."""
        self._restart()

    def _restart(self) -> None:
        self._go(TraceState.FOLLOWING if self.trace else TraceState.RECORDING)
        self._seen = []
        self._overflowed = False
        self._issued_upto = 0
