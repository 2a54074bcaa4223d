"""``optimizer.overlap_backward``: each unit's optimizer update starts during backward.

At stage >= 2 a unit's gradient shard is final once its reduce-scatter has been
folded into it (:class:`~infinity.zero.grads.GradReducer`), provided the step has
a single backward. From then on nothing in that backward reads or writes the
unit's shards, so its Adam update (swap-in of master / moments / gradient, CPU
Adam, write-back) can run on the pipeline threads while backward goes on with
the units before it. On the NVMe path the step is mostly disk I/O and the disk
is idle during backward: the overlap hides it. ``optimizer.step()`` then only
waits for the last updates and (stage 2) all-gathers the new parameters.

What it costs: one backward per step (gradient accumulation would need the
update to wait for the last micro-batch), no ``clip_grad_norm_`` and no fp16
(both need every gradient before any update), and hyper-parameters are fixed
when the first unit is submitted (set the lr before ``backward()``). A backward
that raises part-way leaves the units already updated updated, and the step
uncounted: the engine then refuses ``zero_grad`` and the step until a
checkpoint is loaded (the state is newer than any checkpoint, but not a whole step).

Order of submission: units whose shard is final while backward runs are
submitted at once; the root unit (stage 3: gathered for the whole backward) and
units reduced by the end-of-backward flush are submitted after it, in unit
order. The order is the same on every rank (it follows the reduce-scatters), so
the stage-2 all-gathers that the pipeline's ``on_done`` launches, on the
caller's thread in ``finish()``, match across ranks.
"""

from __future__ import annotations

import enum
import time

from infinity.transitions import Transitions

__all__ = ["OverlapPhase", "OverlappedStep"]

SECOND_BACKWARD = ("optimizer.overlap_backward applies the update in backward: one backward per step; "
                   "use overlap_backward: false for gradient accumulation")


class OverlapPhase(enum.Enum):
    IDLE = "idle"                  # no unit submitted since the last step
    UPDATING = "updating"          # backward runs; final units are being updated
    AWAITING_STEP = "awaiting"     # backward done, every unit submitted; optimizer.step() finishes


_MOVES = Transitions("overlapped step", {
    OverlapPhase.IDLE: {OverlapPhase.UPDATING},
    OverlapPhase.UPDATING: {OverlapPhase.AWAITING_STEP, OverlapPhase.IDLE},   # idle: the backward raised
    OverlapPhase.AWAITING_STEP: {OverlapPhase.IDLE},
})


class OverlappedStep:
    """Which units of an overlapped step are final and when each is to be submitted.

    It decides, the caller acts: :meth:`unit_final` and :meth:`end_backward` return the units whose
    update is to start now, and the caller (:class:`~infinity.zero.update.ShardUpdate`) builds their
    jobs and submits them to its pipeline, starting the pipeline first when :meth:`starts_step` says so.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.phase = OverlapPhase.IDLE
        self._deferred: list = []          # units final now, submitted at the end of backward
        self._submitted: set = set()       # unit indices whose update this step has begun
        self._backward_end_s: float | None = None
        self._submitted_in_backward = 0

    def _go(self, phase: OverlapPhase) -> None:
        self.phase = _MOVES.check(self.phase, phase, f"rank {self.rank}")

    # ------------------------------------------------------------ driven by the engine

    def check_new_backward(self) -> None:
        """A backward is starting: refused while the last one's update waits for step()."""
        if self.phase is OverlapPhase.AWAITING_STEP:
            raise RuntimeError(f"backward() on rank {self.rank} before optimizer.step(): {SECOND_BACKWARD}")

    def updating(self, index: int) -> bool:
        """Whether unit ``index``'s update has begun this step (it is not to be prefetched)."""
        return index in self._submitted

    def check_gather(self, unit) -> None:
        """Stage 3: a unit whose update is running must not be gathered (it would read a shard
        Adam is writing): that is a forward (or ``gathered()``) before optimizer.step()."""
        if unit.index in self._submitted:
            raise RuntimeError(f"forward/backward on rank {self.rank} gathers unit {unit.name!r} before "
                               f"optimizer.step(), while its update runs: {SECOND_BACKWARD}")

    def unit_final(self, unit, during_flush: bool) -> list:
        """``unit``'s gradient shard is final for this step: ``[unit]`` if its update is to start now,
        ``[]`` if it waits for the end of backward."""
        if unit.is_root or during_flush:
            self._deferred.append(unit)
            return []
        self._submitted_in_backward += 1
        return [unit]

    def end_backward(self) -> list:
        """Backward is done (every reduction folded in): the remaining units to submit, in unit order."""
        self._backward_end_s = time.perf_counter()
        deferred, self._deferred = sorted(self._deferred, key=lambda u: u.index), []
        return deferred

    def starts_step(self) -> bool:
        """A unit is about to be submitted: True if it is the step's first (the pipeline is to be started)."""
        return self.phase is OverlapPhase.IDLE

    def submitting(self, unit) -> None:
        """``unit``'s update is being submitted (call before its jobs are)."""
        if self.phase is OverlapPhase.IDLE:
            self._go(OverlapPhase.UPDATING)
        self._submitted.add(unit.index)

    def backward_done(self) -> None:
        """The end of backward's units are submitted: the step waits for ``optimizer.step()``."""
        self._go(OverlapPhase.AWAITING_STEP)

    def abort(self) -> bool:
        """The backward raised: drop what was deferred; True if some unit's update had begun (the
        pipeline is aborted by the engine)."""
        began = bool(self._submitted)
        self._deferred, self._submitted = [], set()
        self._backward_end_s, self._submitted_in_backward = None, 0
        if self.phase is not OverlapPhase.IDLE:
            self._go(OverlapPhase.IDLE)
        return began

    def end_step(self, optimizer_stats: dict) -> dict:
        """The step finished: back to idle; the step's overlap stats."""
        starts = optimizer_stats.get("update_start_s", [])
        end = self._backward_end_s
        stats = {"overlapped": True,
                 "submitted_in_backward": self._submitted_in_backward,
                 # updates the pipeline began while backward still ran
                 "updates_before_backward_end": sum(1 for t in starts if end is not None and t < end)}
        if self.phase is OverlapPhase.AWAITING_STEP:
            self._go(OverlapPhase.IDLE)
        self._backward_end_s, self._submitted_in_backward = None, 0
        self._submitted = set()
        return stats
