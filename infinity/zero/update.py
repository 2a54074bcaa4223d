"""The optimizer update: every unit shard one job through one pipeline, wherever it lives.

Each unit's shard becomes a :class:`~infinity.optim.pipeline.ShardJob`
whose fields are in-memory tensors or store keys (the shard says which,
:meth:`UnitShard.job_field`), and every job runs through the same
:class:`~infinity.optim.pipeline.AdamPipeline`: swap-in of the next
shard, :class:`~infinity.optim.cpu_adam.CpuAdamW` on this one, write-back of the
last. In-memory fields simply pass through the swap-in and write-back. The
engine owns this data movement; the optimizer only holds hyper-parameters.

Stages 1-2 all-gather each updated parameter shard as soon as its update has
landed (``on_done``), so the gathers overlap the rest of the step.

With ``optimizer.overlap_backward`` the pipeline starts during backward and
each unit is submitted as soon as its gradient shard is final
(:mod:`infinity.zero.overlap`); the step then only finishes it.

A failed update (say ENOSPC while writing a shard home) leaves each unit
marked updated or not; the next :meth:`ShardUpdate.run` retries the writes
that failed, gathers what was updated and updates only the rest, with the
same hyper-parameters (the step count moves only when the step completes).
"""

from __future__ import annotations

import collections
import contextlib
import os

from infinity.optim.cpu_adam import CpuAdamW, default_adam_threads
from infinity.optim.pipeline import AdamPipeline, ShardJob
from infinity.zero.grads import MAX_INFLIGHT
from infinity.zero.overlap import OverlappedStep
from infinity.zero.units import TensorClass

__all__ = ["ShardUpdate"]

# shards swapped in ahead of the one being updated: each holds its states (16 B/element) in host
# memory and hides one more shard's read latency behind compute
_LOOKAHEAD = 2


class ShardUpdate:
    """The engine's optimizer step (see the module doc). ``cfg`` is ``config.optimizer``."""

    def __init__(self, engine, cfg):
        self.engine = engine
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = cfg.threads if cfg.threads != "auto" else default_adam_threads(local_ranks)
        self.adam = CpuAdamW(threads=threads)
        self.pipeline = AdamPipeline(engine.store, self.adam, lookahead=_LOOKAHEAD, tracer=engine.tracer)
        self.overlap = OverlappedStep(engine.rank, self._jobs, self._begin) if cfg.overlap_backward else None
        self.partial_overlapped_update = False   # a backward raised after its overlapped updates began
        self.last_stats: dict = {}
        self._post_gathers: collections.deque = collections.deque()
        self._owner: dict = {}   # job name -> its unit
        self._flushing = False
        self._store_mark: dict | None = None
        self._resident: int | None = None

    def close(self) -> None:
        """Stop the pipeline (a step still running is dropped) and CPU Adam's threads."""
        try:
            self.pipeline.close()
        finally:
            self.adam.close()

    # ------------------------------------------------------------ the step

    def run(self) -> None:
        """Update every unit not yet updated in this step; raises with the units' ``updated`` marks kept."""
        e = self.engine
        e.grads.settle_writes()
        done_before = [u for u in e.units if u.updated]
        try:
            for f in [f for u in done_before for f in u.shard.write_back_dirty()]:
                f.result()   # a write that failed last time (the new values are still in memory)
            if e.stage in (1, 2):
                for unit in done_before:   # their gathers may not have run: idempotent, so run them all
                    self.gather_updated(unit, unit.shard.get(TensorClass.PARAM))
            if not self.pipeline.running:   # overlapped: backward started it (unless it failed since)
                self._begin()
                for unit in e.units:
                    for job in self._jobs(unit):
                        self.pipeline.submit(job)
            self.last_stats = self.pipeline.finish()
        finally:
            for name in self.pipeline.updated:   # a unit's chunks are updated in order
                unit = self._owner[name]
                unit.chunks_updated += 1
                unit.updated = unit.chunks_updated == len(unit.shard.chunks())
            while self._post_gathers:
                self._post_gathers.popleft().wait()   # the next forward reads these buffers

    def _begin(self):
        """Start the pipeline with this step's hyper-parameters as they are now; returns it."""
        hyper = [self.engine.hyper(i) for i in range(len(self.engine.param_groups))]
        self.pipeline.start(hyper.__getitem__)
        return self.pipeline

    def _jobs(self, unit) -> list:
        """``unit``'s jobs not yet done this step: one per chunk of its shard (one when unchunked,
        named after the unit; else ``name#chunk``). Its gradient shard must be final."""
        e = self.engine
        s = unit.shard
        s.settle()
        chunks = s.chunks()
        ranges = unit.shard_group_ranges(e.shard_rank)
        alias = s.is_alias(TensorClass.MASTER, TensorClass.PARAM)
        jobs = []
        for c in range(unit.chunks_updated, len(chunks)):
            lo, hi = chunks[c] or (0, unit.shard_numel)
            # stages 1-2: the unit's parameter shard is gathered once its last chunk has landed
            last = c == len(chunks) - 1
            on_done = (lambda param, unit=unit: self.gather_updated(unit, param if chunks == [None] else
                                                                    unit.shard.get(TensorClass.PARAM))) \
                if e.stage in (1, 2) and last else None
            jobs.append(ShardJob(
                unit.name if chunks == [None] else f"{unit.name}#{c}",
                s.job_field(TensorClass.MASTER, c), s.job_field(TensorClass.EXP_AVG, c),
                s.job_field(TensorClass.EXP_AVG_SQ, c), s.job_field(TensorClass.GRAD, c),
                None if alias else s.job_field(TensorClass.PARAM, c),
                [(g, max(a, lo) - lo, min(b, hi) - lo) for g, a, b in ranges if max(a, lo) < min(b, hi)],
                on_done, grad_scale=e.grads.multiplier, discard=s.consumed_after_update(c),
                drop=s.dropped_after_update(c)))
            self._owner[jobs[-1].name] = unit
        return jobs

    def gather_updated(self, unit, param, wait: bool = False) -> None:
        """Stages 1-2: all-gather ``unit``'s updated parameter shard into every rank's full buffer."""
        shard = param.clone()   # the shard is a view of the full buffer: input and output must not alias
        # `then` holds the copy alive until the gather is waited on
        pending = self.engine.coll.all_gather(unit.full_param, shard, async_op=True, then=lambda shard=shard: None)
        if wait:
            pending.wait()
            return
        self._post_gathers.append(pending)
        while len(self._post_gathers) > MAX_INFLIGHT:
            self._post_gathers.popleft().wait()

    def abort_step(self) -> None:
        """Drop a running pipeline (a checkpoint load replaces every shard)."""
        self.pipeline.abort()
        self.partial_overlapped_update = False
        while self._post_gathers:
            self._post_gathers.popleft().wait()
        if self.overlap is not None:
            self.overlap.abort()

    # ------------------------------------------------------------ optimizer.overlap_backward

    def unit_final(self, unit) -> None:
        """A unit's gradient shard is folded (stages 2-3); with overlap its update may start."""
        if self.overlap is not None:
            self.overlap.unit_final(unit, during_flush=self._flushing)

    @contextlib.contextmanager
    def flushing(self):
        """Units made final by the end-of-backward flush wait for its end (stage 3: the root is released)."""
        self._flushing = True
        try:
            yield
        finally:
            self._flushing = False

    def end_backward(self) -> None:
        if self.overlap is not None:
            self.overlap.end_backward()

    def abort_backward(self) -> None:
        """The backward raised: stop updates it had started; some may be done (the state is then newer
        than the step count says, and only a checkpoint load makes it whole again)."""
        if self.overlap is None:
            return
        began = self.overlap.abort()
        self.pipeline.abort()
        self.partial_overlapped_update = self.partial_overlapped_update or began

    def check_new_backward(self) -> None:
        if self.overlap is not None:
            self.overlap.check_new_backward()

    def check_gather(self, unit) -> None:
        if self.overlap is not None:
            self.overlap.check_gather(unit)

    def check_clip(self) -> None:
        if self.overlap is not None:
            raise RuntimeError(f"clip_grad_norm_() on rank {self.engine.rank} with optimizer.overlap_backward: the "
                               "update runs during backward, but clipping needs every gradient before any "
                               "update; set overlap_backward: false to clip")

    def updating(self, index: int) -> bool:
        """Whether unit ``index``'s update has begun this step (it is not to be gathered or prefetched)."""
        return self.overlap is not None and self.overlap.updating(index)

    def with_room(self, attempt):
        """A store operation on the caller's thread; during an overlapped step it may wait for host room
        the update holds pinned (without overlap nothing else pins host copies while backward runs)."""
        return attempt() if self.overlap is None else self.overlap.wait_for_room(attempt)

    # ------------------------------------------------------------ stats

    def mark_store(self) -> None:
        if self.engine.store is not None:
            self._store_mark = self._store_counters()

    def end_step(self, last_step: dict) -> None:
        """With a store: the step's bytes per tier pair, I/O and update times under ``offload``; then
        the host buffers the step cached for reuse are freed (:meth:`TensorStore.trim_host_buffers`)."""
        e = self.engine
        if e.store is None:
            return
        now = self._store_counters()
        moved = {k: v - self._store_mark["moved"].get(k, 0) for k, v in now["moved"].items()}
        last_step["offload"] = {
            "moved_bytes": {k: v for k, v in moved.items() if v},
            "io_wait_s": now["wait_s"] - self._store_mark["wait_s"],
            # dirty host copies written home for room (gradients an overlapped update had not reached)
            "spills": now["spills"] - self._store_mark["spills"],
            "adam_s": self.last_stats.get("adam_s", 0.0),
            "swap_in_wait_s": self.last_stats.get("swap_in_wait_s", 0.0),
            "swap_out_wait_s": self.last_stats.get("swap_out_wait_s", 0.0),
            "peak_bytes": now["peak"],
            "live_peak_bytes": last_step["live_peak_bytes"],   # gathered params, capped
            "prefetch_trace": e.prefetcher.state.value,
            "overlapped": False,
            "host_resident_bytes": self._host_resident_bytes(),
        }
        if self.overlap is not None:
            last_step["offload"].update(self.overlap.end_step(self.last_stats))
        self.last_stats = {}
        self._store_mark = now
        e.store.trim_host_buffers()

    def _host_resident_bytes(self) -> int:
        """NVMe-placed chunks homed in host memory (``offload.host_resident_bytes``): fixed at initialize."""
        if self._resident is None:
            self._resident = sum(u.shard.resident_bytes() for u in self.engine.units)
        return self._resident

    def _store_counters(self) -> dict:
        s = self.engine.store.stats()
        return {"moved": dict(s["moved_bytes"]), "wait_s": s["wait_s"], "peak": s["peak_bytes"],
                "spills": s["spills"]["host"]}
