"""Gradients, from the parameter hooks to the reduced shard the optimizer reads (stages 0-3).

Each parameter's ``.grad`` is moved into its unit's full (flat, padded)
gradient as soon as autograd has accumulated it; the unit's last one makes the
full gradient final and launches its reduction:

- stage 0: the units' full gradients are views of one arena, cut in buckets of
  ``zero.bucket_bytes``; a bucket is all-reduced once all its units are final,
  in bucket order (so every rank issues the same sequence);
- stage 1: the arena is summed locally over micro-batches and reduce-scattered
  once per step (:meth:`GradReducer.finish`);
- stages 2-3: each unit is reduce-scattered as soon as it is final and the
  result folded into its gradient shard (:meth:`UnitShard.fold_grad`: in memory
  or in the store), so a full gradient never outlives its unit's backward.

``zero_grad`` is lazy: the next backward's first write to a slot (stages 0-1)
or shard (stages 2-3) is a copy instead of an add, and slots that get no
gradient are zeroed when their unit is reduced.

A gradient homed in the store leaves the device without blocking backward: its
copy runs on the store's device->host lane and the fold is left pending
(:mod:`infinity.zero.grad_staging`) in :attr:`GradReducer.writes`, which the
step waits for before anything reads a gradient.

Gradients are never rewritten to unscale or clip them. fp16 overflow is noted
while each reduced shard is still in memory, into a flag on the gradient's own
device (no device sync per unit), read once per step after one all-reduce
(:meth:`GradReducer.read_flag`, counted in ``flag_reads``); unscaling and the clip coefficient become one fp32 multiplier
(:attr:`GradReducer.multiplier`) that the optimizer applies to each chunk as it
reads it, in fp32 — so small fp16 gradients are not flushed to zero, and a
stored gradient costs no extra read and write.
"""

from __future__ import annotations

import collections

import torch

from infinity.zero.units import TensorClass

__all__ = ["GradReducer", "MAX_INFLIGHT"]

# Collectives of one kind in flight before the oldest is waited on. Each holds a
# unit-sized buffer (a full gradient in backward, a shard copy around the step),
# so this bounds the extra memory; more would overlap more.
MAX_INFLIGHT = 2


class _Bucket:
    """Stage 0: a run of units whose gradients are all-reduced in one call."""

    def __init__(self, units, view):
        self.units, self.view = units, view
        self.ready = 0
        self.pending = None


def _square_sum(unit, grad: torch.Tensor) -> torch.Tensor:
    return grad.float().pow(2).sum()


def _pieces(unit) -> list:
    """The element ranges of ``unit``'s gradient shard whose squared sums make its part of the clip norm:
    its optimizer chunks (a fold of an accumulated sum sees one chunk at a time), or the whole shard."""
    chunks = unit.shard.chunks()
    return [(0, unit.shard_numel)] if chunks == [None] else chunks


class GradReducer:
    """This rank's gradient path, built with what it uses:

    - ``policy``: the :class:`~infinity.zero.stage.StagePolicy` (buckets, reduce-scatter at step or in backward);
    - ``coll``: the data-parallel collectives (stage 0's bucket all-reduce);
    - ``unit_comm``: the per-unit reduce-scatter (:class:`~infinity.comm.unit_collectives.UnitCollectives`,
      or ZeRO++'s quantized one, same signature);
    - ``room(attempt)``: runs a store operation that may have to wait for host room (a fold into a
      stored gradient shard during an overlapped step);
    - ``norm_at_fold``: clipping is expected (``schedule.clip_grad_norm`` is set): from the
      ``accum_steps``-th backward since zero_grad on, each fold takes the squared sums of the gradient it
      leaves in the shard while that is in memory, so :meth:`clip` reads no stored gradient back (at
      2.7B with NVMe gradients, 5.4 GB a step); a later fold of the unit takes them again;
    - ``square_sum(unit, grad)``: a unit shard's squared norm for clipping (tensor parallelism weighs
      replicated elements); ``norm_coll``: where that sum is all-reduced (None: nowhere, stage 0 holds
      the whole gradient); ``overflow_coll``: every rank that must skip an fp16 step together.

    Units whose reduced gradient is in their shard are collected for the caller (:meth:`take_folded`);
    :meth:`param_ready` says when a unit's reduction was launched (stage 3 then releases it).
    """

    def __init__(self, units: list, policy, coll, unit_comm, reduce_dtype: torch.dtype, device,
                 bucket_bytes: int, shard_rank: int, fp16: bool, room=None, square_sum=None,
                 norm_coll=None, overflow_coll=None, settle_now=None, norm_at_fold: bool = False,
                 accum_steps: int = 1):
        self.units, self.policy, self.coll, self.unit_comm = units, policy, coll, unit_comm
        # settle_now(): True while another party (an overlapped update's pipeline) pins host room beside
        # backward; each fold is then finished at once, so the pins a fold in flight holds (its brought
        # sum, its staging) never sit where that party is waiting for room it cannot see being freed
        self._settle_now = settle_now or (lambda: False)
        self.reduce_dtype, self.device, self.shard_rank = reduce_dtype, device, shard_rank
        self.fp16 = fp16
        self.arena: torch.Tensor | None = None
        self.buckets: list = []
        self._bucket_of: dict = {}
        self._inflight: collections.deque = collections.deque()
        self.writes: collections.deque = collections.deque()   # pending folds / store futures, in fold order
        self._failed_writes: list = []      # settled early but failed: raised by wait_writes
        self._unit_writes: dict = {}        # unit index -> its last fold's pending write (take_folded)
        self._inf_flags: dict = {}          # fp16: device -> count of non-finite folded shards, kept there
        self.flag_reads = 0                 # device->host reads of the overflow flag or the clip norm
        self.multiplier = 1.0               # unscale x clip coefficient, applied as the optimizer reads
        self._folded: list = []             # units whose reduced gradient is in their shard, not yet taken
        self.room = room if room is not None else (lambda attempt: attempt())
        self._bucket_bytes = bucket_bytes
        # stages 1-3: the most bytes of full gradients and reduction outputs held at once (the arena of
        # stages 0-1 is not counted here: it is resident); see take_buffer_peak
        self._out_bytes = 0
        self._buffer_peak_bytes = 0
        self.square_sum = square_sum if square_sum is not None else _square_sum
        # squared sums at the fold only with the plain per-shard sum (tensor parallelism weighs elements)
        self.norm_at_fold = norm_at_fold and square_sum is None
        self.accum_steps = accum_steps
        self._backwards = 0                 # backward passes since zero_grad
        self.norm_reads = 0                 # units whose gradient clip() had to read back (stats, tests)
        self.norm_coll = norm_coll
        self.overflow_coll = overflow_coll if overflow_coll is not None else coll

    # ------------------------------------------------------------ layout

    def build(self) -> None:
        """Stages 0-1: one arena, units in reverse order (roughly the order backward finishes them),
        so a stage-0 bucket is a contiguous range; stages 2-3: a zero gradient shard per unit."""
        if not self.policy.grads_in_arena:
            for unit in self.units:
                unit.shard.put_zeros(TensorClass.GRAD, unit.shard_numel, self.reduce_dtype, self.device)
            return
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
        self._note_buffers()

    def _reduce(self, unit) -> None:
        """The unit's full gradient is final for this backward: zero its unwritten slots, reduce it."""
        if unit.full_grad is None:
            self._new_full_grad(unit)
        if unit.unwritten:
            for slot in unit.slots:
                if slot.offset in unit.unwritten:
                    unit.full_grad[slot.offset:slot.offset + slot.numel].zero_()
        unit.unwritten = None
        unit.reduced = True
        if self.policy.all_reduce_grads:
            self._bucket_of[unit.index].ready += 1
            self._launch_ready_buckets()
        elif self.policy.reduce_scatter_in_backward:
            if self.unit_comm.reduces_in_place:
                out = unit.full_grad   # one rank: the mean is the gradient itself, no second full-size buffer
            else:
                out = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=self.device)
                self._note_buffers(out.nbytes)
            self._inflight.append(self.unit_comm.reduce_scatter(
                unit, out, unit.full_grad, then=lambda unit=unit, out=out: self._fold(unit, out)))
            # one rank: the reduction is done already, nothing is overlapped by waiting later, and each
            # reduction left waiting keeps a unit-sized full gradient alive: fold it now
            while len(self._inflight) > (0 if self.unit_comm.reduces_in_place else MAX_INFLIGHT):
                self._inflight.popleft().wait()

    def begin_backward(self) -> None:
        """A backward pass starts (counted for ``norm_at_fold``)."""
        self._backwards += 1

    def _fold(self, unit, out: torch.Tensor) -> None:
        first, unit.grad_stale = unit.grad_stale, False
        own_buffer = out is not unit.full_grad   # a reduction in place left no output buffer to count
        take_norm = self.norm_at_fold and self._backwards >= self.accum_steps
        unit.grad_square_sums = {} if take_norm else None   # this fold replaces what a last one took
        inspect = self._inspector(unit, take_norm)
        self._settle_landed_writes()
        write = unit.shard.fold_grad(out, first, inspect, room=self.room)
        if write is not None and self._settle_now():
            write.result()
        if write is not None:
            self.writes.append(write)
            self._unit_writes[unit.index] = write
        unit.full_grad = None   # the full gradient is dropped once reduced
        if own_buffer:
            self._out_bytes -= out.nbytes
        self._folded.append(unit)

    def _inspector(self, unit, take_norm: bool):
        """What a fold calls with the gradient it leaves in the shard (``inspect(t, lo)``: elements
        ``[lo, lo + t.numel())`` of it): fp16's overflow check (the folded sum itself may overflow) and
        the clip norm's squared sums of every norm piece ``t`` holds whole (:meth:`_pieces`)."""
        if not (self.fp16 or take_norm):
            return None
        pieces = _pieces(unit)
        sums = unit.grad_square_sums

        def inspect(t: torch.Tensor, lo: int = 0) -> None:
            if self.fp16:
                self._note_non_finite(t)
            if take_norm and t.dtype == self.reduce_dtype:   # the stored gradient's very values
                for a, b in pieces:
                    if lo <= a and b <= lo + t.numel():
                        sums[a] = _square_sum(unit, t[a - lo:b - lo])
        return inspect

    def take_folded(self, readable: bool = False) -> list:
        """Units (stages 2-3) whose reduced gradient reached their shard since the last call, in order:
        their gradient is final for this backward. ``readable``: for a caller that reads them during
        backward (the overlapped update): each one's fold is finished first where the store would not
        make a read wait for it (an accumulation's sum is made when its copy lands)."""
        if not self._folded:
            return []   # the common case: called after every parameter's hook, nothing new
        out, self._folded = self._folded, []
        for unit in out:
            write = self._unit_writes.pop(unit.index, None)
            if readable and write is not None and not getattr(write, "ordered", True):
                write.result()
        return out

    def _copy_out(self, unit, out: torch.Tensor) -> None:
        """Stage 1: a reduce-scatter's output lands in the gradient shard (a view of the arena)."""
        unit.shard.get(TensorClass.GRAD).copy_(out)
        self._out_bytes -= out.nbytes

    def _note_buffers(self, new_out_bytes: int = 0) -> None:
        """A full gradient or a reduction output was allocated: update the buffers' peak."""
        self._out_bytes += new_out_bytes
        full = 0 if self.arena is not None else sum(u.full_grad.nbytes for u in self.units
                                                     if u.full_grad is not None)
        self._buffer_peak_bytes = max(self._buffer_peak_bytes, full + self._out_bytes)

    def take_buffer_peak(self) -> int:
        """The most bytes of full gradients (stages 2-3; stages 0-1 sum into the resident arena) and
        reduction outputs held at once since the last call; the next window starts from now."""
        peak, self._buffer_peak_bytes = self._buffer_peak_bytes, 0
        self._note_buffers()
        return max(peak, self._buffer_peak_bytes)

    def _settle_landed_writes(self) -> None:
        """Finish the oldest pending folds whose copies have landed (frees their staging and pins, starts
        their writes home early); copies land in fold order, so this stops at the first one still in
        flight. A failure is kept for :meth:`wait_writes` to raise."""
        while self.writes and self.writes[0].done():
            w = self.writes.popleft()
            try:
                w.result()
            except BaseException:   # noqa: BLE001 - raised where the step waits
                self._failed_writes.append(w)

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

    def _launch_ready_buckets(self) -> None:
        # strictly in bucket order so every rank issues the same sequence of collectives
        for bucket in self.buckets:
            if bucket.pending is not None:
                continue
            if bucket.ready < len(bucket.units):
                return
            bucket.pending = self.coll.all_reduce(bucket.view, average=True, async_op=True)

    def flush(self) -> None:
        """End of backward: units some of whose parameters got no gradient are reduced now, in unit
        order; every reduction of this backward is waited on (their units then in :meth:`take_folded`)."""
        for unit in self.units:
            if not unit.reduced:
                self._reduce(unit)
        self._wait_all()
        self._settle_landed_writes()   # the disk may start on gradients whose copies are in already
        for unit in self.units:
            unit.start_backward_pass()

    def _wait_all(self) -> None:
        for bucket in self.buckets:
            if bucket.pending is not None:
                pending, bucket.pending = bucket.pending, None
                pending.wait()
            bucket.ready = 0
        while self._inflight:
            self._inflight.popleft().wait()

    def abort(self) -> None:
        """A backward raised part-way: wait for the reductions it launched (every rank launched the
        same ones), drop its partial gradients. The caller requires ``zero()`` before a step."""
        try:
            self._wait_all()
        finally:
            self._inflight.clear()
            for bucket in self.buckets:
                bucket.pending, bucket.ready = None, 0
            self.wait_writes(raise_errors=False)
            self._folded = []
            self._unit_writes = {}
            for unit in self.units:   # a fold may have been cut short
                unit.grad_square_sums = None
            for unit in self.units:
                unit.start_backward_pass()
                if self.arena is None:
                    unit.full_grad = None
            self._out_bytes = 0

    # ------------------------------------------------------------ the step's view

    def finish(self, loss_scale: float | None) -> bool:
        """Complete reduction (stage 1: the reduce-scatter) and fold fp16 unscaling into the
        multiplier; returns True if any rank's gradients overflowed."""
        if self.policy.reduce_scatter_at_step:
            # launched together so the transport pipelines them; each output lands in the grad shard,
            # which is a view of the input, hence the separate output buffer
            pending = collections.deque()
            for unit in self.units:
                out = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=self.device)
                self._note_buffers(out.nbytes)
                pending.append(self.unit_comm.reduce_scatter(
                    unit, out, unit.full_grad, then=lambda unit=unit, out=out: self._copy_out(unit, out)))
                while len(pending) > MAX_INFLIGHT:
                    pending.popleft().wait()
            while pending:
                pending.popleft().wait()
        self.wait_writes()
        if loss_scale is None:
            return False
        if self.policy.grads_in_arena:   # in-memory shards: looked at now (stages 2-3 noted them when folded)
            for unit in self.units:
                self._note_non_finite(unit.shard.get(TensorClass.GRAD))
        flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        for per_device in self._inf_flags.values():
            flag += per_device.to(self.device)
        self._inf_flags = {}
        self.overflow_coll.all_reduce_max(flag)
        if self.read_flag(flag) > 0:
            return True
        self.multiplier /= loss_scale
        return False

    def clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the (unscaled) gradients; folds ``min(1, max_norm / norm)`` into the
        multiplier. A unit's squared sum is the sum, in order, of its norm pieces' (:func:`_pieces`):
        taken at its last fold (``norm_at_fold``), or read back one unit's gradient shard at a time -
        the same values either way on the CPU path (on CUDA a first fold's are the device's reduction)."""
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
        pieces = _pieces(unit)
        taken = unit.grad_square_sums
        if taken is not None and len(taken) == len(pieces):
            parts = [taken[a] for a, _ in pieces]
        else:
            self.norm_reads += 1
            grad = unit.shard.read(TensorClass.GRAD)
            if self.square_sum is not _square_sum:
                return self.square_sum(unit, grad)
            parts = [_square_sum(unit, grad[a:b]) for a, b in pieces]
        total = parts[0]
        for p in parts[1:]:
            total = total + p.to(total.device)
        return total

    def wait_writes(self, raise_errors: bool = True) -> None:
        """Wait for folded gradients still being written; a failed write is raised here."""
        writes = [*self._failed_writes, *self.writes]
        self.writes, self._failed_writes, self._unit_writes = collections.deque(), [], {}
        for f in writes:
            try:
                f.result()
            except BaseException:
                if raise_errors:
                    raise

    def zero(self) -> None:
        """Logically zero every gradient (see the module doc); the multiplier starts again at 1."""
        self.multiplier = 1.0
        self._folded = []
        self._inf_flags = {}
        self._backwards = 0
        for unit in self.units:
            unit.grad_square_sums = None
        self._out_bytes = 0   # nothing is in flight between steps (a failed step may have left a count)
        if self.arena is not None:
            for unit in self.units:
                unit.unwritten = {s.offset for s in unit.slots}
        else:
            for unit in self.units:
                unit.grad_stale = True
                unit.full_grad = None
