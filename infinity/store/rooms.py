"""How the store finds bytes for what it is asked to hold, and the rooms a party holds through a phase.

:class:`RoomMaker` is the half of :class:`~infinity.store.tensor_store.TensorStore`
that makes room: a request short of bytes in its pool (the tier's shared pool,
or a :class:`~infinity.store.budget.Room`) has clean copies dropped (the
eviction policy picks), waits for operations in flight, and has dirty idle
copies written home first (a spill), as any write-back cache does; when none
of that would free enough, :class:`~infinity.store.budget.BudgetError`. A party
that holds host memory across a phase (the optimizer's look-ahead) opens a
room when the phase starts and asks ``within`` it; nobody else's request can
take its bytes and no party waits for another to give memory back. Like
:class:`~infinity.store.transfers.TransferRunner` it is a base class of the
store, not a separate object: it works on the store's bookkeeping under the
store's one lock, and starts I/O only outside it.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass
from typing import Callable

from infinity.store.budget import (BudgetError, Room, TierAccount, idle_candidates, plan_room, plan_spill,
                                   pool_of)
from infinity.store.records import KeyRecord, Transfer
from infinity.store.residency import Residency, StoreError, Tier
from infinity.store.transfers import done_future as _done

__all__ = ["RoomMaker", "Recharge", "charged_to"]

_R = Residency


@dataclass
class Recharge:
    """A current shared-pool copy to pin within ``room``: its bytes move into the room (see
    :meth:`RoomMaker._use_current`)."""

    rec: KeyRecord
    tier: Tier
    owner: object
    room: Room

    def apply(self, account: TierAccount, touch) -> cf.Future:
        """Under the lock, once the room has space: move the charge, pin, touch; the copy's done future."""
        copy = self.rec.copies[self.tier]
        account.unreserve(copy.reserved_bytes)   # the copy's own bytes back it in the room
        account.back(self.room, max(0, copy.reserved_bytes - self.room.backed_bytes))
        account.reserve(copy.reserved_bytes, self.room)
        copy.room = self.room
        copy.pin(self.owner)
        touch(copy)
        return _done(copy.tensor)


def charged_to(result, room: Room | None):
    """A planned Transfer charged to ``room`` (a future or a wait passes through)."""
    if room is not None and isinstance(result, Transfer):
        result.room = room
    return result


class RoomMaker:
    """Room-making and rooms for the store that inherits it (see the module docstring)."""

    def open_room(self, tier: Tier | str, name: str, want: int | None = None, least: int = 0,
                  leave: int = 0) -> Room:
        """Hold bytes of ``tier`` for one party's phase (module doc) and return the :class:`Room` the party
        asks ``within`` until :meth:`close_room`. Its size: ``want`` bytes (None: as many as there are), or,
        where the tier holds fewer beside its homes, pinned copies, scratch and other rooms' sizes, that less
        ``leave`` (kept for everybody else), but at least ``least`` (:class:`BudgetError` if the tier cannot
        give that). What the tier has free now (less ``leave``) is set aside for it at once; where that is
        less than ``least``, the cached copies the policy would evict first become its own (still cached),
        and room is made for the rest as for a copy; beyond that it takes what it needs as it goes (see
        :class:`Room`)."""
        tier = Tier.parse(tier)
        with self._cond:
            if self._closed:
                raise StoreError(f"open_room {name!r}: the store is closed")
            acct = self._accounts[tier]
            room = Room(name, tier, self._room_size(tier, name, want, least, leave), floor_bytes=least)
            acct.back(room, max(0, min(room.size_bytes, acct.free_bytes() - leave)))
            self._rooms.add(room)
            lack = self._adopt(room, room.floor_bytes - room.backed_bytes)
        if lack > 0:   # the rest of its floor is made room for as for a copy
            try:
                self._reserve_room({tier: lack}, f"<room {name}>", None, lambda: acct.back(room, lack))
            except BaseException:
                self.close_room(room)
                raise
        return room

    def _adopt(self, room: Room, nbytes: int) -> int:
        """Under the lock: the shared pool's idle clean copies the policy would evict first, up to ``nbytes``,
        become ``room``'s own (cached still: its party may use them, or drop them for room); returns the
        bytes still lacking."""
        if nbytes <= 0:
            return 0
        candidates = idle_candidates(self._keys, room.tier, "", None)
        chosen = self.policy.choose(candidates, min(nbytes, sum(c.nbytes for c in candidates)))
        for c in chosen:
            copy = self._keys[c.key].copies[c.tier]
            self._accounts[room.tier].join_room(copy.reserved_bytes, room)
            copy.room = room
            nbytes -= copy.reserved_bytes
        return max(0, nbytes)

    def _room_size(self, tier: Tier, name: str, want: int | None, least: int, leave: int) -> int:
        """Under the lock: the size of a room :meth:`open_room` opens now (see there)."""
        acct = self._accounts[tier]
        # what the shared pool holds for good: homes, pinned copies, scratch (copies in motion land unpinned)
        movable = sum(c.reserved_bytes for rec in self._keys.values() if tier is not rec.home
                      for c in (rec.copies[tier],) if c.state is not _R.ABSENT and not c.pins
                      and pool_of(c.room) is None)
        fixed = acct.in_use_bytes - movable   # other rooms' copies are held too
        there = acct.budget_bytes - fixed - sum(r.size_bytes - r.used_bytes for r in self._rooms if r.tier is tier)
        size = there - leave if want is None else min(want, there - leave)
        size = max(size, least)
        if size > there:
            raise BudgetError(tier, acct.budget_bytes, acct.in_use_bytes, size,
                              f"room {name!r} needs at least {least} bytes, and the tier can free only {there} "
                              f"beside its homes, pinned copies, scratch and other rooms")
        return size

    def close_room(self, room: Room) -> None:
        """End ``room``'s phase: its unused bytes go back to the shared pool, and the copies charged to it
        become ordinary cached copies there. Idempotent."""
        with self._cond:
            if room.open:
                self._accounts[room.tier].give_back(room)
                self._rooms.discard(room)
                self._cond.notify_all()

    def _use_current(self, rec: KeyRecord, tier: Tier, pin: bool, owner, within: Room | None):
        """The current ``tier`` copy, pinned for ``owner`` (a resolved token) if ``pin``: a done future. A copy
        of the shared pool pinned ``within`` an open room of that tier moves into the room first (a
        :class:`Recharge` for :meth:`_issue` to make room for): whatever a room's party pins, its room holds."""
        copy = rec.copies[tier]
        room = pool_of(within)
        if pin and room is not None and room.tier is tier and tier is not rec.home and pool_of(copy.room) is None:
            return Recharge(rec, tier, owner, room)
        if pin:
            copy.pin(owner)
        self._touch(copy)
        return _done(copy.tensor)

    def _reserve_room(self, needs: dict[Tier, int], what: str, room: Room | None, take: Callable) -> None:
        """Make room for ``needs`` (in ``room`` for its tier) as :meth:`_issue` does, then ``take()`` it under
        the lock (reserve the bytes)."""
        waited_from = None
        try:
            while True:
                with self._cond:
                    while True:
                        if self._closed:
                            raise StoreError(f"{what}: the store is closed")
                        made = self._make_room(needs, what, room)
                        if made is True:
                            take()
                            return
                        if made:
                            break
                        waited_from = waited_from or time.perf_counter()
                        self._cond.wait()
                self._start_spills(made)
        finally:
            if waited_from is not None:
                with self._cond:
                    self._add_wait(time.perf_counter() - waited_from)

    def _make_room(self, needs: dict[Tier, int], key: str, room: Room | None = None, backing: bool = True):
        """Under the lock, evict what the policy picks so that ``needs`` fits (in ``room`` for its tier, see
        :func:`~infinity.store.budget.plan_room`): True. False: wait for ops in flight. Short with nothing to
        evict or wait for but dirty idle copies: their write-backs are begun here (a spill) and returned as
        ``[(rec, op), ...]`` for the caller to start outside the lock, then wait as for any op in flight."""
        try:
            planned = plan_room(self._accounts, self.policy, self._keys, needs, key, room, backing)
        except BudgetError as e:
            begun = []
            for k in plan_spill(self._keys, e.tier, e.requested_bytes, e.room):
                rec = self._keys[k]
                op = self._plan_current(rec, rec.home, "write_back", False)
                if isinstance(op, Transfer):
                    self._begin(rec, op)
                    begun.append((rec, op))
            if not begun:
                raise
            self._spills[e.tier] += len(begun)
            return begun
        if planned is None:
            return False
        victims, backs = planned
        for c in victims:
            self._drop(self._keys[c.key], c.tier, "evict (budget)")
            self._evictions[c.tier] += 1
            self.recent_evictions.append((c.key, c.tier))
        for r, nbytes in backs.items():
            self._accounts[r.tier].back(r, max(0, nbytes - r.backed_bytes))
        return True

    def _start_spills(self, begun: list) -> None:
        """Outside the lock: run the write-backs :meth:`_make_room` began for room and wait for them. One
        that fails (the disk full, say) fails the request that needed the room, with its cause; the key
        stays dirty, its bytes kept."""
        for rec, op in begun:
            self._start(rec, op)
        for rec, op in begun:
            try:
                op.future.result()
            except BaseException as e:
                if hasattr(e, "add_note"):
                    e.add_note(f"infinity store: writing {rec.key!r} home to make room failed")
                raise
