"""Stages 2-3: each unit reduce-scattered as soon as it is final, the result folded into its gradient shard.

A unit's full gradient lives only through its backward: once its last
parameter gradient arrives it is reduce-scattered (:attr:`unit_comm`) and the
output folded into the unit's gradient shard (:meth:`UnitShard.fold_grad`, in
memory or in the store), at most :data:`MAX_INFLIGHT` reductions in flight.

A gradient homed in the store leaves the device without blocking backward: its
copy runs on the store's device->host lane and the fold is left pending
(:mod:`infinity.zero.grad_staging`) in the rank's one queue of pending folds
(:attr:`FoldedGrads.staging`, the shards' :class:`~infinity.zero.grad_staging.FoldStaging`), which the
step empties before anything reads a gradient. Units whose reduced gradient
is in their shard are handed on in order (:meth:`FoldedGrads.take_folded`): an
overlapped update may start on them.
"""

from __future__ import annotations

import collections

import torch

from infinity.zero.grad_staging import FoldStaging
from infinity.zero.grads import MAX_INFLIGHT, GradReducer, norm_pieces, square_sum
from infinity.zero.units import TensorClass

__all__ = ["FoldedGrads"]


class FoldedGrads(GradReducer):
    """The per-unit fold reducer (see the module doc), with what only it uses:

    - ``norm_at_fold``: clipping is expected (``schedule.clip_grad_norm`` is set): from the
      ``accum_steps``-th backward since zero_grad on, each fold takes the squared sums of the gradient it
      leaves in the shard while that is in memory, so :meth:`clip` reads no stored gradient back (at
      2.7B with NVMe gradients, 5.4 GB a step); a later fold of the unit takes them again.
    """

    def __init__(self, *args, norm_at_fold: bool = False, accum_steps: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        # squared sums at the fold only with the plain per-shard sum (tensor parallelism weighs elements)
        self.norm_at_fold = norm_at_fold and self.square_sum is None
        self.accum_steps = accum_steps
        self._backwards = 0                 # backward passes since zero_grad
        self._inflight: collections.deque = collections.deque()
        self.staging = FoldStaging()        # the shards' queue of pending folds (build); none in memory
        self._folded: list = []             # units whose reduced gradient is in their shard, not yet taken

    def build(self) -> None:
        for unit in self.units:
            unit.shard.put_zeros(TensorClass.GRAD, unit.shard_numel, self.reduce_dtype, self.device)
        queues = {u.shard.staging for u in self.units} - {None}
        if len(queues) > 1:
            raise ValueError(f"the units' shards queue their folds in {len(queues)} places: a rank's shards "
                             "share one FoldStaging (store_shards makes them so)")
        if queues:
            self.staging = queues.pop()

    def begin_backward(self) -> None:
        """A backward pass starts (counted for ``norm_at_fold``)."""
        self._backwards += 1

    def _reduce(self, unit) -> None:
        self._final(unit)
        if self.unit_comm.reduces_in_place:
            out = unit.full_grad   # one rank: the mean is the gradient itself, no second full-size buffer
        else:
            out = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=self.device)
            self.buffers.allocated(out.nbytes)
        self._inflight.append(self.unit_comm.reduce_scatter(
            unit, out, unit.full_grad, then=lambda unit=unit, out=out: self._fold(unit, out)))
        # one rank: the reduction is done already, nothing is overlapped by waiting later, and each
        # reduction left waiting keeps a unit-sized full gradient alive: fold it now
        while len(self._inflight) > (0 if self.unit_comm.reduces_in_place else MAX_INFLIGHT):
            self._inflight.popleft().wait()

    def _fold(self, unit, out: torch.Tensor) -> None:
        first, unit.grad_stale = unit.grad_stale, False
        own_buffer = out is not unit.full_grad   # a reduction in place left no output buffer to count
        take_norm = self.norm_at_fold and self._backwards >= self.accum_steps
        unit.grad_square_sums = {} if take_norm else None   # this fold replaces what a last one took
        inspect = self._inspector(unit, take_norm)
        self.staging.finish_landed()   # frees staging and pins, starts writes home early
        unit.shard.fold_grad(out, first, inspect)   # what is left pending is in self.staging
        unit.full_grad = None   # the full gradient is dropped once reduced
        if own_buffer:
            self.buffers.freed(out.nbytes)
        self._folded.append(unit)

    def _inspector(self, unit, take_norm: bool):
        """What a fold calls with the gradient it leaves in the shard (``inspect(t, lo)``: elements
        ``[lo, lo + t.numel())`` of it): fp16's overflow check (the folded sum itself may overflow) and
        the clip norm's squared sums of every norm piece ``t`` holds whole (:func:`norm_pieces`)."""
        if not (self.fp16 or take_norm):
            return None
        pieces = norm_pieces(unit)
        sums = unit.grad_square_sums

        def inspect(t: torch.Tensor, lo: int = 0) -> None:
            if self.fp16:
                self._note_non_finite(t)
            if take_norm and t.dtype == self.reduce_dtype:   # the stored gradient's very values
                for a, b in pieces:
                    if lo <= a and b <= lo + t.numel():
                        sums[a] = square_sum(unit, t[a - lo:b - lo])
        return inspect

    def take_folded(self, readable: bool = False) -> list:
        """Units whose reduced gradient reached their shard since the last call, in order: their gradient
        is final for this backward. ``readable``: for a caller that reads them during backward (the
        overlapped update): each one's fold is finished first where the store would not make a read wait
        for it (an accumulation's sum is made when its copy lands)."""
        if not self._folded:
            return []   # the common case: called after every parameter's hook, nothing new
        out, self._folded = self._folded, []
        if readable:
            for unit in out:
                self.staging.finish_unit(unit.index, unordered_only=True)
        return out

    def _wait_all(self) -> None:
        while self._inflight:
            self._inflight.popleft().wait()

    def _after_flush(self) -> None:
        self.staging.finish_landed()   # the disk may start on gradients whose copies are in already

    def _drop_backward(self) -> None:
        self._inflight.clear()
        self.wait_writes(raise_errors=False)
        self._folded = []

    def wait_writes(self, raise_errors: bool = True) -> None:
        self.staging.finish_all(raise_errors)

    def close(self) -> None:
        self.staging.close()

    def fold_stats(self) -> dict | None:
        return self.staging.stats() if self.staging.store is not None else None

    def zero(self) -> None:
        super().zero()
        self._folded = []
        self._backwards = 0
        for unit in self.units:
            unit.grad_stale = True
            unit.full_grad = None
