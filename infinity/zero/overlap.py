"""``optimizer.overlap_backward``: each unit's optimizer update overlaps compute, with the same results.

Two places to overlap it (``optimizer.overlap_mode``, :meth:`Config.update_overlap`):

**backward.** At stage >= 2 a unit's gradient shard is final once the step's
last backward has folded its reduce-scatter into it
(:class:`~infinity.zero.grads.GradReducer`). From then on nothing in that
backward reads or writes the unit's shards, so its Adam update (swap-in of
master / moments / gradient, CPU Adam, write-back) can run on the pipeline
threads while backward goes on with the units before it. On the NVMe path the
step is mostly disk I/O and the disk is idle during backward: the overlap hides
it. ``optimizer.step()`` then only waits for the last updates and (stage 2)
all-gathers the new parameters. With gradient accumulation the first
``schedule.accum_steps - 1`` backwards since the step only fold their gradients
(as without overlap) and the last one updates; ``engine.no_sync()`` (or
``set_requires_gradient_sync(False)``) marks a backward as not the last
explicitly. A step that comes after fewer backwards than expected updates every
unit in ``step()`` (exact, not overlapped); one more backward after the last is
refused. No ``clip_grad_norm_`` and no fp16 (both need every gradient before
any update); the lr is read when the last backward starts updating.

**next_forward.** What needs every gradient first (the clip norm, fp16's
overflow) is known when backward ends, so ``optimizer.step()`` finishes the
gradients (overflow: the step is skipped, nothing launched), then launches
every unit's update in forward order (root first) and returns. The next
forward waits, unit by unit, for that unit's update (and at stage 1-2 its
updated-shard all-gather) just before using it. Exact: each unit's update is
the plain step's, only later. A backward, ``gathered()``, a checkpoint save,
``state_dict()``, ``close()`` wait for the rest first. An update that fails
there raises at that point with the step counted but not whole: as after a
backward that raised mid-update, only a checkpoint load makes the state whole.

**speculative** (:mod:`infinity.zero.speculation`). A step that speculates runs as
the backward mode does, but each update writes spare copies and keeps the
gradients, so clipping and fp16 are allowed: ``optimizer.step()`` commits the
spares or redoes the update from the untouched state. A step the policy does
not speculate on runs as next_forward (:attr:`OverlappedStep.speculating`, set
before the step's first backward).

A backward that raises part-way during a backward-mode update leaves the units
already updated updated, and the step uncounted: the engine then refuses
``zero_grad`` and the step until a checkpoint is loaded.

Order of submission (backward mode): units whose shard is final while backward
runs are submitted at once; the root unit (stage 3: gathered for the whole
backward) and units reduced by the end-of-backward flush are submitted after
it, in unit order. The order is the same on every rank (it follows the
reduce-scatters), so the stage-2 all-gathers that the pipeline's ``on_done``
launches, on the caller's thread, match across ranks.
"""

from __future__ import annotations

import enum
import time

from infinity.transitions import Transitions

__all__ = ["OverlapPhase", "OverlappedStep"]

SECOND_BACKWARD = ("optimizer.overlap_backward applies the update in the step's last backward (schedule.accum_steps "
                   "backwards per step, or the first outside engine.no_sync()); set schedule.accum_steps to the "
                   "backwards per step, or wrap the earlier ones in engine.no_sync()")


class OverlapPhase(enum.Enum):
    IDLE = "idle"                  # no unit submitted since the last step
    UPDATING = "updating"          # the step's last backward runs; final units are being updated
    AWAITING_STEP = "awaiting"     # backward done, every unit submitted; optimizer.step() finishes
    LAUNCHED = "launched"          # next_forward: step() launched every unit; the next forward waits per unit


_MOVES = Transitions("overlapped step", {
    OverlapPhase.IDLE: {OverlapPhase.UPDATING, OverlapPhase.LAUNCHED},
    OverlapPhase.UPDATING: {OverlapPhase.AWAITING_STEP, OverlapPhase.IDLE},   # idle: the backward raised
    OverlapPhase.AWAITING_STEP: {OverlapPhase.IDLE},
    OverlapPhase.LAUNCHED: {OverlapPhase.IDLE},   # every unit waited for (or the update failed / aborted)
})


class OverlappedStep:
    """Which units of an overlapped step are final and when each is to be submitted.

    It decides, the caller acts: :meth:`unit_final` and :meth:`end_backward` return the units whose
    update is to start now, and the caller (:class:`~infinity.zero.update.ShardUpdate`) builds their
    jobs and submits them to its pipeline, starting the pipeline first when :meth:`starts_step` says so.
    """

    def __init__(self, rank: int, mode: str = "backward", accum_steps: int = 1):
        self.rank, self.mode, self.accum_steps = rank, mode, accum_steps
        self.phase = OverlapPhase.IDLE
        self._backwards = 0                # backwards since the last step (or zero_grad)
        self._last_backward = False        # the running backward is the step's last: it updates
        self._deferred: list = []          # units final now, submitted at the end of backward
        self._submitted: set = set()       # unit indices whose update this step has begun
        self._backward_end_s: float | None = None
        self._submitted_in_backward = 0
        # mode speculative: whether this step updates in its last backward (else it runs as next_forward),
        # set by the caller before the step's first backward (infinity.zero.speculation)
        self.speculating = mode == "speculative"

    def _go(self, phase: OverlapPhase) -> None:
        self.phase = _MOVES.check(self.phase, phase, f"rank {self.rank}")

    # ------------------------------------------------------------ driven by the engine

    def check_new_backward(self) -> None:
        """A backward is starting: refused while the last one's update waits for step()."""
        if self.phase is OverlapPhase.AWAITING_STEP:
            raise RuntimeError(f"backward() on rank {self.rank} before optimizer.step(): {SECOND_BACKWARD}")

    def begin_backward(self, sync: bool) -> None:
        """A backward starts (after :meth:`check_new_backward`); ``sync`` False: inside ``no_sync()``,
        not the step's last. Backward mode: the ``accum_steps``-th backward since the step updates."""
        self._backwards += 1
        in_backward = self.mode == "backward" or (self.mode == "speculative" and self.speculating)
        self._last_backward = in_backward and sync and self._backwards >= self.accum_steps

    def first_backward(self) -> bool:
        """No backward has run since the last step (or zero_grad): the next one is the step's first."""
        return self._backwards == 0

    def new_step(self) -> None:
        """Gradients were zeroed: the next backward is the step's first again."""
        self._backwards, self._last_backward = 0, False

    def launched(self, units: list) -> None:
        """next_forward: ``step()`` submitted every unit in ``units``; each is in use until :meth:`settled`."""
        self._go(OverlapPhase.LAUNCHED)
        self._submitted = {u.index for u in units}

    def waiting(self, index: int) -> bool:
        """next_forward: unit ``index``'s launched update has not been waited for yet."""
        return self.phase is OverlapPhase.LAUNCHED and index in self._submitted

    def settled(self, index: int) -> bool:
        """next_forward: unit ``index``'s update is done and home; it may be gathered and prefetched.
        True once every launched unit is."""
        self._submitted.discard(index)
        return not self._submitted

    def end_launched(self) -> None:
        """next_forward: the launched step is done (or was dropped)."""
        self._submitted = set()
        if self.phase is OverlapPhase.LAUNCHED:
            self._go(OverlapPhase.IDLE)

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
        """``unit``'s gradient shard is final for this backward: ``[unit]`` if its update is to start now,
        ``[]`` if it waits for the end of backward (or for step(): not the step's last backward)."""
        if not self._last_backward:
            return []
        if unit.is_root or during_flush:
            self._deferred.append(unit)
            return []
        self._submitted_in_backward += 1
        return [unit]

    def end_backward(self) -> list:
        """Backward is done (every reduction folded in): the remaining units to submit, in unit order
        (none unless it was the step's last backward)."""
        if not self._last_backward:
            return []
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
        """The end of backward's units are submitted: after the step's last backward, the step waits for
        ``optimizer.step()``."""
        if self.phase is OverlapPhase.UPDATING:
            self._go(OverlapPhase.AWAITING_STEP)

    def abort(self) -> bool:
        """The backward raised: drop what was deferred; True if some unit's update had begun (the
        pipeline is aborted by the engine)."""
        began = bool(self._submitted) and self.phase is not OverlapPhase.LAUNCHED
        self._deferred, self._submitted = [], set()
        self._backward_end_s, self._submitted_in_backward = None, 0
        self._backwards, self._last_backward = 0, False
        if self.phase is not OverlapPhase.IDLE:
            self._go(OverlapPhase.IDLE)
        return began

    def end_step(self, optimizer_stats: dict) -> dict:
        """The step finished: back to idle; the step's overlap stats."""
        starts = optimizer_stats.get("update_start_s", [])
        end = self._backward_end_s
        stats = {"overlapped": True, "overlap_mode": self.mode,
                 "submitted_in_backward": self._submitted_in_backward,
                 # updates the pipeline began while backward still ran
                 "updates_before_backward_end": sum(1 for t in starts if end is not None and t < end)}
        if self.phase is OverlapPhase.AWAITING_STEP:
            self._go(OverlapPhase.IDLE)
        self._backward_end_s, self._submitted_in_backward = None, 0
        self._backwards, self._last_backward = 0, False
        if self.phase is not OverlapPhase.LAUNCHED:
            self._submitted = set()
        return stats
