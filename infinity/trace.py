"""A Chrome / Perfetto trace of one step: what ran when, one lane per thread or stream.

The lowest layer (imports nothing from infinity), so the I/O engine, the store,
the optimizer and the engine can all record into the same :class:`Tracer`.
Recording is off unless a step was chosen (``tracer.record_step(n)``); while
off, :meth:`Tracer.span` costs one attribute check. The JSON written by
:meth:`Tracer.dump` opens in ``ui.perfetto.dev`` or ``chrome://tracing``: one
process per rank, one lane per thread (I/O workers, Adam workers, the compute
thread) or named stream (``lane="comm"``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

from infinity.io.new_files import replaced

__all__ = ["Tracer", "NULL_TRACER"]


class Tracer:
    """Collects complete events (``ph: "X"``) while recording; thread-safe."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.recording = False
        self._events: list = []
        self._lanes: dict = {}              # lane name -> tid
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._step = 0
        self._record_at: int | None = None

    # ------------------------------------------------------------ step selection

    def record_step(self, step: int | None) -> None:
        """Record only during step ``step`` (0-based, counted by :meth:`begin_step`); None = never."""
        self._record_at = step

    def begin_step(self) -> None:
        self.recording = self._record_at is not None and self._step == self._record_at

    def end_step(self) -> None:
        self.recording = False
        self._step += 1

    # ------------------------------------------------------------ events

    @contextlib.contextmanager
    def span(self, name: str, lane: str | None = None, **args):
        if not self.recording:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), lane, **args)

    def add(self, name: str, start_s: float, end_s: float, lane: str | None = None, **args) -> None:
        """An event from ``start_s`` to ``end_s`` (``time.perf_counter`` seconds)."""
        if not self.recording:
            return
        lane = lane or threading.current_thread().name
        with self._lock:
            tid = self._lanes.setdefault(lane, len(self._lanes) + 1)
            self._events.append({
                "name": name, "ph": "X", "pid": self.rank, "tid": tid,
                "ts": (start_s - self._t0) * 1e6, "dur": max(0.0, end_s - start_s) * 1e6,
                "args": args,
            })

    def events(self) -> list:
        with self._lock:
            return list(self._events)

    def dump(self, path: str | os.PathLike) -> Path:
        """Write the trace JSON (lane names as thread-name metadata); returns the path."""
        with self._lock:
            meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
            meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}}
                     for lane, tid in self._lanes.items()]
            doc = {"traceEvents": meta + self._events, "displayTimeUnit": "ms"}
        path = Path(path)
        with replaced(path, "w") as f:   # never through a symlink planted at a guessable temp name
            f.write(json.dumps(doc))
        return path


class _NullTracer(Tracer):
    """Never records; the default for code that was given no tracer."""

    def record_step(self, step):
        if step is not None:
            raise RuntimeError("NULL_TRACER cannot record; create a Tracer")


NULL_TRACER = _NullTracer()
