"""``optimizer.update_at: next_forward``: ``optimizer.step()`` launches the update; the next forward waits per unit.

What needs every gradient first (the clip norm, fp16's overflow) is known when
backward ends, so ``optimizer.step()`` finishes the gradients (overflow: the
step is skipped, nothing launched), then launches every unit's update in
forward order (root first) and returns. The next forward waits, unit by unit,
for that unit's update (and at stages 1-2 its updated-shard all-gather) just
before using it (:meth:`UpdateAtNextForward.before_use`). Exact: each unit's
update is the plain step's, only later. A backward, ``gathered()``, a
checkpoint save, ``state_dict()``, ``close()`` wait for the rest first
(:meth:`~UpdateAtNextForward.drain`). An update that fails there raises at that
point with the step counted but not whole: as after a backward that raised
mid-update, only a checkpoint load makes the state whole.
"""

from __future__ import annotations

import time

from infinity.zero.units import UpdateMark
from infinity.zero.update import UpdateSchedule

__all__ = ["UpdateAtNextForward"]


class UpdateAtNextForward(UpdateSchedule):
    """The launched update and which units the next forward still waits for (see the module doc)."""

    name = "next_forward"
    overlaps = True
    waits_before_use = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending = False            # a launched update runs: some unit not yet waited for, or its tail
        self._forward_wait_s = 0.0      # how long the callers waited for the launched update
        self._launched_stats: dict | None = None   # the launched step's offload stats, completed when drained
        self._drained_stats: dict | None = None    # ... and those times once complete, for the next end_step

    def _launches(self) -> bool:
        """Whether this step's update is launched for the next forward (a speculative schedule decides per step)."""
        return True

    # ------------------------------------------------------------ events

    def begin_backward(self, sync: bool) -> None:
        self.drain()   # the backward writes gradients the launched update reads

    def step(self, grad_scale: float) -> None:
        if not self._launches():
            super().step(grad_scale)
            return
        try:
            self._finish_earlier_attempt()
            self._launch(grad_scale)
        finally:
            if not self.pending:   # a launched update's units are waited for by unit, not marked
                self._mark_updated()
            self._wait_gathers()

    def _launch(self, grad_scale: float) -> None:
        """Start every unit not yet updated, in forward order (the root, then the units); returns at once."""
        order = sorted((u for u in self.units if not u.updated), key=lambda u: (not u.is_root, u.index))
        self._begin()
        self.pending = True
        self._forward_wait_s = 0.0
        try:
            for unit in order:
                jobs = self.jobs(unit, grad_scale)
                unit.set_update_mark(UpdateMark.LAUNCHED, [job.name for job in jobs])   # before_use waits
                for job in jobs:
                    self.pipeline.submit(job)
        except BaseException:
            self.pipeline.abort()   # what was updated stays marked (step's finally): step() again finishes it
            self._end_launch()
            raise

    def before_use(self, unit) -> None:
        """Wait for ``unit``'s launched update, written home and (stages 1-2) all-gathered; a no-op once
        it has been. The last unit waited for drains the rest (the step's stats are then complete)."""
        if unit.update_mark is not UpdateMark.LAUNCHED:
            return
        t0 = time.perf_counter()
        try:
            self.pipeline.wait_for(unit.launched_jobs)
            self._wait_gathers()   # in job order: this unit's gather is the newest
        except BaseException as e:
            self._launch_failed(e)
            raise
        finally:
            self._forward_wait_s += time.perf_counter() - t0
        unit.set_update_mark(UpdateMark.NONE)
        if not any(u.update_mark is UpdateMark.LAUNCHED for u in self.units):
            self.drain()

    def drain(self) -> None:
        """Wait for the rest of a launched update; a no-op when none runs. At stages 1-2 it joins the
        updated shards' all-gathers: a collective, every rank calls it."""
        if not self.pending:
            return
        t0 = time.perf_counter()
        try:
            self.last_stats = self.pipeline.finish() if self.pipeline.running else {}
            self._wait_gathers()
        except BaseException as e:
            self._launch_failed(e)
            raise
        self._forward_wait_s += time.perf_counter() - t0
        self._end_launch()
        if self._launched_stats is not None:   # the launched step's stats, now that its update is done
            done = dict(adam_s=self.last_stats.get("adam_s", 0.0),
                        swap_in_wait_s=self.last_stats.get("swap_in_wait_s", 0.0),
                        swap_out_wait_s=self.last_stats.get("swap_out_wait_s", 0.0),
                        update_wait_s=self._forward_wait_s)   # how long the caller waited for it after step()
            self._launched_stats.update(done)
            self._launched_stats = None
            self._drained_stats = done   # reported with the step that waited for it (end_step)
        self.last_stats = {}

    def _end_launch(self) -> None:
        self.pending = False
        self._clear_marks(UpdateMark.LAUNCHED)

    def _launch_failed(self, error: BaseException) -> None:
        """A launched update raised: the step was counted but is not whole (some units updated)."""
        self.pipeline.abort()
        self._wait_gathers()
        self._end_launch()
        self.partial_update = True
        if hasattr(error, "add_note"):
            error.add_note(f"infinity: the update optimizer.step() launched on rank {self.rank} "
                           "(optimizer.update_at next_forward) failed part-way; the state is newer than the "
                           "step count says: load the last checkpoint")

    def abort_backward(self) -> None:
        self.pipeline.abort()   # nothing of a launched update runs in a backward (begin_backward drained it)

    def abort(self) -> None:
        super().abort()
        self._end_launch()
        self._launched_stats = self._drained_stats = None

    def _step_stats(self, offload: dict) -> None:
        offload.update(overlapped=True, update_at=self.name)
        offload.setdefault("submitted_in_backward", 0)
        offload.setdefault("updates_before_backward_end", 0)
        super()._step_stats(offload)
        if self._drained_stats is not None:   # the previous step's launched update, waited for in this one
            offload["previous_update"] = self._drained_stats
            self._drained_stats = None
        if self.pending:   # its times are filled in when the next forward (or a save) has waited for it
            offload["update_deferred"] = True
            self._launched_stats = offload
