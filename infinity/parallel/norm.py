"""The global gradient norm under tensor parallelism, counted once across both mesh axes.

A unit's flat gradient on a ``tp`` rank holds two kinds of elements: slices of
split parameters (each element exists on exactly one ``tp`` rank) and
replicated parameters (embeddings, norms, row biases: the same gradient on all
``T`` ``tp`` ranks). Summing squares over the whole world would count the
replicated ones ``T`` times, so each rank weights them by ``1 / T``; then one
all-reduce over the world (``dp`` x ``tp``) gives the norm of the full model's
gradient, the number ``torch.nn.utils.clip_grad_norm_`` computes on one process.
"""

from __future__ import annotations

import torch

__all__ = ["TensorParallelNorm"]


class TensorParallelNorm:
    """Per unit, this rank's shard-local ranges of replicated elements; :meth:`square_sum` weights them."""

    def __init__(self, units: list, tp, shard_rank: int):
        self.size = tp.size
        self.replicated: dict = {}
        for unit in units:
            base, end = shard_rank * unit.shard_numel, (shard_rank + 1) * unit.shard_numel
            ranges = []
            for slot in unit.slots:
                if tp.spec(slot.name) is not None:
                    continue
                lo, hi = max(slot.offset, base), min(slot.offset + slot.numel, end)
                if lo < hi:
                    ranges.append((lo - base, hi - base))
            self.replicated[unit.index] = ranges

    def square_sum(self, unit, grad: torch.Tensor) -> torch.Tensor:
        """Sum of squares of this shard, replicated elements counted ``1 / T``."""
        g = grad.float()
        total = g.pow(2).sum()
        rep = torch.zeros((), dtype=total.dtype, device=total.device)
        for lo, hi in self.replicated[unit.index]:
            rep += g[lo:hi].pow(2).sum()
        return (total - rep) + rep / self.size
