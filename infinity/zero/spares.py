"""A speculative update's spare copies of one unit's shard (``optimizer.update_at: speculative``).

:class:`SpareSet` holds, beside each class Adam writes, a second copy the speculation writes into and the
commit swaps in: for a stored class a spare store key per chunk (same shape, dtype and home, registered
when the set is made), for a class kept in memory a spare tensor per chunk (made on first use). The shard
keeps only its current copies; the speculative schedule (:mod:`infinity.zero.speculation`) owns one set per
unit, asks it where a job writes (:meth:`SpareSet.field`) and what a job frees (:meth:`SpareSet.drops`),
and on commit swaps the keys (:meth:`SpareSet.commit`, no bytes moved) or copies the tensors.
"""

from __future__ import annotations

import contextlib

import torch

from infinity.store import StoreError, Tier
from infinity.zero.placement import OPTIMIZER_CLASSES
from infinity.zero.units import TensorClass

__all__ = ["SpareSet"]


class SpareSet:
    """The spares of ``shard`` (a :class:`~infinity.zero.store_shard.StoreUnitShard`) for ``classes``;
    aliases (a master that is the parameter) share theirs. Waits until every spare key is home."""

    def __init__(self, shard, classes):
        self.shard, self.store = shard, shard.store
        self._keys: dict = {}       # TensorClass -> spare keys, one per chunk (stored classes)
        self._tensors: dict = {}    # (TensorClass, chunk) -> spare tensor (classes in memory)
        for cls in classes:
            self._add(cls)

    def _add(self, cls: TensorClass) -> None:
        keys = self.shard.keys(cls)
        if not keys or cls in self._keys:
            return
        same = [other for other in self._keys if self.shard.keys(other) is keys]
        if same:
            self._keys[cls] = self._keys[same[0]]
            return
        spares = tuple(f"{key}~" for key in keys)
        futures = []
        for key, spare in zip(keys, spares):
            shape, dtype = self.store.layout(key)
            futures.append(self.store.register(spare, shape, dtype=dtype, home=self.store.home(key)))
        for f in futures:
            self.store.wait(f)
        for spare in spares:   # a spare is claimed whole before it is read: nothing cached
            if self.store.home(spare) is not Tier.HOST:
                self.store.wait(self.store.evict(spare, Tier.HOST))
        self._keys[cls] = spares

    def field(self, cls: TensorClass, chunk: int = 0):
        """Where a speculative job writes chunk ``chunk`` of ``cls``: its spare key (a stored class), or a
        spare tensor shaped like the chunk (a class in memory, made on first use)."""
        if self.shard.keys(cls):
            return self._keys[cls][chunk]
        spare = self._tensors.get((cls, chunk))
        if spare is None:
            spare = self._tensors[(cls, chunk)] = torch.empty_like(self.shard.job_field(cls, chunk))
        return spare

    def drops(self, chunk: int = 0) -> tuple:
        """The shard's ``dropped_after_update`` for a speculative job: the spare keys of the streamed states."""
        return tuple(self._keys[cls][chunk] for cls in OPTIMIZER_CLASSES
                     if cls in self._keys and self.shard.streams(cls, chunk))

    def commit(self, classes) -> None:
        """A speculative update of ``classes`` is final: each spare key becomes the class's key (and the old
        key the spare, its cached copies dropped: they hold the step before), and each spare tensor's bytes
        are copied into the class's tensor."""
        moved: list = []
        for cls in classes:
            old = self.shard.keys(cls)
            if old and cls in self._keys:
                if any(old is m for m in moved):
                    continue   # an alias of a class already moved
                new = self._keys[cls]
                for other in self.shard.replace_keys(old, new):   # aliases move together
                    self._keys[other] = old
                moved.append(new)
                for key in old:   # their room, sooner than the LRU would free it (a pinned one is left to it)
                    for tier in (Tier.DEVICE, Tier.HOST):
                        if tier.rank < self.store.home(key).rank:
                            with contextlib.suppress(StoreError):
                                self.store.discard(key, tier)
            else:
                for (c_cls, chunk), spare in self._tensors.items():
                    if c_cls is cls:
                        self.shard.job_field(cls, chunk).copy_(spare)

    def release(self) -> None:
        """Forget the spare keys (the shard's own are released by the shard)."""
        for key in {k for keys in self._keys.values() for k in keys}:
            if key in self.store:
                self.store.release(key)
        self._keys.clear()
        self._tensors.clear()
