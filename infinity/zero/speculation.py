"""``optimizer.update_at: speculative``: update during backward before the clip norm is known, redo if wrong.

Clipping and fp16 need every gradient before any update, so without
speculation the update waits for the end of backward (``next_forward`` mode).
Speculation runs it during the step's last backward anyway, as the
``backward`` schedule does, with the gradient multiplier the step has before it
knows the norm: 1, or fp16's unscale ``1 / loss_scale``. What makes that safe
is where the updated state goes: each job writes its master, moments and
parameter into *spare* copies (a second store key per chunk, same home; a
spare tensor for a class kept in memory: one :class:`~infinity.zero.spares.SpareSet` per unit) and reads the
current ones without changing them. Gradients are kept until the step ends: in
host memory, or, where the host budget cannot hold them all beside what the next
forward reads, written home as each update is done and read back only by a redo
(:meth:`~infinity.zero.placement.UnitPlacement.writes_kept_grads`).
``optimizer.step()`` then compares the step's final multiplier (after
``clip_grad_norm_`` and fp16's unscale) with the one the speculation used:

- **equal** (no clipping, no overflow): the step *commits*: every spare becomes
  the current copy (a swap of key names, no bytes moved; a spare tensor is
  copied into place) and, at stages 1-2, the new parameters are all-gathered.
  The result is bitwise the plain step's: the same kernel on the same values
  with the same multiplier.
- **different** (clipped): the step is *redone*: every unit's update runs again
  from the untouched current state, with the final multiplier, into the spares
  (the plain step's arithmetic exactly, at the cost of one more update pass,
  not hidden by backward), then commits.
- **fp16 overflow**: the step is skipped; the spares are left as they are.

Nothing current is written before the commit, so a speculative step that
fails (ENOSPC writing a spare, an exception in backward, a rank killed) leaves
the state of the last committed step: ``zero_grad()`` drops the step, or
``optimizer.step()`` again redoes it whole. The cost is disk (or host memory,
for host-homed states) for one more copy of the updated classes, what
:func:`spare_classes` names; ``infinity estimate`` counts it.

Speculating on a run that clips every step would pay the redo every step, and
early training clips most steps. :class:`SpeculationPolicy` falls back to
``next_forward`` (exact, no redo, less overlap) after a redo, until the
multiplier has stayed at its unclipped value for a number of steps that
doubles with each failed attempt in a row (1, 2, 4, ... up to
:data:`MAX_CALM_STEPS`), and back to 1 once a speculation commits. All ranks
decide alike: the multiplier comes from the all-reduced norm and overflow flag.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from infinity.store import StoreError, Tier
from infinity.zero.placement import OPTIMIZER_CLASSES
from infinity.zero.spares import SpareSet
from infinity.zero.units import TensorClass
from infinity.zero.update_backward import UpdateInBackward
from infinity.zero.update_next_forward import UpdateAtNextForward

__all__ = ["SpeculationPolicy", "SpeculativeUpdate", "spare_classes", "MAX_CALM_STEPS"]

# the most unclipped steps the policy waits for, after failed speculations, before speculating again
MAX_CALM_STEPS = 32


def spare_classes() -> tuple:
    """The classes a speculative update writes into spares: the master, the moments and the parameter."""
    return (*OPTIMIZER_CLASSES, TensorClass.PARAM)


class SpeculationPolicy:
    """Whether the next step speculates, from what the last ones needed (see the module doc)."""

    def __init__(self, max_calm: int = MAX_CALM_STEPS):
        self.max_calm = max_calm
        self.calm_needed = 0    # unclipped steps to see before speculating again (0: speculating)
        self.calm = 0           # unclipped steps seen since the last failed speculation
        self._next_wait = 1     # calm_needed after the next failed speculation

    def speculate(self) -> bool:
        """Whether the step about to run its last backward speculates."""
        return self.calm >= self.calm_needed

    def record(self, speculated: bool, unclipped: bool) -> None:
        """A step ended; ``unclipped``: its final multiplier was the one a speculation would have used
        (nothing clipped, no fp16 overflow), i.e. a speculation would have committed."""
        if speculated and unclipped:
            self.calm_needed, self.calm, self._next_wait = 0, 0, 1
        elif speculated:
            self.calm_needed, self.calm = self._next_wait, 0
            self._next_wait = min(2 * self._next_wait, self.max_calm)
        else:
            self.calm = self.calm + 1 if unclipped else 0

    def state(self) -> dict:
        """For the step stats: how many unclipped steps the fallback still waits for (0: speculating)."""
        return {"calm_needed": self.calm_needed, "calm": self.calm}


class SpeculativeUpdate(UpdateInBackward, UpdateAtNextForward):
    """A step that speculates runs as :class:`UpdateInBackward` with spare jobs; one that does not, as
    :class:`UpdateAtNextForward` (:attr:`speculating`, decided before the step's first backward by
    :attr:`speculation`). ``step()`` commits the spares or redoes the update (see the module doc)."""

    name = "speculative"
    uses_spares = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.speculation = SpeculationPolicy()
        self.speculating = True             # this step updates in its last backward (else: next_forward)
        self._spec: _Speculation | None = None   # the running step's speculation
        self._outcome: dict | None = None   # how the step's speculation ended, for its stats
        self._unclipped: bool | None = None   # the step's multiplier was the one a speculation uses
        self._expected_scale = 1.0          # that multiplier (the engine's, at the end of backward)
        self.spares: dict = {}              # unit index -> SpareSet (prepare_unit)

    def prepare_unit(self, unit) -> None:
        """The unit's spares (:class:`SpareSet`) of what Adam writes, registered now (they wait until home)."""
        self.spares[unit.index] = SpareSet(unit.shard, spare_classes())

    def _updates_in_backward(self) -> bool:
        return self.speculating

    def _launches(self) -> bool:
        return not self.speculating

    # ------------------------------------------------------------ events

    def begin_backward(self, sync: bool) -> None:
        self.drain()   # a step that did not speculate launched its update: the backward writes gradients
        self._check_new_backward()
        if self._backwards == 0:   # the step's first backward: does this step speculate?
            self.speculating = self.speculation.speculate()
            for unit in self.units:
                unit.shard.set_step_speculates(self.speculating)
        self._count_backward(sync)

    def _start_step(self, grad_scale: float) -> None:
        self._spec = _Speculation(grad_scale, self._begin())

    def _unit_jobs(self, unit, grad_scale: float) -> list:
        self._spec.units.append(unit)
        return self.jobs(unit, grad_scale, spares=self.spares[unit.index])

    def end_backward(self, grad_scale: float) -> None:
        self._expected_scale = grad_scale
        super().end_backward(grad_scale)

    def step(self, grad_scale: float) -> None:
        if self._spec is None:
            self._unclipped = grad_scale == self._expected_scale
            super().step(grad_scale)   # next_forward's launch, or (fewer backwards than expected) the plain step
            return
        self._finish_speculation(grad_scale)

    def skip_step(self) -> None:
        self._unclipped = False
        self._drop_speculation({"speculated": True, "committed": False, "redone": False, "skipped": True})

    def check_clip(self) -> None:
        if self._spec is None:
            super().check_clip()

    def abort_backward(self) -> None:
        """A speculation wrote only spares: the state is the last step's."""
        if self._spec is None:
            super().abort_backward()
            return
        self._reset_backward()
        self._drop_speculation({"speculated": True, "committed": False, "redone": False, "aborted": True})

    def new_step(self) -> None:
        """A speculative step that failed in step() is dropped: the state is the last committed step's."""
        if self._spec is not None:
            self._drop_speculation(None)
            self._reset_backward()   # its units no longer wait for a step
        super().new_step()

    def abort(self) -> None:
        self._spec = None
        super().abort()

    # ------------------------------------------------------------ commit or redo

    def _finish_speculation(self, grad_scale: float) -> None:
        """Wait for the speculation's updates, redo them with ``grad_scale`` if the step's multiplier is
        not the one they used (or a try failed), then commit every unit's spares. Raises with nothing
        committed: step() again redoes the whole step (zero_grad() drops it)."""
        spec = self._spec
        try:
            if self.pipeline.running:
                self.last_stats = self.pipeline.finish()
            redo = spec.failed or grad_scale != spec.scale
            if redo:
                t0 = time.perf_counter()
                self._begin(spec.hyper)
                try:
                    for unit in spec.units:
                        for job in self.jobs(unit, grad_scale, spares=self.spares[unit.index]):
                            self.pipeline.submit(job)
                except BaseException:
                    self.pipeline.abort()
                    raise
                # the step's stats: the speculation's (its update start times say what ran in backward),
                # with the redo's Adam and I/O waits added
                first, redone = self.last_stats, self.pipeline.finish()
                self.last_stats = {**first, **{k: first.get(k, 0.0) + redone[k] for k in
                                               ("adam_s", "swap_in_wait_s", "swap_out_wait_s")}}
                spec.redo_s, spec.redo_adam_s = time.perf_counter() - t0, redone["adam_s"]
        except BaseException:
            spec.failed = True
            raise
        self._commit(spec.units)
        self._spec = None
        self._unclipped = not redo
        self._outcome = {"speculated": True, "committed": True, "redone": redo,
                         "redo_s": spec.redo_s, "redo_adam_s": spec.redo_adam_s}

    def _commit(self, units: list) -> None:
        """The speculative update is final: spares swapped in, consumed gradients dropped, (stages 1-2)
        new parameters all-gathered."""
        classes = spare_classes()
        for unit in units:
            self.spares[unit.index].commit(classes)
            unit.updated, unit.chunks_updated = True, len(unit.shard.chunks())
        self._drop_grads(units)
        if self.policy.gather_after_step:
            for unit in units:
                self.gather_updated(unit, unit.shard.get(TensorClass.PARAM))
        self._wait_gathers()

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
        units, self._spec = self._spec.units, None
        self.pipeline.abort()
        self._drop_grads(units)
        self._outcome = outcome

    def _step_stats(self, offload: dict) -> None:
        outcome = self._outcome or {"speculated": False}
        if self._unclipped is not None:
            self.speculation.record(outcome["speculated"], self._unclipped)
        super()._step_stats(offload)
        # what the next step does: speculate when calm >= calm_needed
        offload["speculation"] = {**outcome, **self.speculation.state()}
        self._outcome, self._unclipped = None, None


@dataclass
class _Speculation:
    """One step's speculation: the multiplier and hyper-parameters its updates used, the units submitted,
    whether a try failed, and a redo's times."""

    scale: float
    hyper: object
    units: list = field(default_factory=list)
    failed: bool = False
    redo_s: float = 0.0
    redo_adam_s: float = 0.0
