"""``optimizer.overlap_mode: speculative``: update during backward before the clip norm is known, redo if wrong.

Clipping and fp16 need every gradient before any update, so without
speculation the update waits for the end of backward (``next_forward`` mode).
Speculation runs it during the step's last backward anyway, as the
``backward`` mode does, with the gradient multiplier the step has before it
knows the norm: 1, or fp16's unscale ``1 / loss_scale``. What makes that safe
is where the updated state goes: each job writes its master, moments and
parameter into *spare* copies (a second store key per chunk, same home; a
spare tensor for a class kept in memory, see
:meth:`~infinity.zero.store_shard.StoreUnitShard.add_spares`) and reads the
current ones without changing them. Gradients are kept until the step ends: in
host memory, or, where the host budget cannot hold them all beside what the next
forward reads, written home as each update is done and read back only by a redo
(:meth:`~infinity.zero.placement.Placement.writes_kept_grads`).
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

from infinity.zero.placement import OPTIMIZER_CLASSES
from infinity.zero.units import TensorClass

__all__ = ["SpeculationPolicy", "spare_classes", "MAX_CALM_STEPS"]

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
