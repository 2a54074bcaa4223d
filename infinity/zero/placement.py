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

from dataclasses import dataclass

from infinity.config import Config, ConfigError, format_size
from infinity.store import Tier
from infinity.zero.units import TensorClass

__all__ = ["Placement", "store_key"]

_OPTIMIZER_CLASSES = (TensorClass.MASTER, TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ)


def store_key(unit_index: int, cls: TensorClass) -> str:
    return f"u{unit_index}.{cls.value}"


def _tier(value: str) -> Tier | None:
    return None if value == "none" else Tier(value)


@dataclass(frozen=True)
class Placement:
    """Home tier per tensor class; None = engine memory (not in the store)."""

    params: Tier | None = None
    grads: Tier | None = None
    optimizer: Tier | None = None

    @classmethod
    def from_config(cls, config: Config) -> "Placement":
        """The config's cross-checks (stage / nvme_path) have already run in ``Config``."""
        off = config.offload
        return cls(params=_tier(off.params), grads=_tier(off.grads), optimizer=_tier(off.optimizer))

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

    def min_budgets(self, units: list, stage: int, param_itemsize: int, reduce_itemsize: int) -> dict:
        """The least host and device tier budgets a training step needs with this placement:
        ``{Tier.HOST: (bytes, why), Tier.DEVICE: (bytes, why)}``.

        Host: every host-homed copy stays there (a home is never evicted), and one unit's optimizer
        update holds all of that unit's stored classes in host memory at once (master, moments,
        gradient, new parameter), so the largest such working set must fit beside the host homes.
        Device (stage 3, parameters stored): a unit's all-gather reads a device copy of its shard,
        so the largest parameter shard must fit.
        """
        fp32_master = self.master_is_param(param_itemsize == 4)
        homed, worst, worst_unit = 0, 0, None
        for u in units:
            sizes = {TensorClass.PARAM: param_itemsize, TensorClass.EXP_AVG: 4, TensorClass.EXP_AVG_SQ: 4,
                     TensorClass.MASTER: 0 if fp32_master else 4, TensorClass.GRAD: reduce_itemsize}
            if stage < 2:
                sizes.pop(TensorClass.GRAD)   # stages 0-1 keep gradients in the in-memory arena
            job = 0
            for cls, itemsize in sizes.items():
                tier = self.home(cls)
                if tier is Tier.HOST:
                    homed += itemsize * u.shard_numel
                elif tier is Tier.NVME:
                    job += itemsize * u.shard_numel
            if job > worst:
                worst, worst_unit = job, u.name
        host = homed + worst
        why = (f"{homed} bytes of host-homed shards" if homed else "no host-homed shards") + \
            (f" + the optimizer update of unit {worst_unit!r} ({worst} bytes of stored states brought to host)"
             if worst_unit is not None else "")
        device, device_why = 0, "no stored parameters gathered"
        if stage == 3 and self.params is not None:
            largest = max(units, key=lambda u: u.shard_numel)
            device = largest.shard_numel * param_itemsize
            device_why = f"the all-gather of unit {largest.name!r} reads its {device}-byte parameter shard there"
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
