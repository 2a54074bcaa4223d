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
reduce-scatters once (3Ψ − Ψ_root). The root unit (everything outside the unit
modules, tied weights included) is gathered once per step at stage 3 and stays
gathered through backward, as FSDP2 does for its root. Gathered bytes are
capped by ``prefetch.max_live_bytes`` (:mod:`infinity.zero.live_units`).

One engine for every placement. Where a unit shard's tensors live is the
:class:`~infinity.zero.placement.Placement`'s answer (``offload.*``, as FSDP2
consults its ``OffloadPolicy``): in memory (:class:`~infinity.zero.units.UnitShard`)
or in this rank's tiered store (:class:`~infinity.zero.store_shard.StoreUnitShard`).
The engine speaks to a shard through a few verbs, so gathering, reduction and
the update are written once. What the stage keeps sharded is decided once, in
its :class:`~infinity.zero.stage.StagePolicy`. Parts, each in its own module,
each built with the few collaborators it uses (never the engine); the engine
alone drives them, and nothing below calls back up:

- the hooks that drive it from an ordinary forward and ``loss.backward()``,
  each calling one verb of the engine (the root's and backward's) or of a unit
  (:class:`~infinity.zero.units.FlatUnit`: its forward, backward, recompute and
  saves) (:mod:`~infinity.zero.hooks`); the recorded unit order
  (:class:`~infinity.schedule.prefetch.TracePrefetcher`) that both the
  stage-3 gather-ahead and the store prefetch follow;
- stage 3's gathers within the live-bytes cap (:mod:`~infinity.zero.gathers`);
- gradients, hooks to reduced shard (:mod:`~infinity.zero.grads`); the per-unit
  collectives are passed in (:class:`~infinity.comm.unit_collectives.UnitCollectives`,
  or ZeRO++'s with the same signatures);
- the optimizer update, every shard a job through one pipeline
  (:mod:`~infinity.zero.update`);
- the step's lifecycle (:mod:`~infinity.zero.lifecycle`), which also says what
  happens after a backward or an update raises.

Gradient accumulation (several ``backward()`` per ``step()``) works at every
stage (see :mod:`~infinity.zero.grads`). Parameters' ``.grad`` stays None:
gradients live in the flat buffers. At stage 3 a parameter's data is only valid
while its unit is gathered (``with engine.gathered(): ...``).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn

from infinity.comm.collectives import Collectives, make_collectives
from infinity.comm.unit_collectives import UnitCollectives
from infinity.comm.zeropp import ZeroPlusPlus, set_node_layout
from infinity.config import Config
from infinity.optim.cpu_adam import write_param_
from infinity.parallel.norm import TensorParallelNorm
from infinity.schedule.prefetch import TracePrefetcher
from infinity.store import TensorStore, host_cache
from infinity.store.budget import DeviceHeadroom, resolve_budgets
from infinity.trace import Tracer
from infinity.zero import hooks
from infinity.zero import materialize as meta
from infinity.zero.activations import ActivationOffload
from infinity.zero.gathers import ReplicatedParams, UnitGathers
from infinity.zero.grads import GradReducer, make_grad_reducer
from infinity.zero.hyper import GroupHyper
from infinity.zero.lifecycle import STEP_MOVES, StepPhase
from infinity.zero.live_units import LiveUnits, check_cap, resolve_cap
from infinity.zero.loss_scale import LossScaler
from infinity.zero.memory_report import StepMemory, rss_bytes
from infinity.zero.placement import Placement
from infinity.zero.stage import StagePolicy
from infinity.zero.stats import EngineStats, engine_verb
from infinity.zero.storage_pool import StoragePool
from infinity.zero.store_shard import store_shards
from infinity.zero.units import (TensorClass, UnitParts, UnitShard, check_structure, group_index, memory_bytes,
                                 plan_units, shard_align_numel)
from infinity.zero.schedules import make_schedule

__all__ = ["ZeroEngine", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroEngine:
    """Built by :func:`infinity.initialize`; owns the units, their shards, the hooks, the update and the stats.

    ``param_groups`` are the optimizer's group dicts (the same dicts: an LR scheduler's changes are seen
    by the next step); :attr:`hyper` keeps each group's step count.
    """

    def __init__(self, model: nn.Module, config: Config, param_groups: list, collectives=None, device=None,
                 init_fn=None, mesh=None, tensor_parallel=None):
        baseline_rss_bytes = rss_bytes()   # first: the memory report's baseline is the RSS before any shard
        self.config = config
        self.policy = StagePolicy.of(config.zero.stage)
        self.coll = collectives if collectives is not None else make_collectives()
        self.rank, self.world_size = self.coll.rank, self.coll.world_size   # on the data-parallel axis
        # tensor parallelism (infinity.parallel.tensor_parallel): the engine shards this rank's tp-local
        # parameters over the dp group only; the store, trace and checkpoints use the global rank
        self.tp = tensor_parallel
        self.world_rank = mesh.world_rank if mesh is not None else self.rank
        self.world_coll = Collectives(None) if self.tp is not None else self.coll
        self.param_dtype = DTYPES[config.precision.param_dtype]   # stored, gathered
        compute = config.precision.compute_dtype
        # forward/backward; differs from the stored dtype only as fp32 over bf16 at stage 3 (the config checks)
        self.compute_dtype = self.param_dtype if compute == "auto" else DTYPES[compute]
        self.reduce_dtype = DTYPES[config.precision.reduce_dtype]
        on_meta = meta.is_meta_model(model)
        self.device = device or next((p.device for p in model.parameters() if not on_meta), torch.device("cpu"))
        self.stats = EngineStats(self.coll.counters, self.device)   # on CUDA: device-side phase times too
        self.tracer = Tracer(self.world_rank)
        self.shard_world = self.world_size if self.policy.sharded else 1
        self.shard_rank = self.rank if self.policy.sharded else 0
        self.phase = StepPhase.IDLE
        self._overflow = False       # fp16: this step's gradients overflowed (known once REDUCED)
        self.hyper = GroupHyper(param_groups)
        self.store: TensorStore | None = None
        self.activations: ActivationOffload | None = None   # zero.activation_offload
        self._handles: list = []
        self._closed = False
        self._requires_sync = True   # False inside no_sync(): the backward is not the step's last

        group_of = group_index(model, param_groups)
        align = shard_align_numel({self.param_dtype, self.reduce_dtype, torch.float32})
        self.units = plan_units(model, group_of, config.zero.unit_classes, self.shard_world, align)
        check_structure(self.units, self.coll)
        # where each tensor class of these units lives, sized once for the stored dtypes
        self.placement = Placement.from_config(config).of(self.units, self.policy, _itemsize(self.param_dtype),
                                                          _itemsize(self.reduce_dtype))
        # a gathered unit's bytes: in the compute dtype once upcast (the stored-dtype buffer is freed then)
        held = max(_itemsize(self.param_dtype), _itemsize(self.compute_dtype))
        full_bytes = {u.index: u.padded_numel * held for u in self.units}
        by_name = {u.name: full_bytes[u.index] for u in self.units}
        self._root = next((u for u in self.units if u.is_root), None)
        root_name = self._root.name if self._root is not None else None
        self.max_live_bytes = resolve_cap(config.prefetch.max_live_bytes, by_name, root_name)
        if self.policy.shard_params:   # before materializing: a bad cap fails before any shard is written
            check_cap(self.max_live_bytes, by_name, root_name)
        self.live = LiveUnits(self.units, full_bytes, self.max_live_bytes)
        self.prefetcher = TracePrefetcher({u.index: u.shard_numel * _itemsize(self.param_dtype) for u in self.units},
                                          config.prefetch.bytes)

        self.loss_scaler = LossScaler.for_params(self.param_dtype, config.precision)
        # how a unit's bytes move: plain, or ZeRO++'s variants with the same signatures; either way the
        # byte counters get the node layout
        if config.zeropp.enabled:
            self.unit_comm = ZeroPlusPlus(config.zeropp, self.coll, self.policy.shard_params, self.policy.sharded)
        else:
            set_node_layout(config.zeropp, self.coll)
            self.unit_comm = UnitCollectives(self.coll)

        offload_activations = config.zero.activation_offload != "none"
        if self.placement.any_offload or offload_activations:   # refused before anything is written
            # device auto leaves room for what the step holds outside the store: gathered parameters
            # (stage 3: the live cap; else all), their gradients and one reduce bucket
            gathered = self.max_live_bytes if self.policy.shard_params else sum(full_bytes.values())
            grads = gathered * _itemsize(self.reduce_dtype) // held
            headroom = DeviceHeadroom(working_set_bytes=gathered + grads + config.zero.bucket_bytes)
            budgets = resolve_budgets(config.tiers, self.device, headroom)
            self.placement.check_budgets(budgets)
        # from here on the engine holds threads and files: a failure must not leave them behind
        try:
            if self.placement.any_offload or offload_activations:
                self.store = TensorStore(config.tiers, config.io, device=self.device, rank=self.world_rank,
                                         budgets=budgets)   # "auto" measured once, checked above
                self.stats.io_clock = self.store.thread_wait_s   # store waits attributed per phase
            if self.placement.any_offload:
                self._new_shard = store_shards(self.store, self.placement, budgets)
            self.activations = ActivationOffload(self.store, config.zero.activation_offload, self.device,
                                                 config.prefetch.bytes) if offload_activations else None
            self.update = make_schedule(config.update_schedule().at, self.units, self.store, self.coll, self.policy,
                                        self.shard_rank, self.rank, self.hyper, self.tracer, config.optimizer,
                                        config.schedule.accum_steps,
                                        job_bytes=self.placement.job_host_bytes() if self.store is not None else None,
                                        beside_bytes=self.placement.beside_update_bytes())
            self.grads = self._build_grads(config)
            # stage 3 gathers each unit just before use; below it the gather verbs are no-ops
            self.gathers = UnitGathers(self.units, self.unit_comm, self.live, self.prefetcher, self.update,
                                       self.tracer, config.zero.reshard_after_forward, self.rank,
                                       StoragePool(reuse=self.device.type == "cpu")) \
                if self.policy.shard_params else ReplicatedParams()
            self.memory = StepMemory(baseline_rss_bytes, self.store, self.grads, self.device)
            parts = UnitParts(self.gathers, self.update, self.activations, self.stats.engine_time)
            for unit in self.units:   # what the unit hooks' verbs drive
                unit.bind(parts)
            # swap files and threads go with the engine even if close() is never called: when it is
            # garbage-collected, or at interpreter exit (the callback holds no reference to the engine)
            self._finalizer = weakref.finalize(self, _release, self.update.closer(), self.store)
            with torch.no_grad():
                meta.place_units(model, self.units, init_fn, self._place_unit, self.device)
                meta.move_unsharded(model, self.units, self.device)   # buffers, frozen parameters
            self.grads.build()
            self._handles = hooks.install(self, model, self.units, self.policy.shard_params,
                                          config.zero.checkpointed_units(sum(not u.is_root for u in self.units)),
                                          wait_units=self.update.waits_before_use and not self.policy.shard_params,
                                          offload_saves=offload_activations)
        except BaseException:
            self.close()
            raise
        self.coll.counters.reset()  # the init broadcast is not part of any step
        if self.tp is not None:
            self.tp.coll.counters.reset()
            self.world_coll.counters.reset()
        self.live.reset_step()      # nor are the full buffers materialization held
        self.update.mark_store()
        self.tracer.begin_step()

    # ------------------------------------------------------------ setup

    def _build_grads(self, config: Config) -> GradReducer:
        """The gradient path, with the clip norm's and the overflow flag's collectives: the dp group, or
        with tensor parallelism the whole world (replicated elements weighed once, by the TP norm)."""
        square_sum, norm_coll, overflow_coll = None, (self.coll if self.policy.sharded else None), self.coll
        if self.tp is not None:
            square_sum = TensorParallelNorm(self.units, self.tp, self.shard_rank).square_sum
            # the global norm over both axes in one all-reduce (stage 0: dp ranks hold equal gradients)
            norm_coll = self.world_coll if self.policy.sharded else self.tp.coll
            # fp16: an overflow on any rank skips the step on all, or tp ranks' replicated weights part
            overflow_coll = self.world_coll
        return make_grad_reducer(self.units, self.policy, self.coll, self.unit_comm, self.reduce_dtype, self.device,
                                 config.zero.bucket_bytes, self.shard_rank, fp16=self.loss_scaler is not None,
                                 square_sum=square_sum, norm_coll=norm_coll, overflow_coll=overflow_coll,
                                 norm_at_fold=config.schedule.clip_grad_norm is not None,
                                 accum_steps=config.schedule.accum_steps)

    def _place_unit(self, unit, flat32: torch.Tensor) -> None:
        """Broadcast rank 0's values, make parameters views of the full buffer, put this rank's shard home."""
        self.coll.broadcast(flat32, src=0)  # every rank starts from rank 0's weights, as DDP does
        fp32 = self.param_dtype == torch.float32
        # bf16: the rounding every master format shares (a split master can invert it), as each step rounds
        full = flat32 if fp32 else write_param_(flat32, torch.empty_like(flat32, dtype=self.param_dtype))
        for slot, p in zip(unit.slots, unit.params):
            p.data = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        lo, hi = self.shard_rank * unit.shard_numel, (self.shard_rank + 1) * unit.shard_numel
        shard = self._new_shard(unit) if self.placement.any_offload else UnitShard()
        # stage 3: the shard must own its bytes, the full buffer is freed when the unit is released
        self.placement.fill_shard(shard, full[lo:hi].clone() if self.policy.shard_params else full[lo:hi],
                                  flat32[lo:hi])
        unit.shard, unit.full_param = shard, full
        self.update.prepare_unit(unit)   # update_at speculative: spare copies of what Adam writes
        if self.compute_dtype != self.param_dtype:   # each gather is upcast into it (UnitGathers.gather)
            unit.compute_param = torch.empty(0, dtype=self.compute_dtype, device=full.device)
        self.gathers.release(unit)   # stage 3: the full buffer goes until the unit's first use

    # ------------------------------------------------------------ the lifecycle

    def _go(self, phase: StepPhase) -> None:
        self.phase = STEP_MOVES.check(self.phase, phase, f"rank {self.rank}")

    def notice_aborted_backward(self) -> None:
        """Notice a backward that raised part-way (its end-of-backward callback never ran): wait out
        what it launched, release what it gathered, and refuse its partial gradients until zero_grad.
        Called at every entry into the engine from outside a backward."""
        if self.phase is not StepPhase.BACKWARD or torch._C._current_graph_task_id() != -1:
            return   # no backward was running, or we are inside one (nested ones included)
        self._go(StepPhase.ABORTED)
        try:
            self.grads.abort()
        finally:
            self.gathers.release_all()
            self.update.abort_backward()
            self.prefetcher.abandon_step()
            self.stats.stop("backward")

    def _require_gradients(self, what: str) -> None:
        self.notice_aborted_backward()
        if self.phase is StepPhase.ABORTED:
            raise RuntimeError(
                f"{what} on rank {self.rank}: the last backward() raised part-way, so the gradients are partial; "
                "call optimizer.zero_grad() and run the batch again (or skip it)")
        if self.phase is StepPhase.IDLE:
            raise RuntimeError(
                f"{what} on rank {self.rank} before any backward() since the last step: there are no "
                "gradients to apply; call loss.backward() first")

    # ------------------------------------------------------------ the model's hook verbs (infinity.zero.hooks)

    @engine_verb
    def root_pre_forward(self, training: bool) -> None:
        """The model's forward starts: stage 3 gathers the root unit, in use until the end of backward."""
        self.notice_aborted_backward()
        self.stats.start("forward")
        self.memory.forward_begins()   # counts saved activations once memory is enabled
        if self._root is not None:   # its launched update (next_forward: used first); stage 3 gathers it
            self._root.pre_forward(training)

    @engine_verb
    def root_post_forward(self, out, training: bool):
        """The model's forward is done; returns its output (fp16: routed through the loss scale)."""
        self.memory.forward_ends()
        if not training:
            for unit in self.units:   # no backward will follow: nothing may stay gathered
                self.gathers.release(unit)
        elif self.loss_scaler is not None:
            out = hooks.scale_outputs(out, self.loss_scaler.scale)
        self.stats.stop("forward")
        return out

    def drain_update(self) -> None:
        """Wait for an update ``optimizer.step()`` launched (``update_at`` next_forward) to finish:
        before anything reads every shard (a save, ``state_dict``, ``gathered()``, ``close()``). At
        stages 1-2 it joins the updated shards' all-gathers: a collective, every rank calls it."""
        self.update.drain()

    @engine_verb
    def enter_backward(self) -> None:
        if self.phase is StepPhase.BACKWARD:
            return
        if self.phase is StepPhase.ABORTED:
            self._require_gradients("backward()")
        if self.phase is StepPhase.REDUCED:
            raise RuntimeError(f"backward() on rank {self.rank} after the gradients were finished for the step "
                               "(clip_grad_norm_, or a step that failed part-way): call optimizer.step() first")
        # before any gradient of this backward is written: a launched update (reading them) is finished
        self.update.begin_backward(self._requires_sync)
        self.grads.begin_backward()
        if self.activations is not None:
            self.activations.begin_backward()
        self._go(StepPhase.BACKWARD)
        self.stats.start("backward")
        # runs once the whole backward pass is done: flush reductions, release stage-3 units
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @engine_verb
    def param_grad_ready(self, unit_index: int, slot_index: int, param) -> None:
        """Post-accumulate-grad hook: the parameter's gradient goes into its unit's flat gradient; once the
        unit's reduction is launched, stage 3 releases it."""
        self.enter_backward()
        unit = self.units[unit_index]
        if self.grads.param_ready(unit, unit.slots[slot_index], param):
            self.gathers.release(unit)
        self._hand_final_units()

    def _hand_final_units(self) -> None:
        """Units whose reduced gradient reached their shard are final: the update may take them (overlap)."""
        # an overlapped update reads each unit's gradient during backward: it must have landed
        for unit in self.grads.take_folded(readable=self.update.overlaps):
            self.update.unit_final(unit, self._backward_multiplier())

    @engine_verb
    def _end_backward(self) -> None:
        with self.update.flushing():   # units final in the flush are updated after it (overlap)
            self.grads.flush()
            self._hand_final_units()
        self.gathers.release_all()
        self._go(StepPhase.ACCUMULATED)
        self.update.end_backward(self._backward_multiplier())
        self.stats.stop("backward")

    def _backward_multiplier(self) -> float:
        """The multiplier an update begun in backward applies: the step's if nothing clips it and fp16
        does not overflow (1, or fp16's unscale 1 / loss scale, as GradReducer.finish makes it)."""
        if self.loss_scaler is None:
            return self.grads.multiplier
        return self.grads.multiplier / self.loss_scaler.scale

    # ------------------------------------------------------------ the step (driven by the optimizer)

    def _finish_grads(self) -> bool:
        """Complete reduction, fp16's overflow check and unscale once per step; True on overflow."""
        self._require_gradients("optimizer.step() / clip_grad_norm_()")
        if self.phase is StepPhase.ACCUMULATED:
            scale = self.loss_scaler.scale if self.loss_scaler is not None else None
            self._overflow = self.grads.finish(scale)
            self._go(StepPhase.REDUCED)
        return self._overflow

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before."""
        self.update.check_clip()
        if self._finish_grads():
            return torch.tensor(float("inf"))
        return self.grads.clip(max_norm)

    @engine_verb
    def step(self) -> bool:
        """One optimizer step over every shard; False if skipped (fp16 overflow). Atomic from the
        caller's view: if it raises, step counts and loss scale are unchanged and calling it again
        finishes the same step (see :mod:`infinity.zero.lifecycle`)."""
        if self.phase is StepPhase.STEPPING:
            raise RuntimeError(f"optimizer.step() on rank {self.rank} while a step is running")
        self.stats.start("step")
        if self._finish_grads():
            self.update.skip_step()
            self.loss_scaler.update(True)
            self.hyper.skipped_steps += 1
            self._end_step()
            return False
        self._go(StepPhase.STEPPING)
        try:
            self.grads.wait_writes()   # folded gradients still being written are read by the update
            self.update.step(self.grads.multiplier)
            self.stats.pipeline_stats(self.update.last_stats)   # its Adam and I/O waits, for attribution
        except BaseException as e:
            self._go(StepPhase.REDUCED)
            self.stats.stop("step")
            done = sum(u.updated for u in self.units)
            _add_note(e, f"infinity: optimizer.step() on rank {self.rank} failed with {done} of {len(self.units)} "
                         "units updated; the step count and loss scale are unchanged. Fix the cause and call "
                         "optimizer.step() again to finish this step (updated units are not updated twice), "
                         "or load the last checkpoint.")
            raise
        self.hyper.count_step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)
        self._end_step()
        return True

    def _end_step(self) -> None:
        for unit in self.units:
            unit.clear_update()
        if self.activations is not None:   # the step's graphs are freed: their keys go before the stats
            self.activations.release_dropped()
        self.grads.multiplier = 1.0
        self._go(StepPhase.IDLE)
        self.gathers.end_step(self.coll.all_agree)
        self.stats.stop("step")
        self.stats.end_step()
        self.stats.last_step.update(self.live.take_step_stats())   # live_peak_bytes, live_cap_releases
        if self.tp is not None:   # the other mesh axis: activation all-reduces, and the clip norm's one
            self.stats.last_step["collectives_tp"] = self.tp.coll.counters.snapshot()
            self.stats.last_step["collectives_world"] = self.world_coll.counters.snapshot()
            self.tp.coll.counters.reset()
            self.world_coll.counters.reset()
        self.update.end_step(self.stats.last_step, self.prefetcher.state.value)
        folds = self.grads.fold_stats()
        if folds is not None:   # stored gradients: their fold staging (sized at initialize) and its use
            self.stats.last_step["offload"]["fold_staging"] = folds
        if self.memory.enabled:
            resident = self.resident_bytes()
            resident.pop("store", None)
            gathered = self.gathers.step_peak_bytes(self.stats.last_step.get("live_peak_bytes", 0))
            self.memory.end_step(sum(resident.values()), gathered)
        self.tracer.end_step()
        self.tracer.begin_step()

    def zero_grad(self) -> None:
        """Logically zero every gradient (nothing is cleared now; see :mod:`infinity.zero.grads`)."""
        self.notice_aborted_backward()
        if self.phase is StepPhase.BACKWARD:
            raise RuntimeError(f"zero_grad() on rank {self.rank} during backward")
        if self.phase is StepPhase.STEPPING:
            raise RuntimeError(f"zero_grad() on rank {self.rank} while optimizer.step() runs")
        partial = sum(u.chunks_updated for u in self.units) or self.update.partial_update
        if partial:
            raise RuntimeError(
                f"zero_grad() on rank {self.rank}: the last optimizer step failed part-way, with some units "
                "updated and others not; call optimizer.step() again to finish it, or load the last checkpoint")
        self.grads.zero()
        self.update.new_step()
        if self.phase is not StepPhase.IDLE:
            self._go(StepPhase.IDLE)

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """FSDP2's switch: False marks the next backwards as not the step's last (gradient accumulation).
        Gradients are still reduced into the shards (stages 2-3 keep no full gradient); only
        ``optimizer.update_at: backward``'s update waits for a backward outside it. Without
        overlap it changes nothing."""
        self._requires_sync = bool(requires_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's context manager: backwards inside it are not the step's last (see
        :meth:`set_requires_gradient_sync`)."""
        before, self._requires_sync = self._requires_sync, False
        try:
            yield
        finally:
            self._requires_sync = before

    def prepare_load(self) -> None:
        """A checkpoint load is about to replace every shard: whatever the step was doing is dropped."""
        self.notice_aborted_backward()
        if self.phase is StepPhase.BACKWARD:
            raise RuntimeError(f"load_checkpoint on rank {self.rank} during backward")
        self.update.abort()
        for unit in self.units:
            unit.clear_update()
        self.gathers.release_all()
        self.grads.zero()
        if self.phase is not StepPhase.IDLE:
            if self.phase is StepPhase.STEPPING:
                self._go(StepPhase.REDUCED)
            self._go(StepPhase.IDLE)

    def refresh_full_param(self, unit) -> None:
        """Stages 1-2: after this rank's parameter shard changed, every rank's full buffer gets it."""
        self.update.gather_updated(unit, unit.shard.get(TensorClass.PARAM), wait=True)

    # ------------------------------------------------------------ introspection

    def resident_bytes(self) -> dict:
        """Bytes this rank holds in memory now, by class: params, grads, optimizer (each storage counted
        once; stored shards excluded), plus, with a store, its bytes per tier under ``store``, and with
        ZeRO++'s hpZ the secondary parameter shards under ``secondary_params``."""
        out = memory_bytes(self.units, self.grads.arena)
        out.update(self.unit_comm.resident_bytes())
        if self.store is not None:
            out["store"] = self.store.stats()["tier_bytes"]
        return out

    def memory_report(self) -> dict | None:
        """The last step's peak RSS and where it went, after ``memory.enable()`` (:mod:`.memory_report`)."""
        return self.memory.report()

    @contextlib.contextmanager
    def gathered(self):
        """Every unit's full parameters live inside the block (stage 3 gathers, then releases them).
        Outside the training step's cap: ``prefetch.max_live_bytes`` does not limit this block; exact
        even with ZeRO++'s qwZ (only the training step's gathers are quantized)."""
        self.notice_aborted_backward()
        self.update.drain()   # the parameters read inside are the last step's
        with self.unit_comm.exact_gathers():
            for unit in self.units:
                self.gathers.gather(unit)
        try:
            yield
        finally:
            self.gathers.release_all()

    @property
    def stage(self) -> int:
        """``zero.stage`` (for reports and checkpoint manifests; behaviour asks :attr:`policy`)."""
        return self.policy.stage

    @property
    def padded_numel(self) -> int:
        """Ψ as laid out: every unit's padded flat size."""
        return sum(u.padded_numel for u in self.units)

    def close(self) -> None:
        """Remove the hooks, stop the update's threads, close the store (its swap file is removed), unmap
        what the host block cache kept (:mod:`infinity.store.host_cache`). Every part is closed even if one
        raises; the first error is raised after. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors = []
        update, gathers = getattr(self, "update", None), getattr(self, "gathers", None)
        for part in filter(None, (update and update.drain, self._remove_hooks, self._finish_folds,
                                    self.activations and self.activations.close,
                                    getattr(self, "_finalizer", None), gathers and gathers.buffers.trim,
                                    host_cache.trim)):   # the cache's blocks back to the OS too
            try:
                part()
            except BaseException as e:   # noqa: BLE001 - the rest must still close
                errors.append(e)
        if not hasattr(self, "_finalizer"):   # failed before the finalizer existed
            try:
                _release(update and update.closer(), self.store)
            except BaseException as e:   # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]

    def _finish_folds(self) -> None:
        """Folds whose copies may still be in flight land before the store closes, and the staging buffers
        reserved for them go back; an error of theirs is not this close's to raise."""
        grads = getattr(self, "grads", None)
        if grads is not None:
            grads.close()   # and the staging reserved for them back to the store

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _release(close_update, store) -> None:
    """Stop the update's threads (``close_update``: :meth:`UpdateSchedule.closer`), then close the store;
    each runs even if the first raises. (No reference to the engine here: this is its finalizer.)"""
    try:
        if close_update is not None:
            close_update()
    finally:
        if store is not None:
            store.close()


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(note)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
