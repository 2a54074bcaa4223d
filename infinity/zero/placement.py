"""Which tier each tensor class of a unit shard lives in (DESIGN §3, "policies are data").

Built from ``offload.{optimizer,params,grads}``. ``None`` means "kept by the
engine in ordinary (device) memory, no store involved" — the ZeRO engine's
behaviour without offload. A class placed on ``host`` or ``nvme`` is a store
key ``f"u{unit}.{class}"`` with that home tier; the engine brings working
copies to the tier where they are used (:meth:`Placement.work_tier`).

Trade-offs: ``host`` frees device memory at the cost of a host<->device copy
per use; ``nvme`` frees host memory too at the cost of disk bandwidth, which
the optimizer pipeline and the prefetcher hide as far as the disk allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infinity.config import Config, ConfigError, format_size
from infinity.store import Tier
from infinity.zero.units import TensorClass

__all__ = ["Placement", "store_key", "chunk_bounds", "CHUNK_ALIGN_NUMEL"]

# a chunk's element count is a multiple of this: 4096 elements are 4096-byte aligned in any dtype
CHUNK_ALIGN_NUMEL = 4096

_OPTIMIZER_CLASSES = (TensorClass.MASTER, TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ)


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
    # backward (optimizer.overlap_backward), instead of a write now and a read at the step
    defer_grad_writes: bool = False

    @classmethod
    def from_config(cls, config: Config) -> "Placement":
        """The config's cross-checks (stage / nvme_path) have already run in ``Config``."""
        off = config.offload
        return cls(params=_tier(off.params), grads=_tier(off.grads), optimizer=_tier(off.optimizer),
                   chunk_bytes=off.chunk_bytes, defer_grad_writes=config.optimizer.overlap_backward)

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

    def stored_itemsizes(self, stage: int, param_itemsize: int, reduce_itemsize: int) -> dict:
        """Bytes per element of each class this placement stores (host or NVMe), as one optimizer job
        brings them: ``{TensorClass: itemsize}``; a master that is the parameter counts once."""
        sizes = {TensorClass.PARAM: param_itemsize, TensorClass.EXP_AVG: 4, TensorClass.EXP_AVG_SQ: 4,
                 TensorClass.MASTER: 0 if self.master_is_param(param_itemsize == 4) else 4,
                 TensorClass.GRAD: reduce_itemsize}
        if stage < 2:
            sizes.pop(TensorClass.GRAD)   # stages 0-1 keep gradients in the in-memory arena
        return {cls: n for cls, n in sizes.items() if n and self.home(cls) is not None}

    def chunk_numel(self, stage: int, param_itemsize: int, reduce_itemsize: int) -> int:
        """Elements per chunk of a stored unit shard: as many as fit ``chunk_bytes`` with every stored
        class of the chunk brought at once, in whole multiples of :data:`CHUNK_ALIGN_NUMEL` (direct I/O
        alignment for any dtype), at least one multiple."""
        per_element = sum(self.stored_itemsizes(stage, param_itemsize, reduce_itemsize).values()) or 1
        return max(CHUNK_ALIGN_NUMEL, self.chunk_bytes // per_element // CHUNK_ALIGN_NUMEL * CHUNK_ALIGN_NUMEL)

    def min_budgets(self, units: list, stage: int, param_itemsize: int, reduce_itemsize: int) -> dict:
        """The least host and device tier budgets a training step needs with this placement:
        ``{Tier.HOST: (bytes, why), Tier.DEVICE: (bytes, why)}``.

        Host: every host-homed copy stays there (a home is never evicted), and one optimizer job
        holds all of one chunk's stored classes in host memory at once (master, moments, gradient,
        new parameter), so the largest such working set must fit beside the host homes; chunks
        (``chunk_bytes``) bound it independently of unit size.
        Device (stage 3, parameters stored): a unit's all-gather reads a device copy of its shard,
        so the largest parameter shard must fit.
        """
        sizes = self.stored_itemsizes(stage, param_itemsize, reduce_itemsize)
        chunk = self.chunk_numel(stage, param_itemsize, reduce_itemsize)
        homed, worst, worst_unit = 0, 0, None
        for u in units:
            job = 0
            for cls, itemsize in sizes.items():
                if self.home(cls) is Tier.HOST:
                    homed += itemsize * u.shard_numel
                else:
                    job += itemsize * min(u.shard_numel, chunk)
            if job > worst:
                worst, worst_unit = job, u.name
        host = homed + worst
        why = (f"{homed} bytes of host-homed shards" if homed else "no host-homed shards") + \
            (f" + one optimizer job of unit {worst_unit!r} ({worst} bytes of stored states brought to host; "
             f"offload.chunk_bytes caps it)" if worst_unit is not None else "")
        device, device_why = 0, "no stored parameters gathered"
        if stage == 3 and self.params is not None:
            # a gather pins one chunk of the shard at a time (the whole shard when it is one chunk)
            largest = max(units, key=lambda u: u.shard_numel)
            device = min(largest.shard_numel, chunk) * param_itemsize
            device_why = f"the all-gather of unit {largest.name!r} reads {device} bytes of its parameter shard there"
        return {Tier.HOST: (host, why), Tier.DEVICE: (device, device_why)}

    def check_budgets(self, units: list, stage: int, param_itemsize: int, reduce_itemsize: int,
                      budgets: dict) -> None:
        """Raise ConfigError if a tier's budget (``budgets[tier]``, bytes) is below :meth:`min_budgets`,
        naming the key, the minimum and why."""
        need = self.min_budgets(units, stage, param_itemsize, reduce_itemsize)
        for tier, key in ((Tier.HOST, "tiers.host_bytes"), (Tier.DEVICE, "tiers.device_bytes")):
            least, why = need[tier]
            if budgets[tier] < least:
                raise ConfigError(f"{key} = {budgets[tier]} bytes ({format_size(budgets[tier])}) is below the "
                                  f"{least} bytes ({format_size(least)}) this model and placement need: {why}. "
                                  f"Set {key} to at least {format_size(least)}, or place less on that tier")

    def describe(self) -> dict:
        return {"params": _name(self.params), "grads": _name(self.grads), "optimizer": _name(self.optimizer)}


def _name(t: Tier | None) -> str:
    return "none" if t is None else t.value
