"""Gradients, from the parameter hooks to the reduced shard the optimizer reads (stages 0-3).

Each parameter's ``.grad`` is moved into its unit's full (flat, padded)
gradient as soon as autograd has accumulated it; the unit's last one makes the
full gradient final and launches its reduction. How it is reduced is what the
stage policy picks, one class each (:func:`make_grad_reducer`):

- :class:`~infinity.zero.grad_arena.ArenaGrads` (stages 0-1): the units' full
  gradients are views of one arena. Stage 0 cuts it in buckets of
  ``zero.bucket_bytes``; a bucket is all-reduced once all its units are final,
  in bucket order (so every rank issues the same sequence). Stage 1 sums it
  locally over micro-batches and reduce-scatters it once per step (:meth:`finish`).
- :class:`~infinity.zero.grad_folds.FoldedGrads` (stages 2-3): each unit is
  reduce-scattered as soon as it is final and the result folded into its
  gradient shard (:meth:`UnitShard.fold_grad`: in memory or in the store), so a
  full gradient never outlives its unit's backward.

``zero_grad`` is lazy: the next backward's first write to a slot (stages 0-1)
or shard (stages 2-3) is a copy instead of an add, and slots that get no
gradient are zeroed when their unit is reduced.

Gradients are never rewritten to unscale or clip them. fp16 overflow is noted
while each reduced shard is still in memory, into a flag on the gradient's own
device (no device sync per unit), read once per step after one all-reduce
(:meth:`GradReducer.read_flag`, counted in ``flag_reads``); unscaling and the clip coefficient become one fp32 multiplier
(:attr:`GradReducer.multiplier`) that the optimizer applies to each chunk as it
reads it, in fp32 — so small fp16 gradients are not flushed to zero, and a
stored gradient costs no extra read and write.
"""

from __future__ import annotations

import abc

import torch

from infinity.zero.units import TensorClass

__all__ = ["GradReducer", "GradBuffers", "MAX_INFLIGHT", "make_grad_reducer"]

# Collectives of one kind in flight before the oldest is waited on. Each holds a
# unit-sized buffer (a full gradient in backward, a shard copy around the step),
# so this bounds the extra memory; more would overlap more.
MAX_INFLIGHT = 2


def square_sum(unit, grad: torch.Tensor) -> torch.Tensor:
    """A gradient's squared L2 norm, in fp32 (the plain per-shard sum; tensor parallelism weighs elements)."""
    return grad.float().pow(2).sum()


def norm_pieces(unit) -> list:
    """The element ranges of ``unit``'s gradient shard whose squared sums make its part of the clip norm:
    its optimizer chunks (a fold of an accumulated sum sees one chunk at a time), or the whole shard."""
    chunks = unit.shard.chunks()
    return [(0, unit.shard_numel)] if chunks == [None] else chunks


class GradBuffers:
    """Statistics: the most bytes of full gradients (stages 2-3; stages 0-1 sum into the resident arena,
    not counted) and reduction outputs held at once, per window (:meth:`take_peak`)."""

    def __init__(self, units: list, counts_full: bool):
        self.units, self.counts_full = units, counts_full
        self.out_bytes = 0     # reduction outputs alive now
        self._peak_bytes = 0

    def allocated(self, out_bytes: int = 0) -> None:
        """A full gradient or a reduction output (``out_bytes``) was allocated: update the peak."""
        self.out_bytes += out_bytes
        full = sum(u.full_grad.nbytes for u in self.units if u.full_grad is not None) if self.counts_full else 0
        self._peak_bytes = max(self._peak_bytes, full + self.out_bytes)

    def freed(self, out_bytes: int) -> None:
        self.out_bytes -= out_bytes

    def take_peak(self) -> int:
        """The peak since the last call; the next window starts from now."""
        peak, self._peak_bytes = self._peak_bytes, 0
        self.allocated()
        return max(peak, self._peak_bytes)


class GradReducer(abc.ABC):
    """This rank's gradient path: the part every stage shares (the hooks' gradients into full
    gradients, fp16's overflow flag, the clip norm and the multiplier, lazy zeroing). Built with what it uses:

    - ``policy``: the :class:`~infinity.zero.stage.StagePolicy`;
    - ``coll``: the data-parallel collectives;
    - ``unit_comm``: the per-unit reduce-scatter (:class:`~infinity.comm.unit_collectives.UnitCollectives`,
      or ZeRO++'s quantized one, same signature);
    - ``square_sum(unit, grad)``: a unit shard's squared norm for clipping (tensor parallelism weighs
      replicated elements); ``norm_coll``: where that sum is all-reduced (None: nowhere, stage 0 holds
      the whole gradient); ``overflow_coll``: every rank that must skip an fp16 step together.

    Subclasses reduce: :meth:`build` lays the gradients out, :meth:`_reduce` launches a final unit's
    reduction, :meth:`_wait_all` waits for every one launched.
    """

    arena: torch.Tensor | None = None   # stages 0-1: every unit's full gradient, one tensor

    def __init__(self, units: list, policy, coll, unit_comm, reduce_dtype: torch.dtype, device,
                 shard_rank: int, fp16: bool, square_sum=None, norm_coll=None, overflow_coll=None):
        self.units, self.policy, self.coll, self.unit_comm = units, policy, coll, unit_comm
        self.reduce_dtype, self.device, self.shard_rank = reduce_dtype, device, shard_rank
        self.fp16 = fp16
        self._inf_flags: dict = {}          # fp16: device -> count of non-finite folded shards, kept there
        self.flag_reads = 0                 # device->host reads of the overflow flag or the clip norm
        self.multiplier = 1.0               # unscale x clip coefficient, applied as the optimizer reads
        self.buffers = GradBuffers(units, counts_full=not policy.grads_in_arena)
        self.square_sum = square_sum
        self.norm_reads = 0                 # units whose gradient clip() had to read back (stats, tests)
        self.norm_coll = norm_coll
        self.overflow_coll = overflow_coll if overflow_coll is not None else coll

    @abc.abstractmethod
    def build(self) -> None:
        """Lay out every unit's gradient: one arena (stages 0-1) or a zero shard per unit (stages 2-3)."""

    # ------------------------------------------------------------ backward

    def param_ready(self, unit, slot, param) -> bool:
        """Move ``param.grad`` into the unit's full gradient; the unit's last one launches its reduction
        (returns True then)."""
        grad = param.grad
        param.grad = None  # gradients live in the flat buffers; keeping .grad would double the memory
        if unit.full_grad is None:
            self._new_full_grad(unit)
        dst = unit.full_grad[slot.offset:slot.offset + slot.numel].view(slot.shape)
        if unit.unwritten is not None and slot.offset in unit.unwritten:
            # first gradient since zero_grad: a copy, so zero_grad never has to clear the buffer
            dst.copy_(grad)
            unit.unwritten.discard(slot.offset)
        else:
            dst.add_(grad)
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            self._reduce(unit)
            return True
        return False

    def _new_full_grad(self, unit) -> None:
        """Stage 2/3: a fresh full gradient; only its padding is cleared, slots are written on arrival."""
        unit.full_grad = torch.empty(unit.padded_numel, dtype=self.reduce_dtype, device=self.device)
        unit.full_grad[unit.numel:].zero_()
        unit.unwritten = {s.offset for s in unit.slots}
        self.buffers.allocated()

    def _final(self, unit) -> None:
        """The unit's full gradient is final for this backward: its unwritten slots are zeroed."""
        if unit.full_grad is None:
            self._new_full_grad(unit)
        if unit.unwritten:
            for slot in unit.slots:
                if slot.offset in unit.unwritten:
                    unit.full_grad[slot.offset:slot.offset + slot.numel].zero_()
        unit.unwritten = None
        unit.reduced = True

    @abc.abstractmethod
    def _reduce(self, unit) -> None:
        """``unit``'s full gradient is final for this backward: launch its reduction (if the stage reduces now)."""

    @abc.abstractmethod
    def _wait_all(self) -> None:
        """Wait for every reduction this backward launched."""

    def begin_backward(self) -> None:
        """A backward pass starts."""

    def take_folded(self, readable: bool = False) -> list:
        """Units whose reduced gradient reached their shard since the last call (stages 2-3 only)."""
        return []

    def flush(self) -> None:
        """End of backward: units some of whose parameters got no gradient are reduced now, in unit
        order; every reduction of this backward is waited on (their units then in :meth:`take_folded`)."""
        for unit in self.units:
            if not unit.reduced:
                self._reduce(unit)
        self._wait_all()
        self._after_flush()
        for unit in self.units:
            unit.start_backward_pass()

    def _after_flush(self) -> None:
        """What a reducer does once every reduction of the backward has landed."""

    def abort(self) -> None:
        """A backward raised part-way: wait for the reductions it launched (every rank launched the
        same ones), drop its partial gradients. The caller requires ``zero()`` before a step."""
        try:
            self._wait_all()
        finally:
            self._drop_backward()
            for unit in self.units:   # a fold may have been cut short
                unit.grad_square_sums = None
            for unit in self.units:
                unit.start_backward_pass()
                if self.arena is None:
                    unit.full_grad = None
            self.buffers.out_bytes = 0

    def _drop_backward(self) -> None:
        """Forget the reductions and folds a raised backward left in flight."""

    # ------------------------------------------------------------ the step's view

    def take_buffer_peak(self) -> int:
        """:meth:`GradBuffers.take_peak` (the memory report's gradient-buffer term)."""
        return self.buffers.take_peak()

    def wait_writes(self, raise_errors: bool = True) -> None:
        """Wait for folded gradients still being written (stages 2-3); a failed write is raised here."""

    def close(self) -> None:
        """Finish every fold still in flight, its error not raised, and give back what is held for the run
        (stages 2-3: the staging buffers reserved for folds). Idempotent."""

    def fold_stats(self) -> dict | None:
        """Stages 2-3 with stored gradients: the fold staging's counters since initialize
        (:meth:`~infinity.zero.grad_staging.FoldStaging.stats`); else None."""
        return None

    def finish(self, loss_scale: float | None) -> bool:
        """Complete reduction (stage 1: the reduce-scatter) and fold fp16 unscaling into the
        multiplier; returns True if any rank's gradients overflowed."""
        self._complete_reduction()
        self.wait_writes()
        if loss_scale is None:
            return False
        self._note_unfolded_shards()
        flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        for per_device in self._inf_flags.values():
            flag += per_device.to(self.device)
        self._inf_flags = {}
        self.overflow_coll.all_reduce_max(flag)
        if self.read_flag(flag) > 0:
            return True
        self.multiplier /= loss_scale
        return False

    def _complete_reduction(self) -> None:
        """The step's part of the reduction (stage 1's reduce-scatter)."""

    def _note_unfolded_shards(self) -> None:
        """fp16: shards no fold looked at (in-memory arena shards) are looked at now."""

    def _note_non_finite(self, grad: torch.Tensor) -> None:
        """Count a non-finite shard into the flag on ``grad``'s device: no device->host read here."""
        flag = self._inf_flags.get(grad.device)
        if flag is None:
            flag = self._inf_flags[grad.device] = torch.zeros(1, dtype=torch.float32, device=grad.device)
        flag.add_((~torch.isfinite(grad)).any())

    def read_flag(self, value: torch.Tensor) -> float:
        """The one device->host read of a reduced flag or norm (counted: a device sync on CUDA)."""
        self.flag_reads += 1
        return float(value.item())

    def clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the (unscaled) gradients; folds ``min(1, max_norm / norm)`` into the
        multiplier. A unit's squared sum is the sum, in order, of its norm pieces' (:func:`norm_pieces`):
        taken at its last fold (stages 2-3 with ``norm_at_fold``), or read back one unit's gradient shard
        at a time - the same values either way on the CPU path (on CUDA a first fold's are the device's
        reduction)."""
        per_device: dict = {}   # summed where each shard is: no device->host read per unit
        for unit in self.units:
            s = self._unit_square_sum(unit).reshape(())
            per_device[s.device] = per_device[s.device] + s if s.device in per_device else s.clone()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for s in per_device.values():
            sq += s.to(self.device)
        if self.norm_coll is not None:
            self.norm_coll.all_reduce_sum(sq)
        # the shards still hold fp16's scaled values: the multiplier so far is the unscale
        norm = torch.tensor(self.read_flag(sq.sqrt()), dtype=torch.float32) * self.multiplier
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        self.multiplier *= float(coef)
        return norm

    def _unit_square_sum(self, unit) -> torch.Tensor:
        pieces = norm_pieces(unit)
        taken = unit.grad_square_sums
        if taken is not None and len(taken) == len(pieces):
            parts = [taken[a] for a, _ in pieces]
        else:
            self.norm_reads += 1
            grad = unit.shard.read(TensorClass.GRAD)
            if self.square_sum is not None:
                return self.square_sum(unit, grad)
            parts = [square_sum(unit, grad[a:b]) for a, b in pieces]
        total = parts[0]
        for p in parts[1:]:
            total = total + p.to(total.device)
        return total

    def zero(self) -> None:
        """Logically zero every gradient (see the module doc); the multiplier starts again at 1."""
        self.multiplier = 1.0
        self._inf_flags = {}
        for unit in self.units:
            unit.grad_square_sums = None
        self.buffers.out_bytes = 0   # nothing is in flight between steps (a failed step may have left a count)


def make_grad_reducer(units: list, policy, coll, unit_comm, reduce_dtype: torch.dtype, device, bucket_bytes: int,
                      shard_rank: int, fp16: bool, square_sum=None, norm_coll=None, overflow_coll=None,
                      norm_at_fold: bool = False, accum_steps: int = 1) -> GradReducer:
    """The reducer the stage policy picks: :class:`~infinity.zero.grad_arena.ArenaGrads` where gradients sum
    into one arena (stages 0-1: ``bucket_bytes``), else :class:`~infinity.zero.grad_folds.FoldedGrads`
    (``norm_at_fold``, ``accum_steps``: see it)."""
    from infinity.zero.grad_arena import ArenaGrads   # beside this module; each subclasses GradReducer
    from infinity.zero.grad_folds import FoldedGrads
    common = dict(square_sum=square_sum, norm_coll=norm_coll, overflow_coll=overflow_coll)
    if policy.grads_in_arena:
        return ArenaGrads(units, policy, coll, unit_comm, reduce_dtype, device, shard_rank, fp16,
                          bucket_bytes=bucket_bytes, **common)
    return FoldedGrads(units, policy, coll, unit_comm, reduce_dtype, device, shard_rank, fp16,
                       norm_at_fold=norm_at_fold, accum_steps=accum_steps, **common)
