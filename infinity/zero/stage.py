"""What a ZeRO stage keeps sharded, decided once: a frozen policy of named booleans.

The engine, the gradient path and the update consult these names instead of
comparing stage numbers, so what a stage *does* is written in one place:

=====  ========  ===============  ==============  =============  ==================
stage  sharded   all_reduce_      reduce_scatter  shard_params   gather_after_step
                 grads            _in_backward
=====  ========  ===============  ==============  =============  ==================
0      no        yes (buckets)    no              no             no
1      yes       no               no (at step)    no             yes
2      yes       no               yes             no             yes
3      yes       no               yes             yes            no
=====  ========  ===============  ==============  =============  ==================
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StagePolicy"]


@dataclass(frozen=True)
class StagePolicy:
    """Built from ``zero.stage`` by :meth:`of`; every field is derived from it."""

    stage: int
    sharded: bool                     # each rank owns its shard of every unit (stage 0: the whole unit)
    all_reduce_grads: bool            # gradients all-reduced in buckets as backward finishes them (DDP)
    reduce_scatter_at_step: bool      # one reduce-scatter per unit when the step begins (stage 1)
    reduce_scatter_in_backward: bool  # each unit reduce-scattered as its backward ends, only the shard kept
    shard_params: bool                # parameters sharded; gathered for each unit's forward and backward
    gather_after_step: bool           # full parameters kept; updated shards all-gathered after the step

    @classmethod
    def of(cls, stage: int) -> "StagePolicy":
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero.stage must be 0, 1, 2 or 3, got {stage!r}")
        return cls(stage=stage, sharded=stage >= 1, all_reduce_grads=stage == 0,
                   reduce_scatter_at_step=stage == 1, reduce_scatter_in_backward=stage >= 2,
                   shard_params=stage == 3, gather_after_step=stage in (1, 2))

    @property
    def grads_in_arena(self) -> bool:
        """Full gradients live in one resident arena summed over micro-batches (stages 0-1); else
        each unit's full gradient lives only through its backward and a gradient shard is kept."""
        return not self.reduce_scatter_in_backward
