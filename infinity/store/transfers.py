"""How a planned :class:`Transfer` runs: hop by hop, with its states, reservations and rollback.

:class:`TransferRunner` is the half of :class:`~infinity.store.tensor_store.TensorStore`
that executes what the other half planned. It is a base class of the store, not a
separate object, because every step reads and writes the store's bookkeeping
under the store's one lock: ``_cond``, ``_keys``, ``_accounts``, ``pool``,
``_extents``, ``_copier``, the counters, and the helpers ``_touch`` / ``_refuse``.
The rule it keeps: states change only under the lock, I/O and copies run only
outside it, and a hop's completion callback never raises into the I/O thread.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch

from infinity.store.records import INVALID_VERSION, CopyRecord, KeyRecord, Transfer
from infinity.store.residency import Residency, StoreError, Tier

__all__ = ["TransferRunner", "done_future"]

_R = Residency


def done_future(result=None) -> cf.Future:
    """A future that is already complete (an operation with nothing to move)."""
    f: cf.Future = cf.Future()
    f.set_result(result)
    return f


class TransferRunner:
    """Runs transfers for the store that inherits it (see the module docstring for what it relies on)."""

    def _begin(self, rec: KeyRecord, op: Transfer) -> None:
        """Under the lock: reserve, set states, mark the key busy. No I/O here."""
        if op.kind == "register":
            self._keys[rec.key] = rec
        for _, t in op.hops:
            copy = rec.copies[t]
            if copy.state is _R.ABSENT:
                copy.reserved_bytes = self._cost(rec, t)
                copy.room = op.room if op.room is not None and op.room.tier is t else None
                self._accounts[t].reserve(copy.reserved_bytes, copy.room)
                op.new_copies.append(t)
            rec.move(t, _R.FILLING, op.kind)
        first_src = op.hops[0][0]
        if first_src is not None:
            rec.move(first_src, _R.DRAINING, op.kind)
        rec.op = op

    def _start(self, rec: KeyRecord, op: Transfer) -> None:
        """Outside the lock: allocate the new copies' memory, then run the first hop."""
        try:
            for t in op.new_copies:
                copy = rec.copies[t]
                if t is Tier.HOST:
                    copy.buffer = self.pool.acquire(rec.nbytes)
                    copy.tensor = copy.buffer[:rec.nbytes].view(rec.dtype).view(rec.shape)
                elif t is Tier.DEVICE:
                    copy.buffer = self._device_buffer(rec)
                    copy.tensor = torch.empty(rec.shape, dtype=rec.dtype, device=self.device) if copy.buffer is None \
                        else copy.buffer[:rec.nbytes].view(rec.dtype).view(rec.shape)
        except BaseException as e:   # noqa: BLE001 - out of memory: fail the op, roll back the reservation
            self._hop_done(rec, op, 0, e)
            return
        self._run_hop(rec, op, 0)

    def _device_buffer(self, rec: KeyRecord):
        """A CPU device tier's working copy from its pool (a home copy, which callers may keep views of
        for good, and a request the pool has no room for, as the pool rounds sizes up, are allocated
        plainly: None)."""
        if self.device_pool is None or rec.home is Tier.DEVICE:
            return None
        try:
            return self.device_pool.acquire(rec.nbytes)
        except StoreError:
            return None

    def _run_hop(self, rec: KeyRecord, op: Transfer, index: int) -> None:
        """Outside the lock: start hop ``index``; its source is DRAINING and its target FILLING."""
        src, dst = op.hops[index]
        try:
            if src is None and op.init is not None and op.copy_async:
                # the copier holds init until its bytes have landed (on CUDA: in the side stream)
                fut = self._copy(dst, rec.copies[dst].tensor, op.init.detach())
                op.init = None
            elif src is None:   # register / claim: the caller's tensor (or zeros), copied synchronously
                target = rec.copies[dst].tensor
                with torch.no_grad():   # init may be a Parameter: the copy must not join its graph
                    target.copy_(op.init) if op.init is not None else target.zero_()
                op.init = None
                fut = done_future()
            elif dst is Tier.NVME:
                fut = self._extents.write(rec.key, rec.copies[src].buffer[:rec.nbytes])
            elif src is Tier.NVME:
                fut = self._extents.read(rec.key, rec.copies[dst].buffer[:rec.nbytes])
            else:
                fut = self._copy(dst, rec.copies[dst].tensor, rec.copies[src].tensor)
        except BaseException as e:   # noqa: BLE001 - a hop that cannot even start fails its op
            self._hop_done(rec, op, index, e)
            return
        fut.add_done_callback(lambda f: self._hop_done_guarded(rec, op, index, f.exception()))

    def _copy(self, dst_tier: Tier, dst: torch.Tensor, src: torch.Tensor) -> cf.Future:
        """A memory-to-memory hop on the copier lane of its direction (into the device tier or out of it)."""
        lane = self._copier.to_device if dst_tier is Tier.DEVICE else self._copier.to_host
        return lane(dst, src)

    def _hop_done_guarded(self, rec: KeyRecord, op: Transfer, index: int, error: BaseException | None) -> None:
        """Futures swallow what their callbacks raise: a bug here must still fail the op, not hang it."""
        try:
            self._hop_done(rec, op, index, error)
        except BaseException as e:   # noqa: BLE001
            if not op.future.done():
                op.future.set_exception(e)
            raise

    def _hop_done(self, rec: KeyRecord, op: Transfer, index: int, error: BaseException | None) -> None:
        """A hop finished (on an io/copy thread, or inline). Update states; start the next hop or finish."""
        src, dst = op.hops[index]
        more = error is None and index + 1 < len(op.hops)
        with self._cond:
            if error is None:
                rec.move(dst, _R.RESIDENT, op.kind)
                rec.copies[dst].version = op.version
                self._touch(rec.copies[dst])
                # a claim's first hop moves nothing between tiers: its copy is zero-filled in place, or
                # filled from the caller's tensor (a gradient leaving the device; uncounted, as the
                # caller's own copy was); a write home after it is counted like any
                if op.kind != "claim" or src is not None:
                    self._moved_bytes[f"{src.value if src else 'caller'}->{dst.value}"] += rec.nbytes
            if more:
                # In one locked step, so no get() can grab the copy between landing and leaving.
                rec.move(dst, _R.DRAINING, op.kind)
                # An evicted copy stays DRAINING until home has its bytes: pinning it or handing
                # it out meanwhile would let a writer race the drop that follows.
                if src is not None and not (op.kind == "evict" and src is op.hops[0][0]):
                    rec.move(src, _R.RESIDENT, op.kind)
            else:
                for t in Tier:
                    if rec.copies[t].state is _R.DRAINING:
                        rec.move(t, _R.RESIDENT, op.kind)
                result = self._finish(rec, op) if error is None else self._fail(rec, op, index)
            self._cond.notify_all()
        if more:
            self._run_hop(rec, op, index + 1)
        elif error is not None:
            if hasattr(error, "add_note"):
                error.add_note(f"infinity store: {op.kind} of key {rec.key!r} failed moving "
                               f"{src.value if src else 'caller'} -> {dst.value}; the key keeps its previous state")
            op.future.set_exception(error)
        elif isinstance(result, BaseException):
            op.future.set_exception(result)
        else:
            op.future.set_result(result)

    def _finish(self, rec: KeyRecord, op: Transfer):
        """Under the lock, after the last hop: the op's result (or the error to raise)."""
        rec.op = None
        result = None
        if op.kind == "evict":
            evicted = op.hops[0][0]
            if rec.sole_newest(evicted):   # mark_dirty'd while draining: home is stale again
                result = self._refuse(rec, evicted, "evict", "it was marked dirty while being written "
                                                             "back; it was kept, evict again")
            else:
                self._drop(rec, evicted, "evict")
                self._explicit_evictions[evicted] += 1
                self.recent_evictions.append((rec.key, evicted))
        elif op.kind == "bring":
            result = rec.copies[op.target].tensor
        elif op.kind == "claim":
            rec.latest = op.version   # the claimed copy is the newest version; every other copy is stale
            result = rec.copies[op.target].tensor
        for owner in op.pins_on_done:
            rec.copies[op.target].pin(owner)
        return result

    def _fail(self, rec: KeyRecord, op: Transfer, index: int) -> None:
        """Under the lock: undo what hop ``index`` and the hops after it reserved.

        Copies filled by earlier hops stay (they are valid); a new copy that was being
        filled is dropped; an existing copy (a stale one, or home) keeps its bytes but
        holds no valid version. The source keeps the newest bytes, so nothing is lost.
        """
        rec.op = None
        for _, t in op.hops[index:]:
            copy = rec.copies[t]
            if copy.state is not _R.FILLING:
                continue
            copy.version = INVALID_VERSION
            if t in op.new_copies and t is not rec.home:
                self._drop(rec, t, f"{op.kind} (failed)")
            else:
                rec.move(t, _R.RESIDENT, f"{op.kind} (failed)")
        if op.kind == "register":
            # Never became a key. Its extent is not stored either: io forgets a failed write.
            for t in Tier:
                if rec.copies[t].state is not _R.ABSENT:
                    self._drop(rec, t, "register (failed)")
            del self._keys[rec.key]

    def _drop(self, rec: KeyRecord, tier: Tier, op: str) -> None:
        """Under the lock: free one copy's memory and its reservation (NVMe: the caller frees the extent)."""
        copy = rec.copies[tier]
        rec.move(tier, _R.ABSENT, op)
        if copy.buffer is not None:
            (self.pool if tier is Tier.HOST else self.device_pool).release(copy.buffer)
        self._accounts[tier].unreserve(copy.reserved_bytes, copy.room)
        rec.copies[tier] = CopyRecord()
