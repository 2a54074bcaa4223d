"""The ZeRO engine: one mechanism for stages 0-3, the stage deciding what stays sharded.

=====  ==========================  =============================  =========================
stage  parameters (compute dtype)  gradients (reduce dtype)        optimizer (fp32 master, m, v)
=====  ==========================  =============================  =========================
0      full, always                full, all-reduced in buckets    full on every rank
1      full, always                full; reduce-scattered at step  this rank's shard
2      full, always                reduce-scattered per unit as    this rank's shard
                                   its backward ends; shard kept
3      shard; all-gathered per     as stage 2                      this rank's shard
       unit for forward/backward
=====  ==========================  =============================  =========================

Stages 1-3 all-gather nothing they do not need: 1 and 2 all-gather the updated
parameter shards after the step (Ψ), so they move 2Ψ per step like stage 0's
all-reduce; stage 3 gathers each unit before forward and before backward and
reduce-scatters once (3Ψ). The root unit (everything outside the unit modules,
tied weights included) is gathered once per step at stage 3 and stays gathered
through backward, as FSDP2 does for its root. Gathered bytes are capped by
``prefetch.max_live_bytes`` (:mod:`infinity.zero.live_units`): a gather that
would exceed it first releases units gathered ahead or kept for backward.

Gradient accumulation (several ``backward()`` per ``step()``): stage 0
all-reduces every micro-batch (as DDP without ``no_sync``); stage 1 sums
locally and reduce-scatters once at the step (fewer bytes, no overlap with
backward); stages 2-3 reduce-scatter every micro-batch into the gradient shard
(a full gradient never outlives its unit's backward). Parameters' ``.grad``
stays None: gradients live in the flat buffers. At stage 3 a parameter's data
is only valid while its unit is gathered (``with engine.gathered(): ...``).

The engine implements :class:`infinity.optim.sharded_adamw.ShardSource`; the
hooks that drive it live in :mod:`infinity.zero.hooks`.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.nn as nn

from infinity.config import Config
from infinity.zero.collectives import make_collectives
from infinity.zero.live_units import LiveUnits, UnitUse, check_cap, resolve_cap
from infinity.zero.loss_scale import LossScaler
from infinity.zero.stats import EngineStats
from infinity.zero.units import TensorClass, UnitShard, UnitState, plan_units, shard_align_numel
from infinity.zero import hooks

__all__ = ["ZeroEngine", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Collectives of one kind in flight before the oldest is waited on. Each holds a
# unit-sized buffer (a full gradient in backward, a shard copy around the step),
# so this bounds the extra memory; more would overlap more.
_MAX_INFLIGHT = 2


class _Bucket:
    """Stage 0: a run of units whose gradients are all-reduced in one call."""

    def __init__(self, units, view):
        self.units, self.view = units, view
        self.ready = 0
        self.pending = None


class ZeroEngine:
    """Built by :func:`infinity.initialize`; owns the units, their shards, the hooks and the stats."""

    def __init__(self, model: nn.Module, config: Config, param_groups: list, collectives=None, device=None):
        self.model, self.config = model, config
        self.stage = config.zero.stage
        self.reshard_after_forward = config.zero.reshard_after_forward
        self.coll = collectives if collectives is not None else make_collectives()
        self.rank, self.world_size = self.coll.rank, self.coll.world_size
        self.param_dtype = DTYPES[config.precision.param_dtype]
        self.reduce_dtype = DTYPES[config.precision.reduce_dtype]
        self.device = device if device is not None else _param_device(model)
        self.stats = EngineStats(self.coll.counters)
        self.shard_world = 1 if self.stage == 0 else self.world_size
        self.shard_rank = 0 if self.stage == 0 else self.rank

        group_of = _group_index(model, param_groups)
        align = shard_align_numel({self.param_dtype, self.reduce_dtype, torch.float32})
        self.units = plan_units(model, group_of, config.zero.unit_classes, self.shard_world, align)
        self._check_structure()
        itemsize = torch.empty((), dtype=self.param_dtype).element_size()
        full_bytes = {u.index: u.padded_numel * itemsize for u in self.units}
        by_name = {u.name: full_bytes[u.index] for u in self.units}
        root_name = next((u.name for u in self.units if u.is_root), None)
        self.max_live_bytes = resolve_cap(config.prefetch.max_live_bytes, by_name, root_name)
        if self.stage == 3:   # before materializing: a bad cap fails before any shard is written
            check_cap(self.max_live_bytes, by_name, root_name)
        self.live = LiveUnits(full_bytes, {u.index: u.name for u in self.units}, self.max_live_bytes)
        self._materialize()

        self.loss_scaler = None
        if self.param_dtype == torch.float16 and config.precision.loss_scale != "none":
            dynamic = config.precision.loss_scale == "dynamic"
            scale = config.precision.initial_loss_scale if dynamic else config.precision.loss_scale
            self.loss_scaler = LossScaler(scale, dynamic, config.precision.loss_scale_window)

        # per-backward bookkeeping
        self._remaining = [len(u.slots) for u in self.units]
        self._in_backward = False
        self._inflight = collections.deque()
        self._gathers: dict = {}
        self._backward_seen = False
        self._grads_finished = False
        self._overflow = False
        self._post_step_gathers = collections.deque()
        # per unit: offsets of the slots not yet written since zero_grad (None: buffer holds real sums)
        self._unwritten: list = [None] * len(self.units)
        self._shard_grad_zeroed = [False] * len(self.units)  # stage 2/3 shards start as real zeros
        self.forward_order: list = []    # unit indices in first-step gather order (for prefetch)
        self.backward_order: list = []
        self._order_frozen = False
        self._handles = hooks.install(self)
        self.coll.counters.reset()  # the init broadcast is not part of any step
        self.live.reset_step()      # nor are the full buffers materialization held

    # ------------------------------------------------------------ setup

    def _check_structure(self) -> None:
        mine = [u.signature() for u in self.units]
        every = self.coll.all_gather_object(mine)
        for r, theirs in enumerate(every):
            if theirs == every[0]:
                continue
            if len(theirs) != len(every[0]):
                detail = f"{len(theirs)} units vs {len(every[0])}"
            else:
                a, b = next((a, b) for a, b in zip(every[0], theirs) if a != b)
                detail = f"unit {b[0]!r}: {_first_difference(a, b)}"
            raise RuntimeError(
                f"initialize: rank {r} disagrees with rank 0 on the model's structure ({detail}); "
                "every rank must build the same model with the same param groups")

    def _materialize(self) -> None:
        fp32 = torch.float32
        for unit in self.units:
            flat32 = torch.zeros(unit.padded_numel, dtype=fp32, device=self.device)
            with torch.no_grad():
                for slot, p in zip(unit.slots, unit.params):
                    flat32[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            self.coll.broadcast(flat32, src=0)  # every rank starts from rank 0's weights, as DDP does
            full = flat32 if self.param_dtype == fp32 else flat32.to(self.param_dtype)
            for slot, p in zip(unit.slots, unit.params):
                # user-visible parameters become views into the unit's full buffer
                p.data = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
            lo = self.shard_rank * unit.shard_numel
            shard = UnitShard()
            param_shard = full[lo:lo + unit.shard_numel]
            if self.stage == 3:
                param_shard = param_shard.clone()
            shard.put(TensorClass.PARAM, param_shard)
            master = param_shard if self.param_dtype == fp32 else flat32[lo:lo + unit.shard_numel].clone()
            shard.put(TensorClass.MASTER, master)
            shard.put(TensorClass.EXP_AVG, torch.zeros(unit.shard_numel, dtype=fp32, device=self.device))
            shard.put(TensorClass.EXP_AVG_SQ, torch.zeros(unit.shard_numel, dtype=fp32, device=self.device))
            unit.shard, unit.full_param = shard, full
            if self.stage == 3:
                self.release(unit)
        self._grad_arena = None
        self._buckets = []
        if self.stage <= 1:
            self._build_grad_arena()
        else:
            for unit in self.units:
                unit.shard.put(TensorClass.GRAD, torch.zeros(unit.shard_numel, dtype=self.reduce_dtype,
                                                             device=self.device))

    def _build_grad_arena(self) -> None:
        """Stages 0-1: one gradient arena, with stage 0's all-reduce buckets as contiguous ranges of it.

        Units go in reverse order (roughly the order backward finishes them), so a
        bucket is a contiguous range and each unit's full gradient is a view into it.
        """
        total = sum(u.padded_numel for u in self.units)
        self._grad_arena = torch.zeros(total, dtype=self.reduce_dtype, device=self.device)
        offset, run, run_lo = 0, [], 0
        bucket_bytes = self.config.zero.bucket_bytes
        itemsize = self._grad_arena.element_size()
        for unit in reversed(self.units):
            unit.full_grad = self._grad_arena[offset:offset + unit.padded_numel]
            lo = self.shard_rank * unit.shard_numel
            unit.shard.put(TensorClass.GRAD, unit.full_grad[lo:lo + unit.shard_numel])
            offset += unit.padded_numel
            run.append(unit)
            if (offset - run_lo) * itemsize >= bucket_bytes:
                self._buckets.append(_Bucket(run, self._grad_arena[run_lo:offset]))
                run, run_lo = [], offset
        if run:
            self._buckets.append(_Bucket(run, self._grad_arena[run_lo:offset]))
        self._bucket_of = {u.index: b for b in self._buckets for u in b.units}

    # ------------------------------------------------------------ stage 3 gather / release

    def gather(self, unit, wait: bool = True) -> None:
        """SHARDED -> GATHERING (-> GATHERED if ``wait``); a no-op if already on the way."""
        if unit.state is UnitState.SHARDED:
            unit.transition(UnitState.GATHERING)
            self.live.gathering(unit.index)
            full = unit.full_param
            full.untyped_storage().resize_(unit.padded_numel * full.element_size())
            # the collective writes the buffer behind autograd's back; without this the
            # version bump would make saved parameters look modified in-place to backward
            with torch.autograd._unsafe_preserve_version_counter(full):
                self._gathers[unit.index] = self.coll.all_gather(full, unit.shard.get(TensorClass.PARAM),
                                                                 async_op=True)
        if wait and unit.state is UnitState.GATHERING:
            self._gathers.pop(unit.index).wait()
            unit.transition(UnitState.GATHERED)

    def release(self, unit) -> None:
        """Free the full buffer (parameters stay views of it, unusable until the next gather)."""
        if unit.state is UnitState.GATHERING:
            self.gather(unit)  # the collective must finish before its output storage is freed
        if unit.state is UnitState.GATHERED:
            unit.transition(UnitState.SHARDED)
            self.live.released(unit.index)
            unit.full_param.untyped_storage().resize_(0)

    def acquire(self, unit) -> None:
        """Gather ``unit`` for use now (its forward or backward; the root's whole step). It stays in use,
        never released for the cap, until :meth:`release` or :meth:`after_forward`. If gathering it would
        exceed ``prefetch.max_live_bytes``, units gathered but not in use are released first; if that is
        not enough, raises RuntimeError instead of exceeding the cap."""
        if unit.state is UnitState.SHARDED and not self.live.fits(unit.index):
            for index in self.live.victims_for(unit.index, self.rank):
                self.release(self.units[index])   # a gathering victim is waited on first (see release)
        self.live.set_use(unit.index, UnitUse.IN_USE)
        self.gather(unit)

    def after_forward(self, unit) -> None:
        """A unit's forward is done: release it (``reshard_after_forward``), or keep it gathered for its
        backward, where the cap may release it (its backward then gathers it again)."""
        if self.reshard_after_forward:
            self.release(unit)
        elif unit.state is not UnitState.SHARDED:
            self.live.set_use(unit.index, UnitUse.KEPT)

    def gather_ahead(self, unit) -> None:
        """Prefetch: start ``unit``'s all-gather now if it is sharded and fits under the cap (nothing is
        released for it). Every rank decides alike, so the collectives stay in the same order."""
        if unit.state is UnitState.SHARDED and self.live.fits(unit.index):
            self.live.set_use(unit.index, UnitUse.AHEAD)
            self.gather(unit, wait=False)

    def prefetch_after(self, unit, order: list) -> None:
        """Start gathering the unit that followed ``unit`` in the recorded order (one ahead, if it fits)."""
        if not self._order_frozen:
            return
        try:
            i = order.index(unit.index)
        except ValueError:
            return
        if i + 1 < len(order):
            self.gather_ahead(self.units[order[i + 1]])

    # ------------------------------------------------------------ backward

    def enter_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self.stats.start("backward")
        # runs once the whole backward pass is done: flush reductions, release stage-3 units
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def param_grad_ready(self, unit, slot, param) -> None:
        """Post-accumulate-grad hook: move ``param.grad`` into the unit's full gradient buffer."""
        self.enter_backward()
        grad = param.grad
        param.grad = None  # gradients live in the flat buffers; keeping .grad would double the memory
        if unit.full_grad is None:
            self._new_full_grad(unit)
        dst = unit.full_grad[slot.offset:slot.offset + slot.numel].view(slot.shape)
        written = self._unwritten[unit.index]
        if written is not None and slot.offset in written:
            # first gradient since zero_grad: a copy, so zero_grad never has to clear the buffer
            dst.copy_(grad)
            written.discard(slot.offset)
        else:
            dst.add_(grad)
        self._remaining[unit.index] -= 1
        if self._remaining[unit.index] == 0:
            self._seal_full_grad(unit)
            self._unit_grads_ready(unit)

    def _new_full_grad(self, unit) -> None:
        """Stage 2/3: a fresh full gradient; only its padding is cleared, slots are written on arrival."""
        unit.full_grad = torch.empty(unit.padded_numel, dtype=self.reduce_dtype, device=self.device)
        unit.full_grad[unit.numel:].zero_()
        self._unwritten[unit.index] = {s.offset for s in unit.slots}

    def _seal_full_grad(self, unit) -> None:
        """Slots that got no gradient since the buffer was (logically) zeroed are zeroed now."""
        unwritten = self._unwritten[unit.index]
        if unwritten:
            for slot in unit.slots:
                if slot.offset in unwritten:
                    unit.full_grad[slot.offset:slot.offset + slot.numel].zero_()
        self._unwritten[unit.index] = None

    def _unit_grads_ready(self, unit) -> None:
        """The unit's full gradient is final (sealed) for this backward: reduce it."""
        self._remaining[unit.index] = -1  # reduced for this backward
        if self.stage == 0:
            bucket = self._bucket_of[unit.index]
            bucket.ready += 1
            self._launch_ready_buckets()
        elif self.stage >= 2:
            out = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=self.device)
            pending = self.coll.reduce_scatter(out, unit.full_grad, average=True, async_op=True,
                                               then=lambda unit=unit, out=out: self._accumulate_reduced(unit, out))
            self._inflight.append(pending)
            while len(self._inflight) > _MAX_INFLIGHT:
                self._inflight.popleft().wait()
            if self.stage == 3:
                self.release(unit)

    def _accumulate_reduced(self, unit, out: torch.Tensor) -> None:
        """Stage 2/3: fold a reduce-scattered gradient shard into the unit's (a copy, first since zero_grad)."""
        grad = unit.shard.get(TensorClass.GRAD)
        if self._shard_grad_zeroed[unit.index]:
            grad.copy_(out)
            self._shard_grad_zeroed[unit.index] = False
        else:
            grad.add_(out)
        unit.full_grad = None  # the full gradient is dropped once reduced

    def _launch_ready_buckets(self) -> None:
        # launch strictly in bucket order so every rank issues the same sequence of collectives
        for bucket in self._buckets:
            if bucket.pending is not None:
                continue
            if bucket.ready < len(bucket.units):
                return
            bucket.pending = self.coll.all_reduce(bucket.view, average=True, async_op=True)

    def _end_backward(self) -> None:
        # units some of whose parameters got no gradient this pass are reduced now, in unit order
        for unit in self.units:
            if self._remaining[unit.index] >= 0:
                if unit.full_grad is None:
                    self._new_full_grad(unit)
                self._seal_full_grad(unit)
                self._unit_grads_ready(unit)
        if self.stage == 0:
            for bucket in self._buckets:
                bucket.pending.wait()
                bucket.pending, bucket.ready = None, 0
        while self._inflight:
            self._inflight.popleft().wait()
        if self.stage == 3:
            for unit in self.units:
                self.release(unit)
            if self.forward_order:
                self._order_frozen = True
        self._remaining = [len(u.slots) for u in self.units]
        self._in_backward = False
        self._backward_seen = True
        self._grads_finished = False
        self.stats.stop("backward")

    # ------------------------------------------------------------ ShardSource (the optimizer's view)

    def _finish_grads(self) -> bool:
        """Complete reduction and fp16 unscaling once per step; returns True on overflow."""
        if not self._backward_seen:
            raise RuntimeError(
                f"optimizer.step() / clip_grad_norm_() on rank {self.rank} before any backward() since "
                "the last step: there are no gradients to apply; call loss.backward() first")
        if self._grads_finished:
            return self._overflow
        if self.stage == 1:
            # launched together so the transport pipelines them; each output lands in the grad shard,
            # which is a view of the input, hence the separate output buffer
            pending = collections.deque()
            for unit in self.units:
                out = torch.empty(unit.shard_numel, dtype=self.reduce_dtype, device=self.device)
                pending.append(self.coll.reduce_scatter(
                    out, unit.full_grad, average=True, async_op=True,
                    then=lambda unit=unit, out=out: unit.shard.get(TensorClass.GRAD).copy_(out)))
                while len(pending) > _MAX_INFLIGHT:
                    pending.popleft().wait()
            while pending:
                pending.popleft().wait()
        self._overflow = False
        if self.loss_scaler is not None:
            self._overflow = self._unscale_grads(1.0 / self.loss_scaler.scale)
            self.loss_scaler.update(self._overflow)
        self._grads_finished = True
        return self._overflow

    def _unscale_grads(self, inv_scale: float) -> bool:
        """fp16: True if any rank's gradients overflowed; else multiply them by ``inv_scale`` in place."""
        grads = [u.shard.get(TensorClass.GRAD) for u in self.units]
        flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        for g in grads:
            flag.add_((~torch.isfinite(g)).any().float())
        self.coll.all_reduce_max(flag)
        if flag.item() > 0:
            return True
        for g in grads:
            g.mul_(inv_scale)
        return False

    def prepare_step(self) -> bool:
        self.stats.start("step")
        if self._finish_grads():
            self._after_step()
            return False
        return True

    def shard_slices(self):
        """Per unit, its group slices; stages 1-2 launch the unit's parameter all-gather as soon as
        the optimizer asks for the next unit (the protocol: a slice is updated before the next is
        requested), so the gathers overlap the rest of the update."""
        self._post_step_gathers = collections.deque()
        for unit in self.units:
            s = unit.shard
            master, grad = s.get(TensorClass.MASTER), s.get(TensorClass.GRAD)
            m, v, param = s.get(TensorClass.EXP_AVG), s.get(TensorClass.EXP_AVG_SQ), s.get(TensorClass.PARAM)
            copy_back = param is not master
            for g, lo, hi in unit.shard_group_ranges(self.shard_rank):
                yield g, master[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], param[lo:hi] if copy_back else None
            if self.stage in (1, 2):
                # the shard is a view of the full buffer; gather from a copy so input and output don't alias
                shard = param.clone()
                self._post_step_gathers.append(
                    # `then` holds the copy alive until the gather is waited on
                    self.coll.all_gather(unit.full_param, shard, async_op=True, then=lambda shard=shard: None))
                while len(self._post_step_gathers) > _MAX_INFLIGHT:
                    self._post_step_gathers.popleft().wait()

    def finish_step(self) -> None:
        while self._post_step_gathers:
            self._post_step_gathers.popleft().wait()  # the next forward reads these buffers
        self._after_step()

    def _after_step(self) -> None:
        self._backward_seen = False
        self._grads_finished = False
        self.stats.stop("step")
        self.stats.end_step()
        self.stats.last_step.update(self.live.take_step_stats())   # live_peak_bytes, live_cap_releases

    def zero_grad(self) -> None:
        """Logically zero every gradient. Nothing is cleared here: the next backward's first write
        to each slot (stages 0-1) or shard (stages 2-3) is a copy instead of an add, which saves a
        pass over Ψ; slots that get no gradient are zeroed when their unit is reduced."""
        if self._in_backward:
            raise RuntimeError(f"zero_grad() on rank {self.rank} during backward")
        if self._grad_arena is not None:
            self._unwritten = [{s.offset for s in u.slots} for u in self.units]
        else:
            self._shard_grad_zeroed = [True] * len(self.units)
            for unit in self.units:
                unit.full_grad = None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if self._finish_grads():
            return torch.tensor(float("inf"))
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        grads = [u.shard.get(TensorClass.GRAD) for u in self.units]
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.stage > 0:  # stage 0 holds the whole (already reduced) gradient on every rank
            self.coll.all_reduce_sum(sq)
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    # ------------------------------------------------------------ introspection

    def resident_bytes(self) -> dict:
        """Bytes this rank holds in memory now, by class: params, grads, optimizer (each storage counted once)."""
        seen, out = set(), {"params": 0, "grads": 0, "optimizer": 0}
        for kind, t in self._resident_tensors():
            if t is None:
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            out[kind] += st.nbytes()
        return out

    def _resident_tensors(self):
        """(kind, tensor) for every in-memory tensor of the training state; views of one storage may repeat."""
        for u in self.units:
            yield "params", u.full_param
            yield "params", u.shard.get(TensorClass.PARAM)
        yield "grads", self._grad_arena
        for u in self.units:
            yield "grads", u.full_grad
            yield "grads", u.shard.get(TensorClass.GRAD)
        for u in self.units:
            for cls in (TensorClass.MASTER, TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ):
                yield "optimizer", u.shard.get(cls)

    @contextlib.contextmanager
    def gathered(self):
        """Every unit's full parameters live inside the block (stage 3 gathers, then releases them).
        Outside the training step's cap: ``prefetch.max_live_bytes`` does not limit this block."""
        if self.stage != 3:
            yield
            return
        for unit in self.units:
            self.gather(unit)
        try:
            yield
        finally:
            for unit in self.units:
                self.release(unit)

    @property
    def padded_numel(self) -> int:
        """Ψ as laid out: every unit's padded flat size."""
        return sum(u.padded_numel for u in self.units)

    def close(self) -> None:
        """Remove the hooks (parameters stay views of their buffers)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _group_index(model: nn.Module, param_groups: list) -> dict:
    group_of = {}
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            if id(p) in group_of:
                raise ValueError(f"initialize: a parameter appears in param groups {group_of[id(p)]} and {gi}")
            group_of[id(p)] = gi
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"initialize: {type(model).__name__} has no trainable parameters "
                         "(none with requires_grad=True); there is nothing to train")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(f"initialize: parameter {missing[0]!r} requires grad but is in no param group "
                         f"({len(missing)} such); add it to a group or set requires_grad=False")
    foreign = [gi for pid, gi in group_of.items() if pid not in names]
    if foreign:
        raise ValueError(f"initialize: param group {foreign[0]} holds a tensor that is not a parameter of the model")
    by_name = dict(model.named_parameters())
    frozen = [names[pid] for pid in group_of if not by_name[names[pid]].requires_grad]
    if frozen:
        raise ValueError(f"initialize: parameter {frozen[0]!r} is in a param group but has requires_grad=False")
    return group_of


def _first_difference(a, b) -> str:
    if a[1] != b[1]:
        return f"padded size {b[1]} vs {a[1]}"
    for sa, sb in zip(a[2], b[2]):
        if sa != sb:
            return f"parameter {sb[0]!r} shape {sb[1]} group {sb[2]} vs {sa[0]!r} shape {sa[1]} group {sa[2]}"
    return f"{len(b[2])} parameters vs {len(a[2])}"
