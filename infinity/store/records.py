"""The store's bookkeeping for one key: its copies and the operation moving them.

Plain data, read and written only under the store's lock. The rules that
connect them live in the store's parts (``tensor_store.py`` and the modules it
names); the legal state changes live in ``residency.py``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from dataclasses import dataclass, field

import torch

from infinity.store.residency import Residency, Tier, check_transition

__all__ = ["CopyRecord", "KeyRecord", "Transfer", "INVALID_VERSION"]

INVALID_VERSION = -1  # a copy whose bytes match no version (never filled, or a fill failed half-way)


@dataclass
class CopyRecord:
    """One key's copy in one tier."""

    state: Residency = Residency.ABSENT
    version: int = INVALID_VERSION
    tensor: torch.Tensor | None = None   # what get() hands out (device/host); None on NVMe or when absent
    buffer: torch.Tensor | None = None   # the pool buffer under ``tensor`` (host, a CPU device copy), returned on drop
    reserved_bytes: int = 0              # what this copy holds against its tier's budget
    room: object = None                  # the Room its bytes are charged to; None: the tier's shared pool
    # owner token -> pins: the token the pinning caller named (a unit's gather, a fold), else its thread id
    pinned_by: collections.Counter = field(default_factory=collections.Counter)
    last_use_tick: int = 0

    @property
    def pins(self) -> int:
        return sum(self.pinned_by.values())

    def pin(self, owner, count: int = 1) -> None:
        self.pinned_by[owner] += count

    def unpin(self, owner=None) -> bool:
        """Drop one pin of ``owner``; None: the calling thread's if it holds one, else the oldest holder's.
        False (nothing dropped) when ``owner`` holds none."""
        if owner is None:
            me = threading.get_ident()
            owner = me if self.pinned_by[me] else next(t for t, n in self.pinned_by.items() if n)
        elif not self.pinned_by[owner]:   # (a Counter's lookup of a missing owner adds no entry)
            return False
        self.pinned_by[owner] -= 1
        if not self.pinned_by[owner]:
            del self.pinned_by[owner]
        return True

    def pinned_by_owner(self, owner) -> bool:
        """Whether ``owner`` (None: the calling thread) holds a pin."""
        owner = threading.get_ident() if owner is None else owner
        return self.pinned_by.get(owner, 0) > 0


@dataclass
class Transfer:
    """An operation in flight on one key: a chain of hops between adjacent tiers.

    ``hops[i] = (src, dst)``; ``src`` None means "the caller's tensor" (register).
    ``version`` is the content version the hops carry, fixed when the operation
    starts, so a ``mark_dirty`` racing with it leaves the destination correctly stale.
    """

    kind: str                        # "register" | "bring" | "claim" | "write_back" | "evict" | "release"
    target: Tier
    hops: list[tuple[Tier | None, Tier]]
    version: int
    future: cf.Future = field(default_factory=cf.Future)
    new_copies: list[Tier] = field(default_factory=list)  # copies allocated (were ABSENT) for this op
    pins_on_done: list = field(default_factory=list)  # bring(pin=True) callers' owner tokens:
                                                        # pin the target for them when it lands
    init: torch.Tensor | None = None  # register: the caller's tensor (None = zeros)
    copy_async: bool = False          # register: copy ``init`` on the copier thread, not the caller's
    room: object = None               # the Room the new host copy is charged to (bring/claim ``within``)


@dataclass
class KeyRecord:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    home: Tier
    latest: int = 0                                  # newest content version anywhere
    copies: dict[Tier, CopyRecord] = field(default_factory=lambda: {t: CopyRecord() for t in Tier})
    op: Transfer | None = None                       # at most one operation per key at a time

    def move(self, tier: Tier, new: Residency, op: str) -> None:
        copy = self.copies[tier]
        check_transition(self.key, tier, copy.state, new, op)
        copy.state = new

    def is_current(self, tier: Tier) -> bool:
        c = self.copies[tier]
        return c.state in (Residency.RESIDENT, Residency.DRAINING) and c.version == self.latest

    def current_tiers(self) -> list[Tier]:
        return [t for t in Tier if self.is_current(t)]

    def sole_newest(self, tier: Tier) -> bool:
        """The ``tier`` copy holds the only newest contents: dropping it would lose them (write it home first)."""
        return self.current_tiers() == [tier]

    @property
    def dirty(self) -> bool:
        """Home holds an older version than some working copy."""
        return self.copies[self.home].version != self.latest

    def describe(self, tier: Tier) -> str:
        c = self.copies[tier]
        if c.state is Residency.ABSENT:
            return "ABSENT"
        freshness = "current" if c.version == self.latest else f"stale (v{c.version}, latest v{self.latest})"
        return f"{c.state.name}, {freshness}" + (f", pinned x{c.pins}" if c.pins else "")
