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

With ``optimizer.overlap_backward`` (:mod:`infinity.zero.overlap`) the pipeline
starts during the step's last backward and each unit is submitted as soon as
its gradient shard is final; the step then only finishes it. Or (mode
``next_forward``) the step launches every unit in forward order and returns;
the next forward waits for each unit (:meth:`ShardUpdate.wait_unit`) before use.
Or (mode ``speculative``, :mod:`infinity.zero.speculation`) the last backward
updates into spare copies before the clip norm is known, and the step commits
them or redoes the update from the untouched state.

A failed update (say ENOSPC while writing a shard home) leaves each unit
marked updated or not; the next :meth:`ShardUpdate.run` retries the writes
that failed, gathers what was updated and updates only the rest, with the
same hyper-parameters (the step count moves only when the step completes).
"""

from __future__ import annotations

import collections
import contextlib
import os
import time

from infinity.optim.cpu_adam import CpuAdamW, default_adam_threads
from infinity.optim.moment_codes import moment_format
from infinity.optim.pipeline import AdamPipeline, ShardJob
from infinity.store import StoreError, Tier
from infinity.zero.grad_staging import is_fold_owner
from infinity.zero.grads import MAX_INFLIGHT
from infinity.zero.overlap import OverlappedStep, OverlapPhase
from infinity.zero.speculation import SpeculationPolicy, spare_classes
from infinity.zero.units import TensorClass

__all__ = ["ShardUpdate"]

# shards swapped in ahead of the one being updated: each holds its states (16 B/element) in host
# memory and hides one more shard's read latency behind compute
_LOOKAHEAD = 2
# the ShardJob fields Adam writes, and the class each is a chunk of
_WRITTEN_FIELDS = {"master": TensorClass.MASTER, "exp_avg": TensorClass.EXP_AVG,
                   "exp_avg_sq": TensorClass.EXP_AVG_SQ, "param_out": TensorClass.PARAM}


class ShardUpdate:
    """The engine's optimizer step (see the module doc), built with what it needs: the units, the store
    (None: everything in memory), the data-parallel collectives (stages 1-2 gather updated shards),
    the stage policy, the param groups' :class:`~infinity.zero.hyper.GroupHyper`, and
    ``config.optimizer`` (``cfg``)."""

    def __init__(self, units: list, store, coll, policy, shard_rank: int, rank: int, hyper, tracer, cfg,
                 overlap_mode: str = "off", accum_steps: int = 1):
        self.units, self.store, self.coll, self.policy = units, store, coll, policy
        self.shard_rank, self.rank, self.hyper = shard_rank, rank, hyper
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = cfg.threads if cfg.threads != "auto" else default_adam_threads(local_ranks)
        self.adam = CpuAdamW(threads=threads)
        # beside an overlapped update the folds pin brought gradient sums briefly and never wait for the
        # update while they do: its swap-in may wait for them (grad_staging.is_fold_owner)
        self.pipeline = AdamPipeline(store, self.adam, lookahead=_LOOKAHEAD, tracer=tracer, yields_to=is_fold_owner)
        self.overlap = OverlappedStep(rank, overlap_mode, accum_steps) if overlap_mode != "off" else None
        # speculative: whether each step speculates (else it runs as next_forward), and the running one
        self.speculation = SpeculationPolicy() if overlap_mode == "speculative" else None
        self._spec: dict | None = None      # the step's speculation: its multiplier, units, hyper, redo
        self._outcome: dict | None = None   # how the step's speculation ended, for its stats
        self._unclipped: bool | None = None   # the step's multiplier was the one a speculation uses
        self._expected_scale = 1.0          # that multiplier (the engine's, at the end of backward)
        self._launched_stats: dict | None = None   # the launched step's offload stats, completed when settled
        self._settled_update: dict | None = None   # ... and those stats once complete, for the next end_step
        self._forward_wait_s = 0.0
        self._launched_jobs: dict = {}   # next_forward: unit index -> the job names step() launched for it
        self.split_master = cfg.master == "remainder"   # each job's master is its parameter's int16 remainder
        self.blocked_moments = moment_format(cfg.moments).blocked   # each job's moments are int8 rows of blocks
        self.partial_overlapped_update = False   # a backward raised after its overlapped updates began
        self.last_stats: dict = {}
        self._post_gathers: collections.deque = collections.deque()
        self._owner: dict = {}   # job name -> its unit
        self._flushing = False
        self._store_mark: dict | None = None
        self._resident: int | None = None

    @property
    def launches(self) -> bool:
        """This step's update is launched by step() for the next forward: mode next_forward, or a
        speculative mode's step that does not speculate (:class:`SpeculationPolicy`)."""
        if self.overlap is None:
            return False
        if self.speculation is not None:
            return not self.overlap.speculating
        return self.overlap.mode == "next_forward"

    @property
    def may_launch(self) -> bool:
        """Whether some step's update may be launched for the next forward (its hooks wait per unit)."""
        return self.overlap is not None and self.overlap.mode in ("next_forward", "speculative")

    def close(self) -> None:
        """Stop the pipeline (a step still running is dropped) and CPU Adam's threads."""
        try:
            self.pipeline.close()
        finally:
            self.adam.close()

    # ------------------------------------------------------------ the step

    def run(self, grad_scale: float) -> None:
        """Update every unit not yet updated in this step, each gradient read times ``grad_scale`` (unscale x
        clip); raises with the units' ``updated`` marks kept. The caller waits for folded gradients' writes first."""
        if self.speculation is not None and self._spec is None:
            self._unclipped = grad_scale == self._expected_scale
        if self._spec is not None:
            self._finish_speculation(grad_scale)
            return
        done_before = [u for u in self.units if u.updated]
        try:
            for f in [f for u in done_before for f in u.shard.write_back_dirty()]:
                f.result()   # a write that failed last time (the new values are still in memory)
            if self.policy.gather_after_step:
                for unit in done_before:   # their gathers may not have run: idempotent, so run them all
                    self.gather_updated(unit, unit.shard.get(TensorClass.PARAM))
            if self.launches:
                self._launch(grad_scale)
                return
            if not self.pipeline.running:   # overlapped: backward started it (unless it failed since)
                self._begin()
                for unit in self.units:
                    for job in self._jobs(unit, grad_scale):
                        self.pipeline.submit(job)
            self.last_stats = self.pipeline.finish()
        finally:
            # a launched update's marks are not needed (it is waited for by unit); it is still running
            for name in ([] if self.pending else self.pipeline.updated):   # a unit's chunks are updated in order
                unit = self._owner[name]
                unit.chunks_updated += 1
                unit.updated = unit.chunks_updated == len(unit.shard.chunks())
            while self._post_gathers:
                self._post_gathers.popleft().wait()   # the next forward reads these buffers

    def _launch(self, grad_scale: float) -> None:
        """next_forward: start every unit not yet updated, in forward order (the root, then the units);
        returns at once. The caller's next uses wait per unit (:meth:`wait_unit`, :meth:`settle`)."""
        order = sorted((u for u in self.units if not u.updated), key=lambda u: (not u.is_root, u.index))
        self._begin()
        self.overlap.launched(order)
        self._forward_wait_s = 0.0
        self._launched_jobs = {}
        try:
            for unit in order:
                jobs = self._jobs(unit, grad_scale)
                self._launched_jobs[unit.index] = [job.name for job in jobs]
                for job in jobs:
                    self.pipeline.submit(job)
        except BaseException:
            self.pipeline.abort()   # what was updated stays marked (run's finally): step() again finishes it
            self.overlap.end_launched()
            raise

    @property
    def pending(self) -> bool:
        """next_forward: a step's launched update is still running (some unit not yet waited for)."""
        return self.launches and self.overlap.phase is OverlapPhase.LAUNCHED

    def wait_unit(self, unit) -> None:
        """next_forward: ``unit`` is about to be used (its forward, a gather): wait for its launched
        update, written home and (stages 1-2) all-gathered; a no-op once it has been."""
        if not self.pending or not self.overlap.waiting(unit.index):
            return
        names = self._launched_jobs[unit.index]
        t0 = time.perf_counter()
        try:
            self.pipeline.wait_for(names)
            while self._post_gathers:   # in job order: this unit's gather is the newest
                self._post_gathers.popleft().wait()
        except BaseException as e:
            self._launch_failed(e)
            raise
        finally:
            self._forward_wait_s += time.perf_counter() - t0
        if self.overlap.settled(unit.index):
            self.settle()   # the last one: the step's stats are complete

    def settle(self) -> None:
        """next_forward: wait for the rest of a launched update (a backward, a save, ``gathered()``,
        ``close()`` come next); a no-op when none is running."""
        if not self.pending:
            return
        t0 = time.perf_counter()
        try:
            self.last_stats = self.pipeline.finish() if self.pipeline.running else {}
            while self._post_gathers:
                self._post_gathers.popleft().wait()
        except BaseException as e:
            self._launch_failed(e)
            raise
        self._forward_wait_s += time.perf_counter() - t0
        self.overlap.end_launched()
        if self._launched_stats is not None:   # the launched step's stats, now that its update is done
            done = dict(adam_s=self.last_stats.get("adam_s", 0.0),
                        swap_in_wait_s=self.last_stats.get("swap_in_wait_s", 0.0),
                        swap_out_wait_s=self.last_stats.get("swap_out_wait_s", 0.0),
                        update_wait_s=self._forward_wait_s)   # how long the caller waited for it after step()
            self._launched_stats.update(done)
            self._launched_stats = None
            self._settled_update = done   # reported with the step that waited for it (end_step)
        self.last_stats = {}

    def _launch_failed(self, error: BaseException) -> None:
        """A launched update raised: the step was counted but is not whole (some units updated)."""
        self.pipeline.abort()
        while self._post_gathers:
            self._post_gathers.popleft().wait()
        self.overlap.end_launched()
        self.partial_overlapped_update = True
        if hasattr(error, "add_note"):
            error.add_note(f"infinity: the update optimizer.step() launched on rank {self.rank} "
                           "(optimizer.overlap_mode next_forward) failed part-way; the state is newer than the "
                           "step count says: load the last checkpoint")

    def _begin(self, hyper=None):
        """Start the pipeline with ``hyper`` (default: this step's hyper-parameters as they are now); returns it."""
        hyper = hyper if hyper is not None else self.hyper.for_step().__getitem__
        self.pipeline.start(hyper)
        return hyper

    # ------------------------------------------------------------ optimizer.overlap_mode speculative

    def _finish_speculation(self, grad_scale: float) -> None:
        """step() after a speculative backward: wait for its updates, redo them with ``grad_scale`` if the
        step's multiplier is not the one they used (or a try failed), then commit every unit's spares.
        Raises with nothing committed: step() again redoes the whole step (zero_grad() drops it)."""
        spec = self._spec
        try:
            if self.pipeline.running:
                self.last_stats = self.pipeline.finish()
            redo = spec["failed"] or grad_scale != spec["scale"]
            if redo:
                t0 = time.perf_counter()
                self._begin(spec["hyper"])
                try:
                    for unit in spec["units"]:
                        for job in self._jobs(unit, grad_scale, spare=True):
                            self.pipeline.submit(job)
                except BaseException:
                    self.pipeline.abort()
                    raise
                # the step's stats: the speculation's (its update start times say what ran in backward),
                # with the redo's Adam and I/O waits added
                first, redone = self.last_stats, self.pipeline.finish()
                self.last_stats = {**first, **{k: first.get(k, 0.0) + redone[k] for k in
                                               ("adam_s", "swap_in_wait_s", "swap_out_wait_s")}}
                spec["redo_s"] = time.perf_counter() - t0
                spec["redo_adam_s"] = redone["adam_s"]
        except BaseException:
            spec["failed"] = True
            raise
        self._commit(spec["units"])
        self._spec = None
        self._unclipped = not redo
        self._outcome = {"speculated": True, "committed": True, "redone": redo,
                         "redo_s": spec.get("redo_s", 0.0), "redo_adam_s": spec.get("redo_adam_s", 0.0)}

    def _commit(self, units: list) -> None:
        """The speculative update is final: spares swapped in, consumed gradients dropped, (stages 1-2)
        new parameters all-gathered."""
        classes = spare_classes()
        for unit in units:
            unit.shard.commit_spares(classes)
            unit.updated, unit.chunks_updated = True, len(unit.shard.chunks())
        self._drop_grads(units)
        if self.policy.gather_after_step:
            for unit in units:
                self.gather_updated(unit, unit.shard.get(TensorClass.PARAM))
        while self._post_gathers:
            self._post_gathers.popleft().wait()

    def _drop_grads(self, units: list) -> None:
        """Gradients kept for a redo are dead once the step is decided (the next fold overwrites them)."""
        for unit in units:
            for c in range(len(unit.shard.chunks())):
                for key in unit.shard.consumed_after_update(c):
                    with contextlib.suppress(StoreError):   # a pinned copy: left to be overwritten unread
                        self.store.discard(key, Tier.HOST)

    def _drop_speculation(self, outcome: dict | None) -> None:
        """Forget the step's speculation (nothing of it was committed): its updates are stopped."""
        if self._spec is None:
            return
        units, self._spec = self._spec["units"], None
        self.pipeline.abort()
        self._drop_grads(units)
        self._outcome = outcome

    def skip_step(self) -> None:
        """fp16 overflow: the step is skipped; a speculation's updates are dropped."""
        if self.speculation is not None:
            self._unclipped = False
            self._drop_speculation({"speculated": True, "committed": False, "redone": False, "skipped": True})

    def _jobs(self, unit, grad_scale: float, spare: bool = False) -> list:
        """``unit``'s jobs not yet done this step: one per chunk of its shard (one when unchunked,
        named after the unit; else ``name#chunk``). Its gradient shard must be final. ``spare``: a
        speculative update's jobs (see :mod:`infinity.zero.speculation`): written fields go to the
        shard's spares, read from the current copies, and the gradient is kept."""
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
                      for name, cls in _WRITTEN_FIELDS.items()}
            sources: dict = {}
            if spare:   # written into the spares; Adam reads the old values of all but a new parameter
                for name, cls in _WRITTEN_FIELDS.items():
                    if fields[name] is None:
                        continue
                    if name != "param_out" or self.split_master:
                        sources[name] = fields[name]
                    fields[name] = s.spare_field(cls, c)
            jobs.append(ShardJob(
                unit.name if chunks == [None] else f"{unit.name}#{c}",
                fields["master"], fields["exp_avg"], fields["exp_avg_sq"], s.job_field(TensorClass.GRAD, c),
                fields["param_out"],
                [(g, max(a, lo) - lo, min(b, hi) - lo) for g, a, b in ranges if max(a, lo) < min(b, hi)],
                on_done, grad_scale=grad_scale,
                # a speculative job keeps its gradient: a redo reads it (from the disk, where the host
                # cannot hold every kept gradient beside the parameters the next forward reads)
                discard=() if spare else s.consumed_after_update(c), write_home=s.kept_for_redo(c) if spare else (),
                drop=s.spare_drops(c) if spare else s.dropped_after_update(c), master_is_remainder=self.split_master,
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

    def abort_step(self) -> None:
        """Drop a running pipeline (a checkpoint load replaces every shard)."""
        self._spec = None
        self.pipeline.abort()
        self.partial_overlapped_update = False
        while self._post_gathers:
            self._post_gathers.popleft().wait()
        if self.overlap is not None:
            self.overlap.end_launched()
            self.overlap.abort()
        self._launched_stats = self._settled_update = None

    # ------------------------------------------------------------ optimizer.overlap_backward

    def unit_final(self, unit, grad_scale: float) -> None:
        """A unit's gradient shard is folded (stages 2-3); with overlap its update may start now."""
        if self.overlap is not None:
            self._submit(self.overlap.unit_final(unit, during_flush=self._flushing), grad_scale)

    def _submit(self, units: list, grad_scale: float) -> None:
        for unit in units:
            if self.overlap.starts_step():
                hyper = self._begin()
                if self.speculation is not None:   # a speculating step's first unit
                    self._spec = {"scale": grad_scale, "units": [], "hyper": hyper, "failed": False}
            self.overlap.submitting(unit)
            if self._spec is not None:
                self._spec["units"].append(unit)
            for job in self._jobs(unit, grad_scale, spare=self._spec is not None):
                self.pipeline.submit(job)

    @contextlib.contextmanager
    def flushing(self):
        """Units made final by the end-of-backward flush wait for its end (stage 3: the root is released)."""
        self._flushing = True
        try:
            yield
        finally:
            self._flushing = False

    def end_backward(self, grad_scale: float) -> None:
        """Backward is done; ``grad_scale`` is the multiplier a speculation uses (1, or fp16's unscale)."""
        self._expected_scale = grad_scale
        if self.overlap is not None:
            self._submit(self.overlap.end_backward(), grad_scale)
            self.overlap.backward_done()

    def abort_backward(self) -> None:
        """The backward raised: stop updates it had started; some may be done (the state is then newer
        than the step count says, and only a checkpoint load makes it whole again)."""
        if self.overlap is None:
            return
        began = self.overlap.abort()
        self.pipeline.abort()
        if self._spec is not None:   # a speculation wrote only spares: the state is the last step's
            self._drop_speculation({"speculated": True, "committed": False, "redone": False, "aborted": True})
            return
        self.partial_overlapped_update = self.partial_overlapped_update or began

    def begin_backward(self, sync: bool) -> None:
        """A backward is starting (``sync`` False: inside ``no_sync()``); refused while the last one's
        update waits for step(); a launched update is finished first (the backward writes gradients)."""
        if self.overlap is not None:
            self.settle()
            self.overlap.check_new_backward()
            if self.speculation is not None and self.overlap.first_backward():
                self.overlap.speculating = self.speculation.speculate()
                for unit in self.units:
                    unit.shard.set_step_speculates(self.overlap.speculating)
            self.overlap.begin_backward(sync)

    def new_step(self) -> None:
        """Gradients were zeroed: the next backward is the step's first (a speculative step that
        failed in step() is dropped: the state is the last committed step's)."""
        if self._spec is not None:
            self._drop_speculation(None)
            self.overlap.abort()   # its units no longer wait for a step
        if self.overlap is not None:
            self.overlap.new_step()

    def check_gather(self, unit) -> None:
        """Before ``unit`` is gathered: a launched update of it is waited for; one running in backward
        is refused (a forward before optimizer.step())."""
        if self.overlap is not None:
            self.wait_unit(unit)
            self.overlap.check_gather(unit)

    def check_clip(self) -> None:
        if self.overlap is not None and self.overlap.phase is not OverlapPhase.IDLE and self._spec is None:
            raise RuntimeError(f"clip_grad_norm_() on rank {self.rank} with optimizer.overlap_mode backward: "
                               "the update ran during backward, but clipping needs every gradient before any "
                               "update; set optimizer.overlap_mode next_forward or speculative (or auto "
                               "with schedule.clip_grad_norm set) to clip")

    def updating(self, index: int) -> bool:
        """Whether unit ``index``'s update has begun this step (it is not to be gathered or prefetched)."""
        return self.overlap is not None and self.overlap.updating(index)

    def pins_beside_backward(self) -> bool:
        """Whether an overlapped update may hold host room pinned while backward folds gradients (the
        reducer then finishes each fold at once: see :class:`~infinity.zero.grads.GradReducer`). The
        backward mode, from the step's first backward on (folds still in flight when the pipeline starts
        would pin room it cannot wait for); next_forward finishes its launched update before a backward."""
        return self.overlap is not None and not self.launches

    def with_room(self, attempt):
        """A store operation on the caller's thread. With overlap it may wait for host room the running
        update holds pinned, and it writes home (spills) gradients that wait unwritten in host memory for
        their update (``Placement.defer_grad_writes``) when only they hold the room: from the step's first
        backward on, before any update has run (with accumulation the earlier backwards' gradients fill
        the host tier). Without overlap nothing else pins or defers host copies while backward runs."""
        if self.overlap is None:
            return attempt()
        return self.pipeline.wait_for_room(attempt)

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
        if self.overlap is not None:
            last_step["offload"].update(self.overlap.end_step(self.last_stats))
            if self.speculation is not None:
                outcome = self._outcome or {"speculated": False}
                if self._unclipped is not None:
                    self.speculation.record(outcome["speculated"], self._unclipped)
                # what the next step does: speculate when calm >= calm_needed
                last_step["offload"]["speculation"] = {**outcome, **self.speculation.state()}
                self._outcome, self._unclipped = None, None
            if self._settled_update is not None:   # the previous step's launched update, waited for in this one
                last_step["offload"]["previous_update"] = self._settled_update
                self._settled_update = None
            if self.pending:   # its times are filled in when the next forward (or a save) has waited for it
                last_step["offload"]["update_deferred"] = True
                self._launched_stats = last_step["offload"]
        self.last_stats = {}
        self._store_mark = now
        self.store.trim_host_buffers()

    def _host_resident_bytes(self) -> int:
        """NVMe-placed chunks homed in host memory (``offload.host_resident_bytes``): fixed at initialize."""
        if self._resident is None:
            self._resident = sum(u.shard.resident_bytes() for u in self.units)
        return self._resident

    def _store_counters(self) -> dict:
        s = self.store.stats()
        return {"moved": dict(s["moved_bytes"]), "wait_s": s["wait_s"], "peak": s["peak_bytes"],
                "spills": s["spills"]["host"], "evictions": dict(s["evictions"])}
