"""The optimizer update: every unit shard one job through one pipeline, wherever it lives, on a schedule.

Each unit's shard becomes a :class:`~infinity.optim.shard_job.ShardJob`
whose fields are in-memory tensors or store keys (the shard says which,
:meth:`UnitShard.job_field`), and every job runs through the same
:class:`~infinity.optim.pipeline.AdamPipeline`: swap-in of the next
shard, :class:`~infinity.optim.cpu_adam.CpuAdamW` on this one, write-back of the
last. In-memory fields simply pass through the swap-in and write-back. The
engine owns this data movement; the optimizer only holds hyper-parameters.

*When* the jobs run is ``optimizer.update_at``, decided once
(:meth:`Config.update_schedule`) into one :class:`UpdateSchedule` per value
(:func:`infinity.zero.schedules.make_schedule`). Every schedule answers the
same events, and the engine only sends them:

================  ===============================================================
event             sent when
================  ===============================================================
begin_backward    a backward starts (``sync`` False: inside ``no_sync()``)
unit_final        a unit's gradient shard is folded (stages 2-3)
end_backward      every reduction of the backward has landed
step              ``optimizer.step()``, with the step's gradient multiplier
before_use        a unit is about to be used by a forward or gathered
drain             something reads every shard next (a save, ``gathered()``, close)
abort             a checkpoint load replaces every shard
================  ===============================================================

This module has the shared part and ``step`` (:class:`UpdateAtStep`: every unit
at ``optimizer.step()``); :mod:`.update_backward` (``backward``),
:mod:`.update_next_forward` (``next_forward``) and :mod:`.speculation`
(``speculative``) the others.

Stages 1-2 all-gather each updated parameter shard as soon as its update has
landed (the job's ``on_done``), so the gathers overlap the rest of the step.

A failed update (say ENOSPC while writing a shard home) leaves each unit
marked updated or not; the next :meth:`UpdateSchedule.step` retries the writes
that failed, gathers what was updated and updates only the rest, with the
same hyper-parameters (the step count moves only when the step completes).
"""

from __future__ import annotations

import collections
import contextlib
import os

from infinity.optim.cpu_adam import CpuAdamW, default_adam_threads
from infinity.optim.moment_codes import moment_format
from infinity.optim.pipeline import AdamPipeline
from infinity.optim.shard_job import ShardJob
from infinity.zero.grads import MAX_INFLIGHT
from infinity.zero.units import TensorClass, UpdateMark

__all__ = ["UpdateSchedule", "UpdateAtStep"]

# shards swapped in ahead of the one being updated: each holds its states (16 B/element) in host
# memory and hides one more shard's read latency behind compute
_LOOKAHEAD = 2
# the ShardJob fields Adam writes, and the class each is a chunk of
WRITTEN_FIELDS = {"master": TensorClass.MASTER, "exp_avg": TensorClass.EXP_AVG,
                  "exp_avg_sq": TensorClass.EXP_AVG_SQ, "param_out": TensorClass.PARAM}


class UpdateSchedule:
    """The engine's optimizer update (see the module doc), built with what it needs: the units, the store
    (None: everything in memory), the data-parallel collectives (stages 1-2 gather updated shards),
    the stage policy, the param groups' :class:`~infinity.zero.hyper.GroupHyper`, ``config.optimizer``
    (``cfg``), the backwards per step (``accum_steps``) and the host bytes of the largest optimizer job
    (``job_bytes``, :meth:`~infinity.zero.placement.UnitPlacement.job_host_bytes`: what the pipeline's
    look-ahead room is sized in) and what its room leaves to the rest of the host tier (``beside_bytes``,
    :meth:`~infinity.zero.placement.UnitPlacement.beside_update_bytes`). Subclasses say *when* the jobs run."""

    name = "step"                 # the optimizer.update_at value this schedule implements
    overlaps = False              # some unit's update may run while compute does (reads folds as they land)
    waits_before_use = False      # an update may still run when the next forward starts (before_use waits)
    uses_spares = False           # each written class has a spare copy (prepare_unit makes it)
    pending = False               # an update step() returned from still runs (drain() waits for it)

    def __init__(self, units: list, store, coll, policy, shard_rank: int, rank: int, hyper, tracer, cfg,
                 accum_steps: int = 1, job_bytes: int | None = None, beside_bytes: int = 0):
        self.units, self.store, self.coll, self.policy = units, store, coll, policy
        self.shard_rank, self.rank, self.hyper, self.accum_steps = shard_rank, rank, hyper, accum_steps
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = cfg.threads if cfg.threads != "auto" else default_adam_threads(local_ranks)
        self.adam = CpuAdamW(threads=threads)
        # the update's host copies live in a room of their own: folds and gathers beside an overlapped
        # update use the rest of the host tier, and nobody waits for the other's memory
        self.pipeline = AdamPipeline(store, self.adam, lookahead=_LOOKAHEAD, tracer=tracer, job_bytes=job_bytes,
                                     leave_bytes=beside_bytes)
        self.split_master = cfg.master == "remainder"   # each job's master is its parameter's int16 remainder
        self.blocked_moments = moment_format(cfg.moments).blocked   # each job's moments are int8 rows of blocks
        self.partial_update = False   # units were updated by a step that did not complete (backward raised)
        self.last_stats: dict = {}
        self._post_gathers: collections.deque = collections.deque()
        self._owner: dict = {}   # job name -> its unit
        self._store_mark: dict | None = None
        self._resident: int | None = None

    def close(self) -> None:
        """Stop the pipeline (a step still running is dropped) and CPU Adam's threads."""
        self.closer()()

    def closer(self):
        """:meth:`close` as a callable that holds only the threads' owners, not the units (whose modules'
        hooks lead back to the engine): for a finalizer."""
        pipeline, adam = self.pipeline, self.adam

        def close() -> None:
            try:
                pipeline.close()
            finally:
                adam.close()
        return close

    def prepare_unit(self, unit) -> None:
        """``unit``'s shard is built and filled: a schedule that needs more of it makes it here (the
        speculative one: its spares). Nothing, here."""

    # ------------------------------------------------------------ events (the step-time schedule's answers)

    def begin_backward(self, sync: bool) -> None:
        """A backward is starting (``sync`` False: inside ``no_sync()``, not the step's last)."""

    def unit_final(self, unit, grad_scale: float) -> None:
        """``unit``'s gradient shard is folded (stages 2-3); ``grad_scale`` is the multiplier an update
        begun now applies."""

    def end_backward(self, grad_scale: float) -> None:
        """Backward is done; ``grad_scale`` is the multiplier an update begun in it applies."""

    def step(self, grad_scale: float) -> None:
        """``optimizer.step()``: update every unit not yet updated in this step, each gradient read times
        ``grad_scale`` (unscale x clip); raises with the units' ``updated`` marks kept. The caller waits for
        folded gradients' writes first."""
        try:
            self._finish_earlier_attempt()
            self._update_rest(grad_scale)
        finally:
            self._mark_updated()
            self._wait_gathers()   # the next forward reads these buffers

    def before_use(self, unit) -> None:
        """``unit`` is about to be used (its forward, a gather): its update of this step is done."""

    def check_gather(self, unit) -> None:
        """Before ``unit`` is gathered (stage 3): as :meth:`before_use`, and refused if it cannot be."""
        self.before_use(unit)

    def drain(self) -> None:
        """Something reads every shard next: no update of a step ``step()`` returned from still runs."""

    def abort(self) -> None:
        """Drop whatever runs (a checkpoint load replaces every shard)."""
        self.pipeline.abort()
        self.partial_update = False
        self._wait_gathers()

    def abort_backward(self) -> None:
        """The backward raised: stop the updates it had started (see :attr:`partial_update`)."""

    def new_step(self) -> None:
        """Gradients were zeroed: the next backward is the step's first."""

    def skip_step(self) -> None:
        """fp16 overflow: the step is skipped."""

    def check_clip(self) -> None:
        """``clip_grad_norm_()`` is about to scale the gradients: refused where an update already read them."""

    def updating(self, unit) -> bool:
        """Whether ``unit``'s update has begun and not been waited for (not to be gathered or prefetched):
        its :class:`~infinity.zero.units.UpdateMark` says (never set here)."""
        return unit.update_mark is not UpdateMark.NONE

    def flushing(self):
        """Context for the end-of-backward flush (units made final in it are updated after it)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------ the shared machinery

    def _finish_earlier_attempt(self) -> None:
        """Units an earlier, failed attempt at this step updated: their failed writes again, their gathers."""
        done_before = [u for u in self.units if u.updated]
        for f in [f for u in done_before for f in u.shard.write_back_dirty()]:
            f.result()   # a write that failed last time (the new values are still in memory)
        if self.policy.gather_after_step:
            for unit in done_before:   # their gathers may not have run: idempotent, so run them all
                self.gather_updated(unit, unit.shard.get(TensorClass.PARAM))

    def _update_rest(self, grad_scale: float) -> None:
        """Every unit not yet updated, now (one an overlapped backward started is only finished)."""
        if not self.pipeline.running:
            self._begin()
            for unit in self.units:
                for job in self.jobs(unit, grad_scale):
                    self.pipeline.submit(job)
        self.last_stats = self.pipeline.finish()

    def _clear_marks(self, mark: UpdateMark) -> bool:
        """Every unit marked ``mark`` is unmarked (its update waited for, or dropped); True if any was."""
        marked = [u for u in self.units if u.update_mark is mark]
        for unit in marked:
            unit.set_update_mark(UpdateMark.NONE)
        return bool(marked)

    def _mark_updated(self) -> None:
        """Each unit whose every chunk the pipeline updated since it started is marked updated."""
        for name in self.pipeline.updated:   # a unit's chunks are updated in order
            unit = self._owner[name]
            unit.chunks_updated += 1
            unit.updated = unit.chunks_updated == len(unit.shard.chunks())

    def _begin(self, hyper=None):
        """Start the pipeline with ``hyper`` (default: this step's hyper-parameters as they are now); returns it."""
        hyper = hyper if hyper is not None else self.hyper.for_step().__getitem__
        self.pipeline.start(hyper)
        return hyper

    def _wait_gathers(self) -> None:
        while self._post_gathers:
            self._post_gathers.popleft().wait()

    def jobs(self, unit, grad_scale: float, spares=None) -> list:
        """``unit``'s jobs not yet done this step: one per chunk of its shard (one when unchunked,
        named after the unit; else ``name#chunk``). Its gradient shard must be final. ``spares``: the
        unit's :class:`~infinity.zero.spares.SpareSet`, for a speculative update's jobs (see
        :mod:`infinity.zero.speculation`): written fields go to the spares, read from the current copies,
        and the gradient is kept."""
        spare = spares is not None
        s = unit.shard
        s.write_back_lent()
        chunks = s.chunks()
        ranges = unit.shard_group_ranges(self.shard_rank)
        alias = s.is_alias(TensorClass.MASTER, TensorClass.PARAM)
        jobs = []
        for c in range(0 if spare else unit.chunks_updated, len(chunks)):
            lo, hi = chunks[c] or (0, unit.shard_numel)
            # stages 1-2: the unit's parameter shard is gathered once its last chunk has landed
            last = c == len(chunks) - 1
            on_done = (lambda param, unit=unit: self.gather_updated(unit, param if chunks == [None] else
                                                                    unit.shard.get(TensorClass.PARAM))) \
                if self.policy.gather_after_step and last and not spare else None
            fields = {name: None if alias and cls is TensorClass.PARAM else s.job_field(cls, c)
                      for name, cls in WRITTEN_FIELDS.items()}
            sources: dict = {}
            if spare:   # written into the spares; Adam reads the old values of all but a new parameter
                for name, cls in WRITTEN_FIELDS.items():
                    if fields[name] is None:
                        continue
                    if name != "param_out" or self.split_master:
                        sources[name] = fields[name]
                    fields[name] = spares.field(cls, c)
            jobs.append(ShardJob(
                unit.name if chunks == [None] else f"{unit.name}#{c}",
                fields["master"], fields["exp_avg"], fields["exp_avg_sq"], s.job_field(TensorClass.GRAD, c),
                fields["param_out"],
                [(g, max(a, lo) - lo, min(b, hi) - lo) for g, a, b in ranges if max(a, lo) < min(b, hi)],
                on_done, grad_scale=grad_scale,
                # a speculative job keeps its gradient: a redo reads it (from the disk, where the host
                # cannot hold every kept gradient beside the parameters the next forward reads)
                discard=() if spare else s.consumed_after_update(c), write_home=s.kept_for_redo(c) if spare else (),
                drop=spares.drops(c) if spare else s.dropped_after_update(c), master_is_remainder=self.split_master,
                moments_blocked=self.blocked_moments, unit_index=unit.index,
                element_offset=self.shard_rank * unit.shard_numel + lo, sources=sources))
            self._owner[jobs[-1].name] = unit
        return jobs

    def gather_updated(self, unit, param, wait: bool = False) -> None:
        """Stages 1-2: all-gather ``unit``'s updated parameter shard into every rank's full buffer."""
        shard = param.clone()   # the shard is a view of the full buffer: input and output must not alias
        # `then` holds the copy alive until the gather is waited on
        pending = self.coll.all_gather(unit.full_param, shard, async_op=True, then=lambda shard=shard: None,
                                       label=f"updated unit {unit.name!r}")
        if wait:
            pending.wait()
            return
        self._post_gathers.append(pending)
        while len(self._post_gathers) > MAX_INFLIGHT:
            self._post_gathers.popleft().wait()

    # ------------------------------------------------------------ stats

    def mark_store(self) -> None:
        if self.store is not None:
            self._store_mark = self._store_counters()

    def end_step(self, last_step: dict, prefetch_trace: str) -> None:
        """With a store: the step's bytes per tier pair, I/O and update times under ``offload``
        (``prefetch_trace``: the recorded unit order's state); then the host buffers the step cached
        for reuse are freed (:meth:`TensorStore.trim_host_buffers`)."""
        if self.store is None:
            return
        now = self._store_counters()
        moved = {k: v - self._store_mark["moved"].get(k, 0) for k, v in now["moved"].items()}
        last_step["offload"] = {
            "moved_bytes": {k: v for k, v in moved.items() if v},
            "io_wait_s": now["wait_s"] - self._store_mark["wait_s"],
            # dirty host copies written home for room (gradients an overlapped update had not reached)
            "spills": now["spills"] - self._store_mark["spills"],
            # cached copies dropped for room, per tier (device: stage-3 parameter copies under tiers.device_bytes)
            "evictions": {t: n - self._store_mark["evictions"][t] for t, n in now["evictions"].items()},
            "adam_s": self.last_stats.get("adam_s", 0.0),
            "swap_in_wait_s": self.last_stats.get("swap_in_wait_s", 0.0),
            "swap_out_wait_s": self.last_stats.get("swap_out_wait_s", 0.0),
            "peak_bytes": now["peak"],
            "live_peak_bytes": last_step["live_peak_bytes"],   # gathered params, capped
            "prefetch_trace": prefetch_trace,
            "overlapped": False,
            "host_resident_bytes": self._host_resident_bytes(),
        }
        self._step_stats(last_step["offload"])
        self.last_stats = {}
        self._store_mark = now
        self.store.trim_host_buffers()

    def _step_stats(self, offload: dict) -> None:
        """A schedule's own entries in the step's ``offload`` stats (and its per-step reset)."""

    def _host_resident_bytes(self) -> int:
        """NVMe-placed chunks homed in host memory (``offload.host_resident_bytes``): fixed at initialize."""
        if self._resident is None:
            self._resident = sum(u.shard.resident_bytes() for u in self.units)
        return self._resident

    def _store_counters(self) -> dict:
        s = self.store.stats()
        return {"moved": dict(s["moved_bytes"]), "wait_s": s["wait_s"], "peak": s["peak_bytes"],
                "spills": s["spills"]["host"], "evictions": dict(s["evictions"])}


class UpdateAtStep(UpdateSchedule):
    """``optimizer.update_at: step``: every unit at ``optimizer.step()``, nothing overlapped (the base's
    answers). Clipping and fp16 need nothing more; the step's I/O is not hidden."""

