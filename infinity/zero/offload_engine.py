"""ZeRO-Infinity: the ZeRO engine with unit shards in the tiered store (DESIGN §3).

:class:`OffloadEngine` is the :class:`~infinity.zero.engine.ZeroEngine` with
each unit shard a :class:`~infinity.zero.store_shard.StoreUnitShard`: the
classes ``offload.*`` places on host or NVMe are store keys in this rank's
:class:`~infinity.store.TensorStore`, the rest stay in memory as before.
What changes, and where:

- materialization: unit by unit, straight into the shards' home tiers, also
  from a model built on the meta device (:mod:`infinity.zero.materialize`);
- stage-3 gather: the parameter shard is brought to the device tier and pinned
  while the all-gather reads it; a :class:`TracePrefetcher` keeps the next
  units' shards coming (NVMe -> host -> device) within ``prefetch.bytes``, and
  the next unit's all-gather starts early if it fits ``prefetch.max_live_bytes``,
  the cap on full parameter bytes of gathering or gathered units. The cap holds
  for every gather of the step, on-demand ones too: units gathered ahead or kept
  for backward are released to make room, units in use never are
  (:mod:`infinity.zero.live_units`); per-step peak in ``live_peak_bytes``.
  Every rank keeps or re-records the trace together (one tiny all-reduce per step);
- stage-2/3 gradients: each reduce-scattered shard is added into its stored
  copy and written home as it is produced;
- the optimizer step: :meth:`shard_jobs` hands the pipelined CPU Adam
  (:mod:`infinity.optim.offload_pipeline`) one job per unit shard; with
  ``optimizer.overlap_backward`` each unit's job is submitted during backward,
  as soon as its gradient shard is final (:mod:`infinity.zero.overlap`);
- per-step stats gain bytes per tier pair, I/O wait, Adam time; a chosen step
  can be traced (:attr:`tracer`, Chrome/Perfetto JSON).
"""

from __future__ import annotations

import time

import torch

from infinity.optim.offload_pipeline import ShardJob
from infinity.schedule.prefetch import TracePrefetcher
from infinity.store import BudgetError, TensorStore, Tier
from infinity.trace import Tracer
from infinity.zero import materialize as meta
from infinity.zero.engine import _MAX_INFLIGHT, ZeroEngine
from infinity.zero.overlap import OverlappedStep
from infinity.zero.placement import Placement
from infinity.zero.store_shard import LentCopies, StoreUnitShard
from infinity.zero.units import TensorClass, UnitState

__all__ = ["OffloadEngine"]

class OffloadEngine(ZeroEngine):
    """A ZeroEngine whose unit shards live where ``config.offload`` puts them."""

    def __init__(self, model, config, param_groups, collectives=None, device=None, init_fn=None):
        self.placement = Placement.from_config(config)
        self.init_fn = init_fn
        self.tracer = Tracer()
        self.store: TensorStore | None = None
        self._gather_pins: dict = {}        # unit index -> param key pinned on the device while gathering
        self._gather_t0: dict = {}
        self._store_mark = None
        self.last_optimizer_stats: dict = {}
        self._closers: list = []            # run by close(): the optimizer's worker threads
        if device is None and meta.is_meta_model(model):
            device = torch.device("cpu")
        # stored gradients are never rewritten to unscale or clip them: the factor rides with the
        # step and CPU Adam applies it to each chunk as it reads it (saves a read + write of every shard)
        self._grad_multiplier = 1.0
        self._inf_flag = torch.zeros(1, dtype=torch.float32)   # fp16: stored gradients seen non-finite
        self.overlap: OverlappedStep | None = None   # optimizer.overlap_backward; made once the rank is known
        self._flushing = False   # inside _end_backward: final units wait for the end of the flush
        try:
            super().__init__(model, config, param_groups, collectives=collectives, device=device)
        except BaseException:
            if self.store is not None:
                self.store.close()   # removes the swap file a half-built engine would leave behind
            raise
        self.tracer.rank = self.rank
        if config.optimizer.overlap_backward:   # units are updated during backward (infinity.zero.overlap)
            self.overlap = OverlappedStep(self.rank, self._shard_job)
        unit_bytes = {u.index: u.shard_numel * _itemsize(self.param_dtype) for u in self.units}
        self.prefetcher = TracePrefetcher(unit_bytes, config.prefetch.bytes)
        self._store_mark = self._store_counters()
        self.tracer.begin_step()

    # ------------------------------------------------------------ materialization

    def _materialize(self) -> None:
        cfg = self.config
        self.store = TensorStore(cfg.tiers, cfg.io, device=self.device, rank=self.rank)
        self.lent = LentCopies(self.store)
        self._fp32 = self.param_dtype == torch.float32
        if meta.is_meta_model(self.model):
            self._materialize_meta()
        else:
            for unit in self.units:
                flat32 = torch.zeros(unit.padded_numel, dtype=torch.float32, device=self.device)
                with torch.no_grad():
                    for slot, p in zip(unit.slots, unit.params):
                        flat32[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
                self._place_unit(unit, flat32)
        self._build_grads()

    def _materialize_meta(self) -> None:
        """Walk the initializers in model order; each unit is placed as soon as its last parameter is written."""
        meta.check_no_meta(self.model)
        steps = meta.init_plan(self.model, [u.module for u in self.units if not u.is_root])
        where = {id(p): (u, s) for u in self.units for s, p in zip(u.slots, u.params)}
        left = {u.index: len(u.params) for u in self.units}
        flats: dict = {}
        by_id = {id(p): p for p in self.model.parameters()}
        for step in steps:
            for pid in step.param_ids:
                p = by_id[pid]
                if pid not in where:   # frozen: not sharded, just made real
                    meta.give_storage(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
                    continue
                unit, slot = where[pid]
                if unit.index not in flats:
                    flats[unit.index] = torch.zeros(unit.padded_numel, dtype=torch.float32, device=self.device)
                meta.give_storage(p, flats[unit.index][slot.offset:slot.offset + slot.numel])
            meta.run_init(step, self.init_fn)
            for pid in step.param_ids:
                if pid in where:
                    unit = where[pid][0]
                    left[unit.index] -= 1
                    if left[unit.index] == 0:
                        self._place_unit(unit, flats.pop(unit.index))

    def _place_unit(self, unit, flat32: torch.Tensor) -> None:
        """Broadcast rank 0's values, make parameters views of the full buffer, store this rank's shard."""
        self.coll.broadcast(flat32, src=0)  # every rank starts from rank 0's weights, as DDP does
        full = flat32 if self._fp32 else flat32.to(self.param_dtype)
        for slot, p in zip(unit.slots, unit.params):
            p.data = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        lo, hi = self.shard_rank * unit.shard_numel, (self.shard_rank + 1) * unit.shard_numel
        shard = StoreUnitShard(self.store, unit.index, self.placement, self.lent)
        param_shard = full[lo:hi]
        if self.stage == 3:
            param_shard = param_shard.clone()
        shard.put(TensorClass.PARAM, param_shard)
        if self.placement.master_is_param(self._fp32):
            shard.alias(TensorClass.MASTER, TensorClass.PARAM)
        else:
            master = flat32[lo:hi]
            # an in-memory master must own its bytes; a stored one is copied by the store anyway
            shard.put(TensorClass.MASTER, master if self.placement.optimizer is not None else master.clone())
        shard.put_zeros(TensorClass.EXP_AVG, unit.shard_numel, torch.float32, self.device)
        shard.put_zeros(TensorClass.EXP_AVG_SQ, unit.shard_numel, torch.float32, self.device)
        unit.shard, unit.full_param = shard, full
        if self.stage == 3:
            self.release(unit)

    def _build_grads(self) -> None:
        self._grad_arena, self._buckets = None, []
        self._grad_writes: list = []                     # their writes, waited on before the step reads them
        if self.stage >= 2:
            for unit in self.units:
                unit.shard.put_zeros(TensorClass.GRAD, unit.shard_numel, self.reduce_dtype, self.device)
            return
        self._build_grad_arena()  # stages 0-1, laid out as ZeroEngine does

    # ------------------------------------------------------------ stage 3: gather from the store

    def gather(self, unit, wait: bool = True) -> None:
        if self.overlap is not None and unit.state is UnitState.SHARDED:
            self.overlap.check_gather(unit)
        key = unit.shard.key(TensorClass.PARAM) if unit.shard is not None else None
        if key is None:
            return super().gather(unit, wait)
        if unit.state is UnitState.SHARDED:
            self.lent.settle()   # a checkpoint load may have written the shard through get()
            # pinned: the all-gather reads this copy asynchronously; an eviction meanwhile would
            # hand its budget to another key while the collective still reads it
            src = self.store.wait(self._with_room(lambda: self.store.bring(key, Tier.DEVICE, pin=True)))
            unit.transition(UnitState.GATHERING)
            self.live.gathering(unit.index)
            full = unit.full_param
            full.untyped_storage().resize_(unit.padded_numel * full.element_size())
            # the collective writes behind autograd's back (see ZeroEngine.gather)
            with torch.autograd._unsafe_preserve_version_counter(full):
                self._gathers[unit.index] = self.coll.all_gather(full, src, async_op=True)
            self._gather_pins[unit.index] = key
            self._gather_t0[unit.index] = time.perf_counter()
        if wait and unit.state is UnitState.GATHERING:
            self._gathers.pop(unit.index).wait()
            self.store.unpin(self._gather_pins.pop(unit.index), Tier.DEVICE)   # the gather no longer reads it
            self.tracer.add(f"all-gather {unit.name}", self._gather_t0.pop(unit.index), time.perf_counter(),
                            lane="comm")
            unit.transition(UnitState.GATHERED)

    def prefetch_after(self, unit, order: list) -> None:
        """Called once per use of a unit: advance the trace, prefetch shards, maybe start the next gather."""
        if self.stage != 3 or unit.shard.key(TensorClass.PARAM) is None:
            return super().prefetch_after(unit, order)
        for index in self.prefetcher.on_use(unit.index):
            if self.overlap is not None and self.overlap.updating(index):
                continue   # Adam is writing its shard (a trace from another step's order): no use this step
            try:
                self.store.bring(self.units[index].shard.key(TensorClass.PARAM), Tier.DEVICE)
            except BudgetError:
                break   # the device tier is full of pinned copies: fetch on demand instead
        nxt = self.prefetcher.upcoming(1)
        if nxt and not (self.overlap is not None and self.overlap.updating(nxt[0])):
            self.gather_ahead(self.units[nxt[0]])   # only if it fits prefetch.max_live_bytes

    # ------------------------------------------------------------ stage 2/3: gradients to their tier

    def _accumulate_reduced(self, unit, out: torch.Tensor) -> None:
        self._fold_reduced(unit, out)
        if self.overlap is not None:
            # one backward per step: the shard is final now, so the unit's update may start
            self.overlap.unit_final(unit, during_flush=self._flushing)

    def _fold_reduced(self, unit, out: torch.Tensor) -> None:
        if unit.shard.key(TensorClass.GRAD) is None:
            return super()._accumulate_reduced(unit, out)
        if self._shard_grad_zeroed[unit.index]:
            # first gradient since zero_grad: it *is* the shard, so the old bytes are never read
            # (zero_grad is lazy, saving a read and a write of every stored shard per step)
            self._note_non_finite(out)
            self._grad_writes.append(self._with_room(lambda: unit.shard.replace(TensorClass.GRAD, out)))
            self._shard_grad_zeroed[unit.index] = False
        else:   # accumulation: pinned + marked dirty in the store, written home in the background
            with unit.shard.update(TensorClass.GRAD) as g:
                g.add_(out.to(g.device))
                self._note_non_finite(g)   # the sum itself may overflow in fp16
        unit.full_grad = None

    def _with_room(self, attempt):
        """A store operation on this thread; during an overlapped step it may wait for host room the
        update holds pinned (without overlap nothing else pins host copies while backward runs)."""
        return attempt() if self.overlap is None else self.overlap.wait_for_room(attempt)

    # ------------------------------------------------------------ optimizer.overlap_backward

    def overlap_with(self, begin_step) -> None:
        """The optimizer's ``begin_step()``: counts the step, starts its pipeline and returns it."""
        if self.overlap is None:
            raise RuntimeError("overlap_with: optimizer.overlap_backward is off in this engine's config")
        self.overlap.connect(begin_step)

    def enter_backward(self) -> None:
        if self.overlap is not None and not self._in_backward:
            self.overlap.check_new_backward()   # before any gradient of this backward is written
        super().enter_backward()

    def _end_backward(self) -> None:
        if self.overlap is None:
            return super()._end_backward()
        # units finished by the flush are submitted after it (stage 3: the root is released by then)
        self._flushing = True
        try:
            super()._end_backward()
        finally:
            self._flushing = False
        self.overlap.end_backward()

    def _note_non_finite(self, grad: torch.Tensor) -> None:
        """fp16: remember an overflow while the shard is in memory, so the step never re-reads it to look."""
        if self.loss_scaler is not None:
            self._inf_flag.add_((~torch.isfinite(grad)).any().float().cpu())

    def _stored_grads(self) -> bool:
        return self.stage >= 2 and self.placement.grads is not None

    def _unscale_grads(self, inv_scale: float) -> bool:
        if not self._stored_grads():
            return super()._unscale_grads(inv_scale)
        flag, self._inf_flag = self._inf_flag, torch.zeros(1, dtype=torch.float32)
        self.coll.all_reduce_max(flag)
        if flag.item() > 0:
            return True
        self._grad_multiplier *= inv_scale
        return False

    def zero_grad(self) -> None:
        super().zero_grad()
        self._inf_flag.zero_()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if self.overlap is not None:
            raise RuntimeError(f"clip_grad_norm_() on rank {self.rank} with optimizer.overlap_backward: the "
                               "update runs during backward, but clipping needs every gradient before any "
                               "update; set overlap_backward: false to clip")
        if not self._stored_grads():
            return super().clip_grad_norm_(max_norm)
        if self._finish_grads():
            return torch.tensor(float("inf"))
        self._settle_grad_writes()
        sq = torch.zeros((), dtype=torch.float32)
        for u in self.units:   # one unit's gradient in memory at a time
            sq += u.shard.read(TensorClass.GRAD).float().pow(2).sum().cpu()
        self.coll.all_reduce_sum(sq)
        # the shards still hold fp16's scaled values: the multiplier so far is the unscale
        norm = sq.sqrt() * self._grad_multiplier
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        self._grad_multiplier *= float(coef)   # applied by the step, never written into the shards
        return norm

    # ------------------------------------------------------------ the optimizer's view

    def shard_jobs(self) -> list:
        """One :class:`ShardJob` per unit, in unit order (stages 1-2: each unit's all-gather starts
        as soon as its update is done, overlapping the rest of the step)."""
        self._settle_grad_writes()
        jobs = [self._shard_job(unit) for unit in self.units]
        self._post_step_gathers.clear()
        return jobs

    def _shard_job(self, unit) -> ShardJob:
        """``unit``'s job; its gradient shard must be final (and this rank's lent copies settled)."""
        self.lent.settle()
        s = unit.shard
        fields = {}
        for cls in (TensorClass.MASTER, TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ, TensorClass.GRAD):
            fields[cls] = s.key(cls) or s.get(cls)
        if s.is_alias(TensorClass.MASTER, TensorClass.PARAM):
            param_out = None
        else:
            param_out = s.key(TensorClass.PARAM) or s.get(TensorClass.PARAM)
        on_done = self._launch_post_step_gather(unit) if self.stage in (1, 2) else None
        return ShardJob(unit.name, fields[TensorClass.MASTER], fields[TensorClass.EXP_AVG],
                        fields[TensorClass.EXP_AVG_SQ], fields[TensorClass.GRAD], param_out,
                        unit.shard_group_ranges(self.shard_rank), on_done, grad_scale=self._grad_multiplier)

    def _settle_grad_writes(self) -> None:
        """Surface a failed gradient write now (a bring would wait for it anyway, but not raise it)."""
        writes, self._grad_writes = self._grad_writes, []
        for f in writes:
            self.store.wait(f)

    def _launch_post_step_gather(self, unit):
        def launch(param):
            # the shard is a view of the full buffer: gather from a copy so input and output don't alias
            shard = param.clone()
            self._post_step_gathers.append(
                self.coll.all_gather(unit.full_param, shard, async_op=True, then=lambda shard=shard: None))
            while len(self._post_step_gathers) > _MAX_INFLIGHT:
                self._post_step_gathers.popleft().wait()
        return launch

    def record_optimizer_stats(self, stats: dict) -> None:
        self.last_optimizer_stats = dict(stats)

    def finish_step(self) -> None:
        if self.overlap is not None:
            self._settle_grad_writes()   # the pipeline read them already; surface a failed write
        super().finish_step()

    def _after_step(self) -> None:
        self._grad_multiplier = 1.0
        # every rank keeps or re-records the trace together: a rank prefetching along a dropped
        # trace would start all-gathers in an order the others do not, and deadlock
        if self.stage == 3 and self.placement.params is not None:
            self.prefetcher.end_step(self._all_agree)
        super()._after_step()
        now = self._store_counters()
        moved = {k: v - self._store_mark["moved"].get(k, 0) for k, v in now["moved"].items()}
        self.stats.last_step["offload"] = {
            "moved_bytes": {k: v for k, v in moved.items() if v},
            "io_wait_s": now["wait_s"] - self._store_mark["wait_s"],
            "adam_s": self.last_optimizer_stats.get("adam_s", 0.0),
            "swap_in_wait_s": self.last_optimizer_stats.get("swap_in_wait_s", 0.0),
            "swap_out_wait_s": self.last_optimizer_stats.get("swap_out_wait_s", 0.0),
            "peak_bytes": now["peak"],
            "live_peak_bytes": self.stats.last_step["live_peak_bytes"],   # gathered params, capped
            "prefetch_trace": self.prefetcher.state.value,
            "overlapped": False,
        }
        if self.overlap is not None:
            self.stats.last_step["offload"].update(self.overlap.end_step(self.last_optimizer_stats))
        self.last_optimizer_stats = {}
        self._store_mark = now
        self.tracer.end_step()
        self.tracer.begin_step()

    def _all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        self.coll.all_reduce_max(flag)
        return flag.item() == 0.0

    def _store_counters(self) -> dict:
        s = self.store.stats()
        return {"moved": dict(s["moved_bytes"]), "wait_s": s["wait_s"], "peak": s["peak_bytes"]}

    # ------------------------------------------------------------ introspection / teardown

    def resident_bytes(self) -> dict:
        """In-memory bytes by class (stored shards excluded) plus the store's bytes per tier."""
        out = super().resident_bytes()
        out["store"] = self.store.stats()["tier_bytes"]
        return out

    def _resident_tensors(self):
        kinds = {TensorClass.PARAM: "params", TensorClass.GRAD: "grads"}
        for u in self.units:
            yield "params", u.full_param
            yield "grads", u.full_grad
            for cls in TensorClass:
                if u.shard.key(cls) is None:  # stored shards are counted by the store, per tier
                    yield kinds.get(cls, "optimizer"), u.shard.get(cls)
        yield "grads", self._grad_arena

    def on_close(self, fn) -> None:
        """Run ``fn()`` when the engine closes (before the store it may use goes away)."""
        self._closers.append(fn)

    def close(self) -> None:
        super().close()
        closers, self._closers = self._closers, []
        for fn in closers:
            fn()
        if self.store is not None:
            self.store.close()



def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

