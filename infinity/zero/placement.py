"""Which tier each tensor class of a unit shard lives in (DESIGN §3, "policies are data").

Built from ``offload.{optimizer,params,grads}``. ``None`` means "kept by the
engine in ordinary (device) memory, no store involved" — the ZeRO engine's
behaviour without offload. A class placed on ``host`` or ``nvme`` is a store
key ``f"u{unit}.{class}"`` with that home tier; the engine brings working
copies to the tier where they are used (:meth:`Placement.work_tier`).

Trade-offs: ``host`` frees device memory at the cost of a host<->device copy
per use; ``nvme`` frees host memory too at the cost of disk bandwidth, which
the optimizer pipeline and the prefetcher hide as far as the disk allows.

Chunks of an ``nvme`` class may be homed in host memory instead, for good
(``offload.host_resident_bytes``, :meth:`UnitPlacement.host_resident_plan`): the host
budget beyond the step's working room. An LRU cache of that room would hit
nothing, since a step walks every unit in the same order and evicts each chunk
just before it is needed again; a resident chunk is never read or written again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from infinity.config import Config, ConfigError, format_size
from infinity.optim.moment_codes import moment_format
from infinity.optim.split_master import remainder_of
from infinity.store import Tier
from infinity.store.host_pool import ALIGN_BYTES
from infinity.zero.stage import StagePolicy
from infinity.zero.units import TensorClass

__all__ = ["Placement", "UnitPlacement", "store_key", "chunk_bounds", "CHUNK_ALIGN_NUMEL", "OPTIMIZER_CLASSES"]

# a chunk's element count is a multiple of this: 4096 elements are 4096-byte aligned in any dtype
CHUNK_ALIGN_NUMEL = 4096
# offload.host_resident_bytes auto leaves room for this many of the largest optimizer job (at least half
# the host budget): the pipeline's lookahead, the job being updated and write-backs in flight
RESIDENT_RESERVE_JOBS = 4

OPTIMIZER_CLASSES = (TensorClass.MASTER, TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ)


def store_key(unit_index: int, cls: TensorClass, chunk: int | None = None) -> str:
    """``u{unit}.{class}``; a shard split into chunks has one key per chunk, ``u{unit}.{class}.{chunk}``."""
    return f"u{unit_index}.{cls.value}" if chunk is None else f"u{unit_index}.{cls.value}.{chunk}"


def chunk_bounds(numel: int, chunk_numel: int) -> list:
    """``[(lo, hi), ...]`` cutting ``numel`` elements into near-equal chunks of at most ``chunk_numel``
    (itself a multiple of CHUNK_ALIGN_NUMEL), every cut on a CHUNK_ALIGN_NUMEL boundary."""
    count = max(1, math.ceil(numel / chunk_numel))
    size = min(chunk_numel, math.ceil(numel / count / CHUNK_ALIGN_NUMEL) * CHUNK_ALIGN_NUMEL)
    return [(lo, min(numel, lo + size)) for lo in range(0, numel, size)] or [(0, 0)]


def _tier(value: str) -> Tier | None:
    return None if value == "none" else Tier(value)


@dataclass(frozen=True)
class Placement:
    """Home tier per tensor class; None = engine memory (not in the store)."""

    params: Tier | None = None
    grads: Tier | None = None
    optimizer: Tier | None = None
    chunk_bytes: int = 256 * 2**20   # host bytes one optimizer job's stored classes may take together
    # NVMe-homed gradients wait in host memory unwritten for an update that consumes them during
    # backward (optimizer.update_at backward), instead of a write now and a read at the step
    defer_grad_writes: bool = False
    # NVMe-homed chunks kept in host memory for good (``offload.host_resident_bytes``): "auto" or bytes
    host_resident: object = 0
    # ``optimizer.master``: "remainder" stores the fp32 master as an int16 remainder beside the bf16 parameter
    master_format: str = "fp32"
    # ``optimizer.moments``: the stored format of Adam's two moments ("fp32", "bf16" or "int8")
    moments_format: str = "fp32"
    # ``optimizer.update_at`` speculative: each stored class Adam writes has a spare copy beside it (same
    # home); a job's NVMe-homed states need no more host room (the copy read is handed to the spare's key)
    spares: bool = False
    # the update runs while compute does (``optimizer.update_at`` other than step): what runs beside it
    # needs host room of its own (:meth:`UnitPlacement.beside_update_bytes`)
    overlapped: bool = False

    @classmethod
    def from_config(cls, config: Config) -> "Placement":
        """The config's cross-checks (stage / nvme_path) have already run in ``Config``."""
        off = config.offload
        timing = config.update_schedule()
        return cls(params=_tier(off.params), grads=_tier(off.grads), optimizer=_tier(off.optimizer),
                   chunk_bytes=off.chunk_bytes, defer_grad_writes=timing.in_backward,
                   host_resident=off.host_resident_bytes, master_format=config.optimizer.master,
                   moments_format=config.optimizer.moments, spares=timing.spares, overlapped=timing.overlapped)

    def copies(self, cls: TensorClass) -> int:
        """Stored copies of each element of ``cls``: 2 for a class Adam writes when it has spares, else 1."""
        return 2 if self.spares and cls is not TensorClass.GRAD else 1

    @property
    def any_offload(self) -> bool:
        return any(t is not None for t in (self.params, self.grads, self.optimizer))

    @property
    def uses_nvme(self) -> bool:
        return Tier.NVME in (self.params, self.grads, self.optimizer)

    def home(self, cls: TensorClass) -> Tier | None:
        if cls is TensorClass.PARAM:
            return self.params
        if cls is TensorClass.GRAD:
            return self.grads
        return self.optimizer

    def work_tier(self, cls: TensorClass) -> Tier:
        """Where a working copy is used: parameters feed the all-gather on the device; the CPU
        optimizer reads gradients and states (and writes parameters) in host memory."""
        if cls is TensorClass.PARAM:
            return Tier.DEVICE
        return Tier.HOST

    def master_is_param(self, param_is_fp32: bool) -> bool:
        """Whether the fp32 master may be the PARAM tensor itself (one copy instead of two).

        Only when the compute dtype is fp32 and both classes have the same home;
        otherwise each is its own key.
        """
        return param_is_fp32 and self.params == self.optimizer

    @property
    def split_master(self) -> bool:
        """The master is stored as a 16-bit remainder of the bf16 parameter (``optimizer.master: remainder``)."""
        return self.master_format == "remainder"

    def master_itemsize(self, param_itemsize: int) -> int:
        """Stored bytes per element of the master: 0 when it is the parameter, 2 as a remainder, else 4."""
        if self.master_is_param(param_itemsize == 4):
            return 0
        return 2 if self.split_master else 4

    @property
    def moment_itemsize(self) -> int:
        """Stored bytes per element of each Adam moment (``optimizer.moments``; int8: 65/64, a block's codes and
        its scale: whole blocks give whole bytes, and every shard and chunk is whole blocks)."""
        return moment_format(self.moments_format).itemsize

    def fill_shard(self, shard, param: torch.Tensor, master32: torch.Tensor) -> None:
        """A new unit shard's classes, by where they live: ``param`` (this rank's parameter shard) as PARAM;
        the fp32 master from ``master32`` (this rank's slice of the unit's fp32 flat buffer), which is the
        parameter itself where :meth:`master_is_param`, only the remainder with a split master, and an owned
        copy when kept in memory (a view would keep the whole fp32 buffer alive; a stored one is copied by
        the store anyway); Adam's moments zero, in ``optimizer.moments``' format."""
        shard.put(TensorClass.PARAM, param)
        if self.master_is_param(param.dtype == torch.float32):
            shard.alias(TensorClass.MASTER, TensorClass.PARAM)
        else:
            master = remainder_of(master32) if self.split_master else master32   # the parameter holds the rest
            shard.put(TensorClass.MASTER, master if self.optimizer is not None or self.split_master else
                      master.clone())
        moments = moment_format(self.moments_format)
        for cls in (TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ):
            shard.put_zeros(cls, param.numel(), moments.dtype, param.device, layout=moments)

    def of(self, units, policy: StagePolicy, param_itemsize: int, reduce_itemsize: int) -> "UnitPlacement":
        """This placement handed, once, the units it places, the stage policy and the stored itemsizes of
        parameters and gradients: what it stores of them and the room that needs."""
        return UnitPlacement(**{f.name: getattr(self, f.name) for f in fields(Placement)}, units=tuple(units),
                             policy=policy, param_itemsize=param_itemsize, reduce_itemsize=reduce_itemsize)

    def describe(self) -> dict:
        return {"params": _name(self.params), "grads": _name(self.grads), "optimizer": _name(self.optimizer)}


@dataclass(frozen=True)
class UnitPlacement(Placement):
    """A :class:`Placement` handed the units it places, the stage policy and the stored itemsizes once
    (:meth:`Placement.of`): what it stores of those units, in chunks of what size, and the host and device
    room that needs. The engine, the planner and the estimator ask it with no sizes of their own."""

    units: tuple = field(kw_only=True, repr=False, compare=False)   # the shapes the sizes below apply to
    policy: StagePolicy = field(kw_only=True)
    param_itemsize: int = field(kw_only=True)    # bytes per element of the stored (gathered) parameters
    reduce_itemsize: int = field(kw_only=True)   # bytes per element of the reduced gradients

    def stored_itemsizes(self) -> dict:
        """Bytes per element of each class this placement stores (host or NVMe), as one optimizer job
        brings them: ``{TensorClass: itemsize}``; a master that is the parameter counts once."""
        moment = self.moment_itemsize
        sizes = {TensorClass.PARAM: self.param_itemsize, TensorClass.EXP_AVG: moment,
                 TensorClass.EXP_AVG_SQ: moment, TensorClass.MASTER: self.master_itemsize(self.param_itemsize),
                 TensorClass.GRAD: self.reduce_itemsize}
        if self.policy.grads_in_arena:
            sizes.pop(TensorClass.GRAD)   # stages 0-1 keep gradients in the in-memory arena
        return {cls: n for cls, n in sizes.items() if n and self.home(cls) is not None}

    def chunk_numel(self) -> int:
        """Elements per chunk of a stored unit shard: as many as fit ``chunk_bytes`` with every stored
        class of the chunk brought at once, in whole multiples of :data:`CHUNK_ALIGN_NUMEL` (direct I/O
        alignment for any dtype), at least one multiple."""
        per_element = sum(self.stored_itemsizes().values()) or 1
        return max(CHUNK_ALIGN_NUMEL, int(self.chunk_bytes // per_element) // CHUNK_ALIGN_NUMEL * CHUNK_ALIGN_NUMEL)

    def min_budgets(self) -> dict:
        """The least host and device tier budgets a training step needs with this placement:
        ``{Tier.HOST: (bytes, why), Tier.DEVICE: (bytes, why)}``.

        Host: every host-homed copy stays there (a home is never evicted), and one optimizer job
        holds all of one chunk's stored classes in host memory at once (master, moments, gradient,
        new parameter), so the largest such working set must fit beside the host homes; chunks
        (``chunk_bytes``) bound it independently of unit size.
        Device (stage 3, parameters stored): a unit's all-gather reads a device copy of its shard,
        so the largest parameter shard must fit.
        """
        homed, worst, worst_unit, deferred, _ = self.host_working_set()
        chunk = self.chunk_numel()
        beside = self.beside_update_bytes()
        host = homed + worst + beside
        why = (f"{homed} bytes of host-homed shards" if homed else "no host-homed shards") + \
            (f" + one optimizer job of unit {worst_unit!r} ({worst} bytes of stored states brought to host"
             + ("; its whole gradient shard waits there, the update overlapping backward" if deferred else "")
             + "; offload.chunk_bytes caps the rest)" if worst_unit is not None else "") + \
            (f" + {beside} bytes beside the overlapped update (a stage-3 gather's or a gradient fold's chunk, "
             "outside the update's room)" if beside else "")
        device, device_why = 0, "no stored parameters gathered"
        if self.policy.shard_params and self.params is not None:
            # a gather pins one chunk of the shard at a time (the whole shard when it is one chunk)
            largest = max(self.units, key=lambda u: u.shard_numel)
            device = min(largest.shard_numel, chunk) * self.param_itemsize
            device_why = f"the all-gather of unit {largest.name!r} reads {device} bytes of its parameter shard there"
        return {Tier.HOST: (host, why), Tier.DEVICE: (device, device_why)}

    def fold_staging_bytes(self) -> int:
        """The largest accumulation a gradient fold stages in host memory: one chunk of a stored gradient
        shard (:mod:`infinity.zero.grad_staging`); 0 when gradients are not stored."""
        itemsize = self.stored_itemsizes().get(TensorClass.GRAD)
        if itemsize is None:
            return 0
        chunk = self.chunk_numel()
        return max(int(itemsize * min(u.shard_numel, chunk)) for u in self.units)

    def host_working_set(self) -> tuple:
        """``(homed, worst, worst_unit, deferred, chunk_job)``: bytes of host-homed shards; the largest
        optimizer job's host bytes and its unit's name; whether gradient writes are deferred; and the
        largest job's bytes of one chunk, without a deferred unit's whole gradient.

        Deferred gradients (the update overlaps backward) wait in host memory until their update, and a
        unit's updates start once its whole gradient shard is folded: every chunk's gradient at once.
        """
        sizes = self.stored_itemsizes()
        chunk = self.chunk_numel()
        deferred = self.defer_grad_writes and self.home(TensorClass.GRAD) is Tier.NVME and TensorClass.GRAD in sizes
        homed, worst, worst_unit, chunk_job = 0, 0, None, 0
        for u in self.units:
            job = one_chunk = 0
            for cls, itemsize in sizes.items():   # int8 moments: 65/64 B, whole blocks give whole bytes
                if self.home(cls) is Tier.HOST:   # with spares: homed twice
                    homed += int(itemsize * self.copies(cls) * u.shard_numel)
                    continue
                one_chunk += int(itemsize * min(u.shard_numel, chunk))
                job += int(itemsize * (u.shard_numel if deferred and cls is TensorClass.GRAD
                                       else min(u.shard_numel, chunk)))
            chunk_job = max(chunk_job, one_chunk)
            if job > worst:
                worst, worst_unit = job, u.name
        return homed, worst, worst_unit, deferred, chunk_job

    def beside_update_bytes(self) -> int:
        """Host bytes an overlapped update leaves outside its look-ahead room for what runs meanwhile: the
        largest chunk a stage-3 gather brings through host memory (NVMe-homed parameters) or a gradient
        fold lands there (gradients not homed in host memory), in whole host buffers. 0 when the update
        does not overlap compute."""
        if not self.overlapped:
            return 0
        sizes = self.stored_itemsizes()
        chunk = self.chunk_numel()
        classes = [cls for cls in (TensorClass.PARAM, TensorClass.GRAD)
                   if cls in sizes and self.home(cls) not in (None, Tier.HOST)]
        return max((-(-int(sizes[cls] * min(u.shard_numel, chunk)) // ALIGN_BYTES) * ALIGN_BYTES
                    for u in self.units for cls in classes), default=0)

    def job_host_bytes(self) -> int:
        """The most host bytes one optimizer job brings (what the update's look-ahead room is sized in):
        one chunk of every stored class not homed in host memory, each key in whole 4096-byte host buffers
        (:class:`~infinity.store.HostBufferPool`). A speculative job's spare of such a class takes over
        the copy it reads (:meth:`~infinity.store.TensorStore.hand_over`): no more room."""
        sizes = self.stored_itemsizes()
        chunk = self.chunk_numel()
        largest = 0
        for u in self.units:
            numel = min(u.shard_numel, chunk)
            largest = max(largest, sum(-(-int(itemsize * numel) // ALIGN_BYTES) * ALIGN_BYTES
                                       for cls, itemsize in sizes.items() if self.home(cls) is not Tier.HOST))
        return largest

    def check_budgets(self, budgets: dict) -> None:
        """Raise ConfigError if a tier's budget (``budgets[tier]``, bytes) is below :meth:`min_budgets`,
        naming the key, the minimum and why."""
        need = self.min_budgets()
        for tier, key in ((Tier.HOST, "tiers.host_bytes"), (Tier.DEVICE, "tiers.device_bytes")):
            least, why = need[tier]
            if budgets[tier] < least:
                raise ConfigError(f"{key} = {budgets[tier]} bytes ({format_size(budgets[tier])}) is below the "
                                  f"{least} bytes ({format_size(least)}) this model and placement need: {why}. "
                                  f"Set {key} to at least {format_size(least)}, or place less on that tier")

    def resident_room(self, host_bytes: int) -> int:
        """Host bytes that NVMe-homed chunks may keep for good (``offload.host_resident_bytes``).

        ``auto``: what the host budget holds beyond a working reserve for the step's traffic: the
        larger of half the budget and :meth:`min_budgets`' host minimum (one job, and with deferred
        gradients a unit's whole gradient shard) plus ``RESIDENT_RESERVE_JOBS - 1`` more jobs (the
        pipeline's lookahead and write-backs in flight).
        An explicit size must leave the minimum free; 0 keeps every chunk on the disk.
        """
        if Tier.NVME not in (self.params, self.optimizer):
            return 0
        homed, worst, _, _, chunk_job = self.host_working_set()
        need = homed + worst   # min_budgets' host minimum
        if self.host_resident != "auto":
            if self.host_resident and host_bytes - self.host_resident < need:
                raise ConfigError(
                    f"offload.host_resident_bytes = {format_size(self.host_resident)} leaves "
                    f"{format_size(max(0, host_bytes - self.host_resident))} of tiers.host_bytes "
                    f"({format_size(host_bytes)}) for the step, below the {format_size(need)} it needs; "
                    f"lower offload.host_resident_bytes or raise tiers.host_bytes")
            return self.host_resident
        reserve = max(worst + (RESIDENT_RESERVE_JOBS - 1) * chunk_job, host_bytes // 2)
        return max(0, host_bytes - homed - reserve)

    def host_resident_plan(self, room: int) -> dict:
        """``{unit_index: frozenset((TensorClass, chunk))}``: the NVMe-homed chunks homed in host memory
        instead, filling at most ``room`` bytes.

        A resident chunk is never read from or written to the disk again, so the plan takes first what
        saves the most disk traffic per byte of host memory: parameter chunks (read by the forward and
        by the backward, written by the step: 3 transfers per byte), then each chunk's optimizer states
        together (master and moments: read and written once a step, 2 per byte). Within each, the root
        unit first, then the others in forward order: the root is gathered first in the forward, before
        any prefetch can hide its read, and its gradient is final only when backward ends, so its update
        is the step's exposed tail (with ``optimizer.update_at`` every other unit's is hidden
        behind the rest of the backward, the least for the units the backward reaches last).
        Gradients are left out: with ``defer_grad_writes`` they reach the disk only when spilled.
        """
        chunk = self.chunk_numel()
        sizes = self.stored_itemsizes()
        passes = [(TensorClass.PARAM,)] if self.params is Tier.NVME else []
        if self.optimizer is Tier.NVME:
            passes.append(tuple(c for c in OPTIMIZER_CLASSES if c in sizes))
        ordered = sorted(self.units, key=lambda u: not u.is_root)   # stable: the rest keep forward order
        candidates = [(u.index, c, classes, sum(sizes.get(cls, 0) * self.copies(cls) for cls in classes) * (hi - lo))
                      for classes in passes for u in ordered
                      for c, (lo, hi) in enumerate(chunk_bounds(u.shard_numel, chunk))]
        plan: dict = {}
        for index, c, classes, cost in candidates:
            if cost > room:
                break   # greedy in order of value: nothing later is taken ahead of what did not fit
            room -= cost
            plan.setdefault(index, set()).update((cls, c) for cls in classes)
        return {i: frozenset(s) for i, s in plan.items()}

    def streams_optimizer(self, plan: dict, host_bytes: int) -> bool:
        """Whether NVMe-homed optimizer states are streamed: each chunk's host copy freed once its
        update is written home, instead of kept as a clean cached copy.

        A step reads and writes every chunk's states once, in the same order each step, so an LRU
        cache smaller than those states evicts each copy before its next use: the copies kept
        would only fill the host budget (and RSS) with bytes never read again. That is the case
        when the states not resident (``plan``) outweigh the host budget less what is held there for
        good (resident chunks, host-homed classes); below that, the cache keeps them from one step to
        the next and they stay cached.
        """
        if self.optimizer is not Tier.NVME:
            return False
        chunk = self.chunk_numel()
        sizes = self.stored_itemsizes()
        held = streamed = 0
        for u in self.units:
            kept = plan.get(u.index, frozenset())
            for c, (lo, hi) in enumerate(chunk_bounds(u.shard_numel, chunk)):
                for cls, itemsize in sizes.items():
                    if (cls, c) in kept or self.home(cls) is Tier.HOST:
                        held += itemsize * self.copies(cls) * (hi - lo)
                    elif cls in OPTIMIZER_CLASSES:   # homed on NVMe
                        streamed += itemsize * (hi - lo)
        return streamed > host_bytes - held

    def resident_bytes(self, plan: dict) -> int:
        """Host bytes the chunks of ``plan`` (:meth:`host_resident_plan`) hold for good, spares included."""
        chunk = self.chunk_numel()
        sizes = self.stored_itemsizes()
        total = 0
        for u in self.units:
            kept = plan.get(u.index, frozenset())
            if kept:
                bounds = chunk_bounds(u.shard_numel, chunk)
                total += sum(int(sizes.get(cls, 0) * self.copies(cls) * (bounds[c][1] - bounds[c][0]))
                             for cls, c in kept)
        return total

    def writes_kept_grads(self, plan: dict, host_bytes: int) -> bool:
        """With spares (``update_at`` speculative) and NVMe-homed gradients deferred: whether a gradient a
        speculative update keeps for a possible redo is written home and its host copy freed as soon as
        that update is done, instead of held in host memory until ``step()`` decides.

        Held, every unit's gradient shard is in host memory at once by the end of backward, crowding out
        the parameter copies the cache keeps for the next forward (the store evicts clean copies before it
        writes dirty ones). Where they outweigh the host budget less what is held there for good (host
        homes, resident chunks) and one optimizer job's chunk, they cannot all be held even with nothing
        else cached, so they are spilled anyway, after pushing out those parameters: at GPT-2 2.7B with
        3 GiB of host that cost 7.1 GB more reads and 4.4 GB more writes a step. Written at once they cost
        one write of each gradient (read back only by a redo), and the cache stays the parameters'. Where
        they fit, they stay in memory unwritten: at GPT-2 small with 1 GiB, holding them cost 0.16 GB of
        re-read parameters a step and writing them would cost 0.5 GB."""
        if not (self.spares and self.defer_grad_writes and self.grads is Tier.NVME):
            return False
        sizes = self.stored_itemsizes()
        if TensorClass.GRAD not in sizes:
            return False
        homed, _, _, _, chunk_job = self.host_working_set()
        held = homed + self.resident_bytes(plan)
        kept = sum(int(sizes[TensorClass.GRAD] * u.shard_numel) for u in self.units)
        return kept > host_bytes - held - chunk_job


def _name(t: Tier | None) -> str:
    return "none" if t is None else t.value
