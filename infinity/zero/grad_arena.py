"""Stages 0-1: every unit's full gradient is a view of one arena, summed over micro-batches in place.

Units are laid out in reverse order (roughly the order backward finishes them),
so a stage-0 bucket is a contiguous range of the arena: a bucket of
``zero.bucket_bytes`` is all-reduced once all its units are final, strictly in
bucket order, so every rank issues the same sequence of collectives. At stage 1
nothing is reduced in backward: :meth:`ArenaGrads.finish` reduce-scatters every
unit once per step, each output landing in the unit's gradient shard (a view of
the arena, hence a separate output buffer).
"""

from __future__ import annotations

import collections

import torch

from infinity.zero.grads import MAX_INFLIGHT, GradReducer
from infinity.zero.units import TensorClass

__all__ = ["ArenaGrads"]


class _Bucket:
    """Stage 0: a run of units whose gradients are all-reduced in one call."""

    def __init__(self, units, view):
        self.units, self.view = units, view
        self.ready = 0
        self.pending = None


class ArenaGrads(GradReducer):
    """The arena reducer (see the module doc); ``bucket_bytes``: stage 0's all-reduce bucket size."""

    def __init__(self, *args, bucket_bytes: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._bucket_bytes = bucket_bytes
        self.buckets: list = []
        self._bucket_of: dict = {}

    def build(self) -> None:
        total = sum(u.padded_numel for u in self.units)
        self.arena = torch.zeros(total, dtype=self.reduce_dtype, device=self.device)
        offset, run, run_lo = 0, [], 0
        itemsize = self.arena.element_size()
        for unit in reversed(self.units):
            unit.full_grad = self.arena[offset:offset + unit.padded_numel]
            lo = self.shard_rank * unit.shard_numel
            unit.shard.put(TensorClass.GRAD, unit.full_grad[lo:lo + unit.shard_numel])
            offset += unit.padded_numel
            run.append(unit)
            if (offset - run_lo) * itemsize >= self._bucket_bytes:
                self.buckets.append(_Bucket(run, self.arena[run_lo:offset]))
                run, run_lo = [], offset
        if run:
            self.buckets.append(_Bucket(run, self.arena[run_lo:offset]))
        self._bucket_of = {u.index: b for b in self.buckets for u in b.units}

    def _reduce(self, unit) -> None:
        self._final(unit)
        if self.policy.all_reduce_grads:
            self._bucket_of[unit.index].ready += 1
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # strictly in bucket order so every rank issues the same sequence of collectives
        for bucket in self.buckets:
            if bucket.pending is not None:
                continue
            if bucket.ready < len(bucket.units):
                return
            bucket.pending = self.coll.all_reduce(bucket.view, average=True, async_op=True)

    def _wait_all(self) -> None:
        for bucket in self.buckets:
            if bucket.pending is not None:
                pending, bucket.pending = bucket.pending, None
                pending.wait()
            bucket.ready = 0

    def _drop_backward(self) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.ready = None, 0

    def _complete_reduction(self) -> None:
        if not self.policy.reduce_scatter_at_step:
            return
        # launched together so the transport pipelines them; each output lands in the grad shard,
        # which is a view of the input, hence the separate output buffer
        pending = collections.deque()
        for unit in self.units:
            out = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=self.device)
            self.buffers.allocated(out.nbytes)
            pending.append(self.unit_comm.reduce_scatter(
                unit, out, unit.full_grad, then=lambda unit=unit, out=out: self._copy_out(unit, out)))
            while len(pending) > MAX_INFLIGHT:
                pending.popleft().wait()
        while pending:
            pending.popleft().wait()

    def _copy_out(self, unit, out: torch.Tensor) -> None:
        """Stage 1: a reduce-scatter's output lands in the gradient shard (a view of the arena)."""
        unit.shard.get(TensorClass.GRAD).copy_(out)
        self.buffers.freed(out.nbytes)

    def _note_unfolded_shards(self) -> None:
        for unit in self.units:   # in-memory shards: looked at now
            self._note_non_finite(unit.shard.get(TensorClass.GRAD))

    def zero(self) -> None:
        super().zero()
        for unit in self.units:
            unit.unwritten = {s.offset for s in unit.slots}
