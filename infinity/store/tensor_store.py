"""The tiered tensor store: tensors under string keys, each with a home tier and working copies.

A key's *home* copy (device, host or NVMe) exists from ``register`` until
``release``; ``bring`` makes a working copy in a faster tier, ``write_back``
pushes the newest contents home, ``evict`` drops a working copy, ``release``
forgets the key. Moves are asynchronous and return ``concurrent.futures.Future``s;
a copy in motion is never handed out (``get`` raises; wait on the future).

Moves go between adjacent tiers only (device <-> host <-> NVMe), so NVMe to
device lands a host copy on the way; it stays as a clean cached copy that the
budget may evict. Each moving operation reserves every byte it needs, in every
tier, before it starts, and an operation in flight never waits for anything but
its own I/O, so ops in flight always finish and whoever waits for space on them
makes progress. Short of room, the store drops clean copies (the eviction
policy picks), waits for operations in flight, and writes dirty idle copies home
(a spill: once home they are clean and droppable), as any write-back cache does;
when none of that would free space, the request fails with :class:`BudgetError`
instead of waiting forever.

Rooms: a party that holds host memory across a phase (the optimizer's look-ahead)
sets its bytes aside when the phase starts (:meth:`TensorStore.open_room`) and
asks ``within`` that :class:`~infinity.store.budget.Room`; nobody else's request
can take those bytes, and the party's own requests make room only from its own
copies. No party waits for another to give memory back.

Parts, one concern a module, that :class:`TensorStore` is assembled from: how a
request becomes a transfer and is issued (:mod:`~infinity.store.planning`), the
transfers in flight (:mod:`~infinity.store.transfers`), rooms and making room
(:mod:`~infinity.store.rooms`), and what the store answers without moving
anything, with its counters (:mod:`~infinity.store.inspection`); this module
holds the verbs, host scratch and closing.

Locking: one lock + condition guards all bookkeeping. It is never held while
calling into the io layer, the device copier, or a returned future's
``set_result`` (whose callbacks may call back into the store); it is held while
the eviction policy runs, so a policy must not call the store. Completions run
on io / copy threads; do not call blocking store methods from callbacks on the
futures it returns.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import math
import os
import threading
import time
from typing import Iterator

import torch

from infinity.config import IOConfig, TiersConfig
from infinity.io import ExtentFile, IOEngine
from infinity.store.budget import Room, TierAccount, pool_of, resolve_budgets
from infinity.store.device_copy import DeviceCopier
from infinity.store.eviction import EvictionPolicy, LRUPolicy
from infinity.store.host_pool import HostBufferPool
from infinity.store.inspection import StoreInspector
from infinity.store.pinned_host import CudaHostRegistrar, HostRegistrar
from infinity.store.planning import TransferPlanner, pin_owner as _owner
from infinity.store.records import CopyRecord, KeyRecord, Transfer
from infinity.store.residency import Residency, StoreError, Tier
from infinity.store.rooms import RoomMaker, charged_to
from infinity.store.swap_dir import make_swap_dir
from infinity.store.transfers import TransferRunner, done_future as _done

__all__ = ["TensorStore"]

_R = Residency


class TensorStore(TransferPlanner, TransferRunner, RoomMaker, StoreInspector):
    """Tensors in device / host / NVMe tiers of one rank, within per-tier byte budgets.

    ``swap_dir`` (default ``tiers.nvme_path``) is needed once a key is homed on
    NVMe; the store makes its own private swap file there, removed on ``close``.
    ``policy`` picks eviction victims (default :class:`LRUPolicy`). ``budgets``: the device and host
    byte budgets (default: :func:`~infinity.store.budget.resolve_budgets` of ``tiers``; an engine that
    resolved them already passes its own, so "auto" is measured once). ``host_registrar`` page-locks
    host buffers (default: ``cudaHostRegister`` on a CUDA device, none on CPU). ``copier``: what moves
    bytes between host and device (default: a :class:`DeviceCopier` of ``device``; tests pass one that
    delays its copies).

    Pins have owners: ``pin=True`` / :meth:`pin` / :meth:`use` take an ``owner`` token (any hashable:
    a unit's gather, a gradient fold), and :meth:`unpin` with that token drops that owner's pin from
    any thread. Without a token the owner is the calling thread, which is wrong wherever the pinning
    and the unpinning code can run on different threads (on CUDA autograd runs backward hooks on its
    own device thread), so the engine's callers always name one.
    """

    def __init__(self, tiers: TiersConfig | None = None, io: IOConfig | None = None,
                 device: torch.device | str = "cpu", rank: int = 0, swap_dir: str | os.PathLike | None = None,
                 policy: EvictionPolicy | None = None, budgets: dict[Tier, int] | None = None,
                 host_registrar: HostRegistrar | None = None, copier: DeviceCopier | None = None):
        self.tiers_config = tiers if tiers is not None else TiersConfig()
        self.io_config = io if io is not None else IOConfig()
        self.device = torch.device(device)
        self.rank = rank
        self.swap_dir = swap_dir if swap_dir is not None else self.tiers_config.nvme_path
        self.policy = policy if policy is not None else LRUPolicy()
        budgets = budgets if budgets is not None else resolve_budgets(self.tiers_config, self.device)
        self._accounts = {Tier.DEVICE: TierAccount(Tier.DEVICE, budgets[Tier.DEVICE]),
                          Tier.HOST: TierAccount(Tier.HOST, budgets[Tier.HOST]),
                          Tier.NVME: TierAccount(Tier.NVME, None)}
        if host_registrar is None and self.device.type == "cuda" and torch.cuda.is_available():
            host_registrar = CudaHostRegistrar(self.device)   # CUDA-only: pinned, so copies run async
        self.pool = HostBufferPool(budgets[Tier.HOST], registrar=host_registrar)
        # a CPU device's tier is RAM, and its working copies come and go a chunk at a time (stage 3 brings
        # every parameter chunk there twice a step): buffers reused, as the host tier's are, spare a page
        # fault and a zeroed page per 4 KiB of each new one (on CUDA torch's caching allocator reuses them)
        self.device_pool = HostBufferPool(budgets[Tier.DEVICE]) if self.device.type == "cpu" else None
        self._copier = copier if copier is not None else DeviceCopier(self.device)
        self._engine: IOEngine | None = None
        self._extents: ExtentFile | None = None
        self._keys: dict[str, KeyRecord] = {}
        self._cond = threading.Condition(threading.Lock())
        self._tick = 0
        self._closed = False
        self._moved_bytes: collections.Counter = collections.Counter()   # "src->dst" -> bytes
        self._evictions: collections.Counter = collections.Counter()     # tier -> budget-driven drops
        self._explicit_evictions: collections.Counter = collections.Counter()
        self._spills: collections.Counter = collections.Counter()   # dirty copies written home for room (spill)
        self.recent_evictions: collections.deque = collections.deque(maxlen=4096)  # (key, tier) in order
        self._wait_s = 0.0
        self._scratch_bytes = 0        # host scratch buffers handed out (host_scratch), in the host account
        self._scratch_peak_bytes = 0
        self._thread_waits = threading.local()   # per thread: the engine charges its own thread's waits
        self._scratch_rooms: dict = {}   # host scratch buffer address -> the room it is charged to (or None)
        self._rooms: set = set()          # the open rooms (open_room)

    # ------------------------------------------------------------------ public operations

    def register(self, key: str, init: torch.Tensor | tuple | torch.Size, dtype: torch.dtype | None = None,
                 home: Tier | str = Tier.NVME, copy_async: bool = False) -> cf.Future:
        """Add ``key`` with home tier ``home``; its contents are ``init`` (a tensor) or zeros (a shape).

        The tensor is copied before this returns, so the caller may reuse it at once; with
        ``copy_async`` it is copied by the store's copy thread instead (on CUDA a side stream,
        so a device tensor's copy to host does not hold up the caller's stream), and the caller
        must leave it unchanged until the future is done. The
        future is done when the contents are home. An NVMe-homed key is staged through a
        host copy, which stays cached (clean) afterwards. If the write fails the key is
        not registered.
        """
        home = Tier.parse(home)
        if not isinstance(key, str) or not key:
            raise StoreError(f"register: key must be a non-empty str, got {key!r}")
        if isinstance(init, torch.Tensor):
            if dtype is not None and dtype != init.dtype:
                raise StoreError(f"register {key!r}: dtype {dtype} given for a tensor of dtype {init.dtype}")
            shape, dtype = tuple(init.shape), init.dtype
        else:
            if dtype is None:
                raise StoreError(f"register {key!r}: a shape needs a dtype")
            shape, init = tuple(int(n) for n in init), None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if home is Tier.NVME:
            self._open_extents(key)

        def plan(rec: KeyRecord | None) -> Transfer:
            if rec is not None:
                raise StoreError(f"register: key {key!r} is already registered (home {rec.home.value})")
            hops = [(None, Tier.HOST), (Tier.HOST, Tier.NVME)] if home is Tier.NVME else [(None, home)]
            return Transfer("register", home, hops, version=0, init=init, copy_async=copy_async)

        new = KeyRecord(key, shape, dtype, nbytes, home)
        return self._issue(key, "register", plan, new_record=new)

    def bring(self, key: str, tier: Tier | str, pin: bool = False, owner=None,
              within: Room | None = None) -> cf.Future:
        """Make the ``tier`` copy of ``key`` current. Future of its tensor (None for NVMe).

        ``tier`` may be the home tier or a faster one. With ``pin`` the copy is pinned
        (see :meth:`pin`; for ``owner``) atomically when it is ready, so nothing can evict it in
        between; without, another thread's bring may evict it under budget pressure once it is ready.
        A second bring of the same key and tier while one is in flight shares its future.
        ``within``: an open :class:`Room` of the caller's that a new copy in its tier is charged to.
        """
        tier = Tier.parse(tier)
        owner = _owner(owner)

        def plan(rec):
            if rec.op is not None and rec.op.kind == "bring" and rec.op.target is tier:
                if pin:
                    rec.op.pins_on_done.append(owner)
                return rec.op.future
            return charged_to(self._plan_current(rec, tier, "bring", pin, owner, within), within)
        return self._issue(key, "bring", plan)

    def claim(self, key: str, tier: Tier | str, pin: bool = False, src: torch.Tensor | None = None,
              write_home: bool = False, owner=None, within: Room | None = None) -> cf.Future:
        """A working copy of ``key`` in ``tier`` for a caller that will overwrite all of it.

        Unlike :meth:`bring`, the old contents are not read: an optimizer producing a new
        low-precision parameter needs none of the old one's bytes, and reading them from
        NVMe only to overwrite them doubles that tensor's traffic. The copy lands zeroed
        and becomes the key's newest version (every other copy, home included, is stale
        from then on); the caller writes it, then ``mark_dirty`` and ``write_back`` as after
        any change. Future of its tensor; ``pin`` and ``owner`` as in :meth:`bring`.

        With ``src`` (a tensor of the key's shape and dtype, on any device) the copy is filled from
        it instead of zeroed, by the copier lane of its direction (on CUDA a side stream, after the
        kernels the caller has queued so far), off the caller's thread: a gradient leaves the device
        without draining its stream. The key is busy until the bytes have landed (any other operation
        on it waits for them), and the caller must leave ``src`` unchanged until the future is done.
        With ``write_home`` as well, the same operation then writes the new bytes home (the key stays
        busy until they are there, and the claimed copy is left clean, so evictable).
        """
        tier = Tier.parse(tier)
        owner = _owner(owner)
        if write_home and src is None:
            raise StoreError(f"claim {key!r}: write_home needs src (a zero-filled copy is not worth writing)")
        if src is not None:
            src = src.detach()

        def plan(rec):
            if tier is Tier.NVME or tier.rank > rec.home.rank:
                raise self._refuse(rec, tier, "claim", "claim a device or host tier no slower than home")
            if src is not None and (tuple(src.shape) != rec.shape or src.dtype != rec.dtype):
                raise self._refuse(rec, tier, "claim", f"src is {tuple(src.shape)} {src.dtype}, the key "
                                                       f"{rec.shape} {rec.dtype}")
            if rec.op is not None:
                return None   # another operation moves this key: wait for it, then plan again
            copy = rec.copies[tier]
            if src is None and copy.state is _R.RESIDENT and copy.version == rec.latest:
                return self._use_current(rec, tier, pin, owner, within)   # nothing to discard or read
            hops = [(None, tier)] + (self._path(tier, rec.home) if write_home else [])
            if self._targets_pinned(rec, hops, "claim", owner):
                return None
            op = Transfer("claim", tier, hops, version=rec.latest + 1, init=src, copy_async=src is not None)
            op.pins_on_done = [owner] if pin else []
            return charged_to(op, within)
        return self._issue(key, "claim", plan)

    def write_back(self, key: str) -> cf.Future:
        """Push the newest contents of ``key`` to its home tier. Future[None]; done at once if clean."""
        def plan(rec):
            if rec.op is not None and rec.op.kind == "write_back":
                return rec.op.future
            return self._plan_current(rec, rec.home, "write_back", False)
        return self._issue(key, "write_back", plan)

    def evict(self, key: str, tier: Tier | str) -> cf.Future:
        """Drop the ``tier`` working copy of ``key``. Future[None].

        If that copy holds the only newest contents (home is stale), it is written back
        home first, then dropped; otherwise it is dropped at once. Evicting an absent copy
        does nothing. Refused for the home copy (use :meth:`release`) and for a pinned copy.
        """
        tier = Tier.parse(tier)

        def plan(rec: KeyRecord):
            if rec.op is not None and rec.op.kind == "evict" and rec.op.hops[0][0] is tier:
                return rec.op.future
            if rec.op is not None:
                return None   # another operation moves this key: wait for it
            copy = rec.copies[tier]
            if tier is rec.home:
                raise self._refuse(rec, tier, "evict", "it is the home copy; release() forgets the key")
            if copy.state is _R.ABSENT:
                return _done()
            if copy.pins:
                raise self._refuse(rec, tier, "evict", "it is pinned (in use); unpin it first")
            if not rec.sole_newest(tier):   # someone else holds the newest bytes (or this copy is stale)
                self._drop(rec, tier, "evict")
                self._explicit_evictions[tier] += 1
                self.recent_evictions.append((rec.key, tier))
                return _done()
            hops = self._path(tier, rec.home)
            if self._targets_pinned(rec, hops, "evict"):
                return None
            return Transfer("evict", rec.home, hops, version=rec.latest)
        return self._issue(key, "evict", plan)

    def discard(self, key: str, tier: Tier | str) -> None:
        """Drop the ``tier`` working copy of ``key`` *without* writing it home, even if it holds the
        newest contents: the key reverts to the newest copy left (home at least). For bytes the
        caller is done with, e.g. a gradient the optimizer has consumed, which would otherwise cost
        a write when evicted. Refused for the home copy and for a pinned copy; waits for an
        operation in flight."""
        tier = Tier.parse(tier)
        with self._cond:
            while (rec := self._lookup(key, "discard")).op is not None:
                self._cond.wait()
            if tier is rec.home:
                raise self._refuse(rec, tier, "discard", "it is the home copy; release() forgets the key")
            if rec.copies[tier].pins:
                raise self._refuse(rec, tier, "discard", "it is pinned (in use); unpin it first")
            if rec.copies[tier].state is _R.ABSENT:
                return
            self._drop(rec, tier, "discard")
            rec.latest = max(c.version for c in rec.copies.values() if c.state is not _R.ABSENT)
            self._cond.notify_all()

    def release(self, key: str) -> None:
        """Forget ``key``: every copy, including home, is freed. Waits for an operation in flight."""
        with self._cond:
            waited_from = None
            while (rec := self._lookup(key, "release")).op is not None:
                waited_from = waited_from or time.perf_counter()
                self._cond.wait()
            if waited_from is not None:
                self._add_wait(time.perf_counter() - waited_from)
            for t in Tier:
                if rec.copies[t].pins:
                    raise self._refuse(rec, t, "release", "it is pinned (in use); unpin it first")
            for t in (Tier.DEVICE, Tier.HOST):
                if rec.copies[t].state is not _R.ABSENT:
                    self._drop(rec, t, "release")
            # The extent is freed outside the lock (never call io under it); until the record
            # is removed below the key stays busy, so a re-register waits instead of racing this.
            rec.op = Transfer("release", rec.home, [], version=rec.latest)
            nvme_home = rec.copies[Tier.NVME].state is not _R.ABSENT
        try:
            if nvme_home and self._extents.contains(key):
                self._extents.free(key)
        finally:
            with self._cond:
                if nvme_home:
                    self._drop(rec, Tier.NVME, "release")
                del self._keys[key]
                self._cond.notify_all()

    def get(self, key: str, tier: Tier | str) -> torch.Tensor:
        """The ``tier`` copy's tensor; raises unless it is current and at rest (not in motion).

        Not pinned: another thread's bring may evict it under budget pressure. Use
        :meth:`use` or :meth:`pin` to hold it.
        """
        tier = Tier.parse(tier)
        with self._cond:
            rec = self._lookup(key, "get")
            self._check_usable(rec, tier, "get")
            self._touch(rec.copies[tier])
            return rec.copies[tier].tensor

    def pin(self, key: str, tier: Tier | str, owner=None) -> torch.Tensor:
        """Keep the ``tier`` copy from being evicted or released until :meth:`unpin`; returns it.
        ``owner``: the pin's token (see the class doc); None: the calling thread."""
        tier = Tier.parse(tier)
        with self._cond:
            rec = self._lookup(key, "pin")
            self._check_usable(rec, tier, "pin")
            rec.copies[tier].pin(_owner(owner))
            self._touch(rec.copies[tier])
            return rec.copies[tier].tensor

    def unpin(self, key: str, tier: Tier | str, owner=None) -> None:
        """Drop one pin of ``owner``, from any thread; None: the calling thread's if it holds one, else
        the oldest holder's."""
        tier = Tier.parse(tier)
        with self._cond:
            rec = self._lookup(key, "unpin")
            if not rec.copies[tier].pins:
                raise self._refuse(rec, tier, "unpin", "it is not pinned")
            copy = rec.copies[tier]
            if not copy.unpin(owner):
                raise self._refuse(rec, tier, "unpin", f"owner {owner!r} holds no pin on it")
            room = pool_of(copy.room)
            if room is not None and not copy.pins and \
                    room.used_bytes + room.backed_bytes - copy.reserved_bytes >= room.floor_bytes:
                self._accounts[tier].leave_room(copy.reserved_bytes, room)   # a room holds what its party holds
                copy.room = None
            self._cond.notify_all()

    @contextlib.contextmanager
    def use(self, key: str, tier: Tier | str, dirty: bool = False, owner=None) -> Iterator[torch.Tensor]:
        """``with store.use(key, tier, dirty=True) as t:`` bring, pin, yield; on exit mark dirty, unpin.

        ``dirty`` is marked on exit, after the caller's writes, so a write-back racing with
        the block can never leave home holding half-written bytes labelled as the newest.
        """
        tier = Tier.parse(tier)
        owner = _owner(owner)
        tensor = self.wait(self.bring(key, tier, pin=True, owner=owner))
        try:
            yield tensor
        finally:
            try:
                if dirty:   # also when the block raised: it may have written part of the copy
                    self.mark_dirty(key, tier)
            finally:
                self.unpin(key, tier, owner)

    def host_scratch(self, nbytes: int, within: Room | None = None) -> torch.Tensor:
        """A uint8 host buffer of at least ``nbytes`` (pinned on CUDA) that is no key's copy, counted
        against the host budget like one (``within``: charged to that open room): room is made for it as
        for a copy, and :class:`BudgetError` is raised when nothing can free enough. For staging
        device->host copies (:meth:`copy_to_host`). Give it back with :meth:`release_scratch`."""
        cost = self.pool.buffer_bytes(nbytes)
        room = pool_of(within)
        self._reserve_room({Tier.HOST: cost}, "<host scratch>", room,
                            lambda: self._accounts[Tier.HOST].reserve(cost, room))
        with self._cond:
            self._scratch_bytes += cost
            self._scratch_peak_bytes = max(self._scratch_peak_bytes, self._scratch_bytes)
        try:
            buf = self.pool.acquire(nbytes)
        except BaseException:
            self._unreserve_scratch(cost, room)
            raise
        with self._cond:
            self._scratch_rooms[buf.data_ptr()] = room
        return buf

    def release_scratch(self, buf: torch.Tensor) -> None:
        """Give back a :meth:`host_scratch` buffer; no copy into or out of it may be in flight."""
        cost = buf.numel()
        with self._cond:
            room = self._scratch_rooms.pop(buf.data_ptr(), None)
        self.pool.release(buf)
        self._unreserve_scratch(cost, room)

    def _unreserve_scratch(self, cost: int, room: Room | None) -> None:
        with self._cond:
            self._accounts[Tier.HOST].unreserve(cost, room)
            self._scratch_bytes -= cost
            self._cond.notify_all()

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> cf.Future:
        """Copy ``src`` (device) into ``dst`` (host, e.g. a :meth:`host_scratch` view) on the copier's
        device->host lane: on CUDA a side stream, after the kernels the caller queued so far. Future[None],
        done once ``dst`` holds the bytes; ``src`` and ``dst`` must stay untouched until then."""
        return self._copier.to_host(dst, src.detach())

    def mark_dirty(self, key: str, tier: Tier | str) -> None:
        """Record that the caller changed the ``tier`` copy: it becomes the only current copy.

        The copy must be current (at rest, or the source of a transfer in flight: that
        transfer then carries the old version and its destination stays stale).
        """
        tier = Tier.parse(tier)
        with self._cond:
            rec = self._lookup(key, "mark_dirty")
            if tier is Tier.NVME or not rec.is_current(tier):
                raise self._refuse(rec, tier, "mark_dirty", "only a current device/host copy can be changed")
            rec.latest += 1
            rec.copies[tier].version = rec.latest
            self._touch(rec.copies[tier])

    def hand_over(self, src: str, dst: str, tier: Tier | str) -> torch.Tensor:
        """Make ``src``'s ``tier`` working copy ``dst``'s newest copy, without moving a byte: the buffer,
        its reservation and its pins change keys. ``src`` goes back to its other copies (home included),
        which must hold the same bytes (the copy is current and not the only one); ``dst``'s other copies
        are stale from then on (it is dirty: write it back as after any change). For an update that reads
        one key and writes its result under another, leaving the first as it was. Both keys must be idle,
        of one shape and dtype; ``dst`` may have no copy pinned in ``tier``. Returns the tensor."""
        tier = Tier.parse(tier)
        with self._cond:
            a, b = self._lookup(src, "hand_over"), self._lookup(dst, "hand_over")
            if a.op is not None or b.op is not None:
                raise StoreError(f"hand_over {src!r} -> {dst!r}: a key is being moved; wait for it first")
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise StoreError(f"hand_over {src!r} -> {dst!r}: {a.shape} {a.dtype} is not {b.shape} {b.dtype}")
            if tier is a.home or not a.is_current(tier) or a.sole_newest(tier) or \
                    a.copies[tier].state is not _R.RESIDENT:
                raise self._refuse(a, tier, "hand_over", "only a current working copy whose bytes are also "
                                                         "held elsewhere (home) can change keys")
            if b.copies[tier].pins:
                raise self._refuse(b, tier, "hand_over", "the copy it would replace is pinned")
            if b.copies[tier].state is not _R.ABSENT:
                self._drop(b, tier, "hand_over")
            copy, a.copies[tier] = a.copies[tier], CopyRecord()
            b.latest += 1
            copy.version = b.latest
            b.copies[tier] = copy
            self._touch(copy)
            self._cond.notify_all()
            return copy.tensor

    # ------------------------------------------------------------------ host memory and closing

    def trim_host_buffers(self) -> int:
        """Free host buffers cached for reuse (:meth:`HostBufferPool.end_window`; a training step calls
        this once per step, so a budget filled once does not stay RSS for good), and a CPU device tier's.
        Returns the bytes freed."""
        return self.pool.end_window() + (self.device_pool.end_window() if self.device_pool is not None else 0)

    def close(self) -> None:
        """Wait for operations in flight, release every key, remove the swap file. Idempotent."""
        with self._cond:
            if self._closed:
                return
            while any(rec.op is not None for rec in self._keys.values()):
                self._cond.wait()
            for rec in self._keys.values():
                for c in rec.copies.values():
                    c.pinned_by.clear()
            keys = list(self._keys)
        for key in keys:
            self.release(key)
        with self._cond:
            self._closed = True
        self._copier.close()
        if self._extents is not None:
            self._extents.close(remove=True)
        if self._engine is not None:
            self._engine.close()
        self.pool.trim()
        if self.device_pool is not None:
            self.device_pool.trim()

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ small helpers

    def _touch(self, copy: CopyRecord) -> None:
        self._tick += 1
        copy.last_use_tick = self._tick

    def _lookup(self, key: str, op: str) -> KeyRecord:
        if self._closed:
            raise StoreError(f"{op} {key!r}: the store is closed")
        rec = self._keys.get(key)
        if rec is None:
            raise StoreError(f"{op}: unknown key {key!r} (registered: {len(self._keys)} keys)")
        return rec

    def _check_usable(self, rec: KeyRecord, tier: Tier, op: str) -> None:
        c = rec.copies[tier]
        if tier is Tier.NVME:
            raise self._refuse(rec, tier, op, "an NVMe copy is a file extent; bring it to host for a tensor")
        if c.state is _R.ABSENT:
            raise self._refuse(rec, tier, op, f"bring({rec.key!r}, {tier.value!r}) first")
        if c.state is not _R.RESIDENT:
            raise self._refuse(rec, tier, op, "it is in motion; wait on the future of the operation moving it")
        if c.version != rec.latest:
            newer = ", ".join(t.value for t in rec.current_tiers())
            raise self._refuse(rec, tier, op, f"it is stale (newest contents in: {newer}); bring it again")

    def _refuse(self, rec: KeyRecord, tier: Tier, op: str, why: str) -> StoreError:
        return StoreError(f"rank {self.rank} store key {rec.key!r} (home {rec.home.value}): {op} refused "
                          f"for the {tier.value} copy, which is {rec.describe(tier)}: {why}")

    def _open_extents(self, key: str) -> None:
        if self._extents is not None:
            return
        if self.swap_dir is None:
            raise StoreError(f"register {key!r} with home nvme: no swap directory; set tiers.nvme_path "
                             "or pass swap_dir to TensorStore")
        make_swap_dir(self.swap_dir)
        engine = IOEngine(self.io_config)
        try:
            extents = ExtentFile(self.swap_dir, engine, direct=self.io_config.direct,
                                 checksum=self.io_config.checksum)
        except BaseException:
            engine.close()
            raise
        with self._cond:
            if self._extents is None:
                self._engine, self._extents = engine, extents
                return
        extents.close(remove=True)   # another thread opened one first
        engine.close()
