"""``optimizer.update_at: backward``: each unit's update runs during the step's last backward.

At stage >= 2 a unit's gradient shard is final once the step's last backward
has folded its reduce-scatter into it (:class:`~infinity.zero.grad_folds.FoldedGrads`).
From then on nothing in that backward reads or writes the unit's shards, so
its Adam update (swap-in of master / moments / gradient, CPU Adam, write-back)
can run on the pipeline threads while backward goes on with the units before
it. On the NVMe path the step is mostly disk I/O and the disk is idle during
backward: the overlap hides it. ``optimizer.step()`` then only waits for the
last updates and (stage 2) all-gathers the new parameters.

With gradient accumulation the first ``schedule.accum_steps - 1`` backwards
since the step only fold their gradients (as at ``step``) and the last one
updates; ``engine.no_sync()`` (or ``set_requires_gradient_sync(False)``) marks
a backward as not the last explicitly. A step that comes after fewer backwards
than expected updates every unit in ``step()`` (exact, not overlapped); one
more backward after the last is refused. No ``clip_grad_norm_`` and no fp16
(both need every gradient before any update); the lr is read when the last
backward starts updating.

Order of submission: units whose shard is final while backward runs are
submitted at once; the root unit (stage 3: gathered for the whole backward)
and units reduced by the end-of-backward flush are submitted after it, in unit
order. The order is the same on every rank (it follows the reduce-scatters),
so the stage-2 all-gathers that the pipeline's ``on_done`` launches, on the
caller's thread, match across ranks.

A backward that raises part-way leaves the units already updated updated, and
the step uncounted (:attr:`UpdateSchedule.partial_update`): the engine then
refuses ``zero_grad`` and the step until a checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
import enum
import time

from infinity.transitions import Transitions
from infinity.zero.units import UpdateMark
from infinity.zero.update import UpdateSchedule

__all__ = ["BackwardPhase", "UpdateInBackward", "SECOND_BACKWARD"]

SECOND_BACKWARD = ("optimizer.update_at backward applies the update in the step's last backward (schedule.accum_steps "
                   "backwards per step, or the first outside engine.no_sync()); set schedule.accum_steps to the "
                   "backwards per step, or wrap the earlier ones in engine.no_sync()")


class BackwardPhase(enum.Enum):
    IDLE = "idle"                  # no unit submitted since the last step
    UPDATING = "updating"          # the step's last backward runs; final units are being updated
    AWAITING_STEP = "awaiting"     # backward done, every unit submitted; optimizer.step() finishes


_MOVES = Transitions("update in backward", {
    BackwardPhase.IDLE: {BackwardPhase.UPDATING},
    BackwardPhase.UPDATING: {BackwardPhase.AWAITING_STEP, BackwardPhase.IDLE},   # idle: the backward raised
    BackwardPhase.AWAITING_STEP: {BackwardPhase.IDLE},
})


class UpdateInBackward(UpdateSchedule):
    """Which units of the step's last backward are final, and their updates submitted as they become so
    (see the module doc)."""

    name = "backward"
    overlaps = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase = BackwardPhase.IDLE
        self._backwards = 0                # backwards since the last step (or zero_grad)
        self._last_backward = False        # the running backward is the step's last: it updates
        self._deferred: list = []          # units final now, submitted at the end of backward
        self._flushing = False             # the end-of-backward flush runs
        self._backward_end_s: float | None = None
        self._submitted_in_backward = 0

    def _go(self, phase: BackwardPhase) -> None:
        self.phase = _MOVES.check(self.phase, phase, f"rank {self.rank}")

    def _updates_in_backward(self) -> bool:
        """Whether this step's last backward updates (a speculative schedule decides per step)."""
        return True

    # ------------------------------------------------------------ events

    def begin_backward(self, sync: bool) -> None:
        self._check_new_backward()
        self._count_backward(sync)

    def _check_new_backward(self) -> None:
        if self.phase is BackwardPhase.AWAITING_STEP:
            raise RuntimeError(f"backward() on rank {self.rank} before optimizer.step(): {SECOND_BACKWARD}")

    def _count_backward(self, sync: bool) -> None:
        """The ``accum_steps``-th backward since the step (outside ``no_sync()``) is the last: it updates."""
        self._backwards += 1
        self._last_backward = self._updates_in_backward() and sync and self._backwards >= self.accum_steps

    def unit_final(self, unit, grad_scale: float) -> None:
        if not self._last_backward:
            return
        if unit.is_root or self._flushing:
            self._deferred.append(unit)   # in use until backward ends, or final only in its flush
            return
        self._submitted_in_backward += 1
        self._submit([unit], grad_scale)

    @contextlib.contextmanager
    def flushing(self):
        self._flushing = True
        try:
            yield
        finally:
            self._flushing = False

    def end_backward(self, grad_scale: float) -> None:
        if self._last_backward:
            self._backward_end_s = time.perf_counter()
            deferred, self._deferred = sorted(self._deferred, key=lambda u: u.index), []
            self._submit(deferred, grad_scale)
        if self.phase is BackwardPhase.UPDATING:
            self._go(BackwardPhase.AWAITING_STEP)

    def _submit(self, units: list, grad_scale: float) -> None:
        for unit in units:
            if self.phase is BackwardPhase.IDLE:   # the step's first unit: the pipeline starts
                self._start_step(grad_scale)
                self._go(BackwardPhase.UPDATING)
            unit.set_update_mark(UpdateMark.BEGUN)   # not gathered until the step ends
            for job in self._unit_jobs(unit, grad_scale):
                self.pipeline.submit(job)

    def _start_step(self, grad_scale: float) -> None:
        self._begin()

    def _unit_jobs(self, unit, grad_scale: float) -> list:
        return self.jobs(unit, grad_scale)

    def check_gather(self, unit) -> None:
        """A unit whose update runs must not be gathered (it would read a shard Adam is writing): that
        is a forward (or ``gathered()``) before optimizer.step()."""
        super().check_gather(unit)
        if unit.update_mark is UpdateMark.BEGUN:
            raise RuntimeError(f"forward/backward on rank {self.rank} gathers unit {unit.name!r} before "
                               f"optimizer.step(), while its update runs: {SECOND_BACKWARD}")

    def check_clip(self) -> None:
        if self.phase is not BackwardPhase.IDLE:
            raise RuntimeError(f"clip_grad_norm_() on rank {self.rank} with optimizer.update_at backward: "
                               "the update ran during backward, but clipping needs every gradient before any "
                               "update; set optimizer.update_at next_forward or speculative (or auto "
                               "with schedule.clip_grad_norm set) to clip")

    def abort_backward(self) -> None:
        """Some updates may be done: the state is then newer than the step count says, and only a
        checkpoint load makes it whole again."""
        began = self._reset_backward()
        self.pipeline.abort()
        self.partial_update = self.partial_update or began

    def _reset_backward(self) -> bool:
        """Forget the step's backwards and submissions; True if some unit's update had begun."""
        began = self._clear_marks(UpdateMark.BEGUN)
        self._deferred = []
        self._backward_end_s, self._submitted_in_backward = None, 0
        self._backwards, self._last_backward = 0, False
        if self.phase is not BackwardPhase.IDLE:
            self._go(BackwardPhase.IDLE)
        return began

    def new_step(self) -> None:
        self._backwards, self._last_backward = 0, False
        super().new_step()

    def abort(self) -> None:
        super().abort()
        self._reset_backward()

    def _step_stats(self, offload: dict) -> None:
        starts = self.last_stats.get("update_start_s", [])
        end = self._backward_end_s
        offload.update(overlapped=True, update_at=self.name, submitted_in_backward=self._submitted_in_backward,
                       # updates the pipeline began while backward still ran
                       updates_before_backward_end=sum(1 for t in starts if end is not None and t < end))
        if self.phase is BackwardPhase.AWAITING_STEP:
            self._go(BackwardPhase.IDLE)
        self._backward_end_s, self._submitted_in_backward = None, 0
        self._backwards, self._last_backward = 0, False
        self._clear_marks(UpdateMark.BEGUN)
        super()._step_stats(offload)
