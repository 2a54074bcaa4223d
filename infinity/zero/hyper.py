"""Each param group's AdamW settings for the step being taken, and the step counts behind them.

The user's optimizer (:class:`~infinity.zero.optimizer.ZeroAdamW`) holds the
param-group dicts, which LR schedulers change between steps; this object holds
the same dicts (not copies) and each group's step count, which only the engine
may advance: a step counts once every unit is updated, never when it fails
part-way (see :mod:`infinity.zero.lifecycle`).
"""

from __future__ import annotations

__all__ = ["GroupHyper"]


class GroupHyper:
    """``param_groups``: the optimizer's group dicts; ``group_steps``: steps taken per group; ``skipped_steps``:
    fp16 steps skipped for overflow (not counted in ``group_steps``)."""

    def __init__(self, param_groups: list):
        self.param_groups = param_groups
        self.group_steps = [0] * len(param_groups)
        self.skipped_steps = 0

    def for_step(self) -> list:
        """Every group's AdamW settings for the step being taken (its count not yet advanced), as now."""
        return [dict(step=steps + 1, lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
                for g, steps in zip(self.param_groups, self.group_steps)]

    def count_step(self) -> None:
        """The step completed: every group has taken one more."""
        for i in range(len(self.group_steps)):
            self.group_steps[i] += 1
