"""A unit shard whose tensors of some classes live in the tiered store.

:class:`StoreUnitShard` keeps the :class:`~infinity.zero.units.UnitShard`
contract (``put`` / ``get`` / ``has``), so the engine, the checkpoint code and
the optimizer see one interface: classes the :class:`Placement` leaves in
memory are held as plain tensors; placed classes become store keys
``f"u{unit}.{class}"`` homed in their tier. ``get`` on a stored class brings a
working copy to the class's work tier and waits, so the returned tensor is
usable at once, for reading or writing (a checkpoint saves and loads one unit
at a time this way): the copy is *lent* (:class:`LentCopies`), and at the next
use of the store through a shard or the engine it is marked changed and written
home. So writes to a lent tensor must be done before that next use; and a
reader pays one write-back per lent copy, which :meth:`StoreUnitShard.read`
(read-only) and :meth:`StoreUnitShard.update` (a scoped write) avoid. Code on
the hot path uses :meth:`key` and the store's own async methods instead.

A stored class may alias another (fp32 training with params and optimizer in
the same tier: MASTER is the PARAM key), so one copy serves both.

The engine's verbs (:meth:`param_for_gather`, :meth:`fold_grad`,
:meth:`job_field`, ...) are the in-memory shard's, done through the store for
stored classes: a gather reads a pinned device copy, a first gradient replaces
the stored one without reading it, an optimizer job names store keys.
"""

from __future__ import annotations

import contextlib

import torch

from infinity.store import TensorStore, Tier
from infinity.zero.placement import Placement, store_key
from infinity.zero.units import TensorClass, UnitShard

__all__ = ["StoreUnitShard", "LentCopies"]


class LentCopies:
    """Working copies handed out by ``get`` that the caller may have written; one list per store.

    :meth:`settle` marks each one changed and starts its write-back. It runs
    before the next operation any shard or the engine does on the store, so a
    lent copy is still current then (nothing between could have moved it).
    """

    def __init__(self, store: TensorStore):
        self.store = store
        self._lent: list = []   # (key, tier)

    def add(self, key: str, tier) -> None:
        self._lent.append((key, tier))

    def settle(self) -> None:
        lent, self._lent = self._lent, []
        for key, tier in lent:
            if key not in self.store:
                continue   # released since (the engine closed)
            self.store.mark_dirty(key, tier)
            if self.store.home(key) is not tier:
                self.store.write_back(key)   # in the background; a later bring waits for it


class StoreUnitShard(UnitShard):
    """This rank's tensors of one unit: in memory or in the store, as ``placement`` says."""

    def __init__(self, store: TensorStore, unit_index: int, placement: Placement, lent: LentCopies):
        super().__init__()
        self.store, self.unit_index, self.placement, self.lent = store, unit_index, placement, lent
        self._keys: dict = {}     # TensorClass -> store key

    def put(self, cls: TensorClass, tensor: torch.Tensor) -> None:
        """Memory classes keep ``tensor``; stored ones copy it into a new key (waits until home)."""
        home = self.placement.home(cls)
        if home is None:
            super().put(cls, tensor)
            return
        key = store_key(self.unit_index, cls)
        self.store.wait(self.store.register(key, tensor, home=home))
        self._keys[cls] = key

    def put_zeros(self, cls: TensorClass, numel: int, dtype: torch.dtype, device) -> None:
        """Like ``put(cls, torch.zeros(...))`` without building the zeros in memory for stored classes."""
        home = self.placement.home(cls)
        if home is None:
            super().put(cls, torch.zeros(numel, dtype=dtype, device=device))
            return
        key = store_key(self.unit_index, cls)
        self.store.wait(self.store.register(key, (numel,), dtype=dtype, home=home))
        self._keys[cls] = key

    def alias(self, cls: TensorClass, same_as: TensorClass) -> None:
        """``cls`` is the very tensor of ``same_as`` (stored or not)."""
        if same_as in self._keys:
            self._keys[cls] = self._keys[same_as]
        else:
            super().put(cls, super().get(same_as))

    def key(self, cls: TensorClass) -> str | None:
        """The store key of a stored class; None for a class held in memory."""
        return self._keys.get(cls)

    def get(self, cls: TensorClass) -> torch.Tensor:
        """The class's tensor, usable at once; a stored one is lent (see the module doc)."""
        key = self._keys.get(cls)
        if key is None:
            return super().get(cls)
        self.lent.settle()
        tier = self.placement.work_tier(cls)
        tensor = self.store.wait(self.store.bring(key, tier))
        self.lent.add(key, tier)
        return tensor

    def read(self, cls: TensorClass) -> torch.Tensor:
        """Like :meth:`get` for a caller that will not write: nothing is written back."""
        key = self._keys.get(cls)
        if key is None:
            return super().get(cls)
        self.lent.settle()
        return self.store.wait(self.store.bring(key, self.placement.work_tier(cls)))

    def has(self, cls: TensorClass) -> bool:
        return cls in self._keys or super().has(cls)

    def is_alias(self, cls: TensorClass, other: TensorClass) -> bool:
        if cls in self._keys or other in self._keys:
            return self._keys.get(cls) is not None and self._keys.get(cls) == self._keys.get(other)
        return super().has(cls) and super().has(other) and super().get(cls) is super().get(other)

    @contextlib.contextmanager
    def update(self, cls: TensorClass):
        """``with shard.update(cls) as t:`` change a class in place (stored: pinned, marked dirty,
        written back home asynchronously afterwards)."""
        key = self._keys.get(cls)
        if key is None:
            yield super().get(cls)
            return
        self.lent.settle()
        tier = self.placement.work_tier(cls)
        with self.store.use(key, tier, dirty=True) as t:
            yield t
        if self.store.home(key) is not tier:
            self.store.write_back(key)   # completes in the background; a later bring waits for it

    def replace(self, cls: TensorClass, tensor: torch.Tensor):
        """New contents for a stored class without reading the old ones (the key is re-registered:
        NVMe homes get a fresh extent, one write and no read). Returns the store's future; the
        tensor is copied off the caller's thread (``tensor`` must stay unchanged until the future
        is done), and a later bring of the key waits for the copy and the write. May be retried
        after a BudgetError: the register that failed left the key released."""
        key = self._keys[cls]
        self.lent.settle()
        if key in self.store:
            self.store.release(key)
        return self.store.register(key, tensor, home=self.placement.home(cls), copy_async=True)

    # ------------------------------------------------------------ the engine's verbs

    def param_for_gather(self):
        """The parameter shard on the device tier, pinned while the all-gather reads it (an eviction
        meanwhile would hand its budget to another key), and the unpin for when the gather is done."""
        key = self._keys.get(TensorClass.PARAM)
        if key is None:
            return super().param_for_gather()
        self.lent.settle()   # a checkpoint load may have written the shard through get()
        src = self.store.wait(self.store.bring(key, Tier.DEVICE, pin=True))
        return src, lambda: self.store.unpin(key, Tier.DEVICE)

    def prefetch_param(self) -> None:
        """Start bringing the stored parameter shard to the device tier (raises BudgetError if full)."""
        key = self._keys.get(TensorClass.PARAM)
        if key is not None:
            self.store.bring(key, Tier.DEVICE)

    def fold_grad(self, reduced: torch.Tensor, first: bool, inspect=None):
        key = self._keys.get(TensorClass.GRAD)
        if key is None:
            return super().fold_grad(reduced, first, inspect)
        if first:
            # it *is* the shard, so the old bytes are never read (zero_grad is lazy, saving a read
            # and a write of every stored shard per step)
            if inspect is not None:
                inspect(reduced)
            return self.replace(TensorClass.GRAD, reduced)
        with self.update(TensorClass.GRAD) as g:   # pinned + marked dirty, written home in the background
            g.add_(reduced.to(g.device))
            if inspect is not None:
                inspect(g)   # the sum itself may overflow; looked at while it is here
        return None

    def job_field(self, cls: TensorClass):
        return self._keys.get(cls) or super().get(cls)

    def settle(self) -> None:
        self.lent.settle()

    def write_back_dirty(self) -> list:
        futures = []
        for key in set(self._keys.values()):
            if key in self.store and self.store.is_dirty(key) and self.store.home(key) is not Tier.HOST:
                futures.append(self.store.write_back(key))
        return futures

    def release(self) -> None:
        """Forget this shard's stored keys (the engine is closing)."""
        for key in set(self._keys.values()):
            if key in self.store:
                self.store.release(key)
        self._keys.clear()
        super().release()
