"""How a request becomes a :class:`Transfer` and is issued: the hops, the source, the waits.

:class:`TransferPlanner` is the part of :class:`~infinity.store.tensor_store.TensorStore`
that plans what :class:`~infinity.store.transfers.TransferRunner` runs. A request's
``plan`` (under the store's one lock) returns a future (nothing to move, or an
operation in flight to share), a Transfer, or None (wait); :meth:`TransferPlanner._issue`
waits for the key to be idle and for room (made by
:class:`~infinity.store.rooms.RoomMaker`), then begins the Transfer under the lock and
starts it outside. Moves go between adjacent tiers only, from the nearest current
copy, and never overwrite a copy another owner has pinned. Like the other parts it
is a base class of the store, not a separate object.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Callable

from infinity.store.budget import Room, pool_of
from infinity.store.records import KeyRecord, Transfer
from infinity.store.residency import Residency, StoreError, Tier
from infinity.store.rooms import Recharge
from infinity.store.transfers import done_future as _done

__all__ = ["TransferPlanner", "pin_owner"]

_R = Residency


def pin_owner(owner):
    """A pin's owner token: the caller's, or its thread when it named none."""
    return threading.get_ident() if owner is None else owner


class TransferPlanner:
    """Plans and issues the store's requests for the store that inherits it (see the module docstring)."""

    @staticmethod
    def _path(src: Tier, dst: Tier) -> list[tuple[Tier, Tier]]:
        """Adjacent-tier hops from ``src`` to ``dst`` (device -> host -> nvme or back)."""
        lo, hi = sorted((src.rank, dst.rank))
        tiers = list(Tier)[lo:hi + 1]
        if src.rank > dst.rank:
            tiers.reverse()
        return list(zip(tiers, tiers[1:]))

    def _plan_current(self, rec: KeyRecord, tier: Tier, kind: str, pin: bool, owner=None,
                      within: Room | None = None):
        """A Transfer that makes the ``tier`` copy current, or a done future if it already is (or a
        :class:`Recharge`, see :meth:`_use_current`)."""
        if tier.rank > rec.home.rank:
            raise self._refuse(rec, tier, kind, f"it is slower than the home tier ({rec.home.value}); "
                                                "working copies live in faster tiers")
        copy = rec.copies[tier]
        if copy.state is _R.RESIDENT and copy.version == rec.latest:
            if kind == "write_back":
                return _done(None)
            return self._use_current(rec, tier, pin, owner, within)
        if rec.op is not None:
            return None   # another operation moves this key: wait for it, then plan again
        # Nearest current copy; on a tie the faster one (a memory copy beats a disk read).
        source = min(rec.current_tiers(), key=lambda t: (abs(t.rank - tier.rank), t.rank))
        hops = self._path(source, tier)
        if self._targets_pinned(rec, hops, kind, owner):
            return None
        op = Transfer(kind, tier, hops, version=rec.latest)
        op.pins_on_done = [pin_owner(owner)] if pin else []
        return op

    def _targets_pinned(self, rec: KeyRecord, hops: list, kind: str, owner=None) -> bool:
        """Whether a copy the hops would overwrite is pinned by another owner (then: wait for it).

        A pinned copy here is stale (a current one would be a source, not a target), and
        refreshing it in place would change bytes under its reader. If the caller (``owner``;
        None: the calling thread) holds the pin, waiting would deadlock, so that is an error instead.
        """
        for _, t in hops:
            if rec.copies[t].pinned_by_owner(owner):
                who = ("this thread has" if owner in (None, threading.get_ident())
                       else f"owner {owner!r} has")
                raise self._refuse(rec, t, kind, f"{who} it pinned, but it is stale and refreshing "
                                                 "it would overwrite it while in use; unpin it first")
            if rec.copies[t].pins:
                return True
        return False

    def _make_room_for(self, result, rec: KeyRecord, key: str):
        """:meth:`_make_room` for what ``plan`` returned: a Transfer's new copies (in its room, if charged to
        one), or a copy moving into a room (its own bytes come with it)."""
        if isinstance(result, Recharge):
            return self._make_room({result.tier: rec.copies[result.tier].reserved_bytes}, key, result.room,
                                   backing=False)
        needs = {t: self._cost(rec, t) for _, t in result.hops
                 if t is not Tier.NVME and rec.copies[t].state is _R.ABSENT}
        return self._make_room(needs, key, pool_of(result.room))

    def _cost(self, rec: KeyRecord, tier: Tier) -> int:
        return self.pool.buffer_bytes(rec.nbytes) if tier is Tier.HOST else rec.nbytes

    def _issue(self, key: str, op_name: str, plan: Callable, new_record: KeyRecord | None = None) -> cf.Future:
        """Wait for ``key`` to be idle and for room, then start the Transfer that ``plan`` returns.

        ``plan(rec)`` runs under the lock and returns a future (nothing to move, or a
        matching operation in flight to share), a Transfer to start, or None: the key is
        busy with another operation, wait and plan again.
        """
        waited_from = None
        try:
            while True:
                spills = None
                with self._cond:
                    while True:
                        if self._closed:
                            raise StoreError(f"{op_name} {key!r}: the store is closed")
                        rec = self._keys.get(key)
                        if rec is None and new_record is None:
                            raise StoreError(f"{op_name}: unknown key {key!r} (registered: {len(self._keys)} keys)")
                        # A key being released is waited out: it is gone afterwards (or re-registrable).
                        result = None if rec is not None and rec.op is not None and rec.op.kind == "release" \
                            else plan(rec)
                        if isinstance(result, cf.Future):
                            return result
                        made = None if result is None else self._make_room_for(result, rec or new_record, key)
                        if made is True and isinstance(result, Recharge):
                            return result.apply(self._accounts[result.tier], self._touch)
                        if made is True:
                            rec = rec or new_record
                            self._begin(rec, result)
                            break
                        if made:
                            spills = made
                            break
                        waited_from = waited_from or time.perf_counter()
                        self._cond.wait()
                if spills is None:
                    self._start(rec, result)
                    return result.future
                self._start_spills(spills)
        finally:
            if waited_from is not None:
                with self._cond:
                    self._add_wait(time.perf_counter() - waited_from)
