"""The engine's step lifecycle: one enum, one table of allowed moves (see :mod:`infinity.transitions`).

A training step is: one or more backward passes (gradient accumulation), the
reduction finished once (stage 1's reduce-scatter, fp16's overflow check,
clipping), then the optimizer update. ``zero_grad`` starts the next one.

Failure paths are states too, so an error never leaves the engine in a state
nothing can leave:

- a backward that raises part-way is noticed at the next call into the engine
  (its end-of-backward callback never runs): the engine waits out what it had
  launched, releases gathered units and moves to ABORTED. Its gradients are
  partial, so the step refuses them until ``zero_grad`` (the usual "catch the
  error, zero_grad, skip the batch" loop);
- an update that raises part-way goes back to REDUCED with each unit marked
  updated or not: ``optimizer.step()`` again finishes the same step (units
  already updated are not updated twice, writes that failed are retried); the
  step count and loss scale only move when the whole step is done.
"""

from __future__ import annotations

import enum

from infinity.transitions import Transitions

__all__ = ["StepPhase", "STEP_MOVES"]


class StepPhase(enum.Enum):
    IDLE = "idle"                # no gradient since the last step or zero_grad
    BACKWARD = "backward"        # a backward pass runs; its hooks move and reduce gradients
    ACCUMULATED = "accumulated"  # one or more backward passes done; another may follow, or the step
    REDUCED = "reduced"          # reduction complete, overflow known, unscale x clip factor fixed
    STEPPING = "stepping"        # optimizer.step() is updating the shards
    ABORTED = "aborted"          # a backward raised part-way: its gradients are partial until zero_grad


STEP_MOVES = Transitions("engine step", {
    StepPhase.IDLE: {StepPhase.BACKWARD},
    StepPhase.BACKWARD: {StepPhase.ACCUMULATED, StepPhase.ABORTED},
    StepPhase.ACCUMULATED: {StepPhase.BACKWARD, StepPhase.REDUCED, StepPhase.IDLE},
    StepPhase.REDUCED: {StepPhase.STEPPING, StepPhase.IDLE},
    StepPhase.STEPPING: {StepPhase.IDLE, StepPhase.REDUCED},
    StepPhase.ABORTED: {StepPhase.IDLE},
})
