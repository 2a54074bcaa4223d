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

A shard larger than one chunk (``UnitPlacement.chunk_numel``: ``offload.chunk_bytes``
of stored classes together) is stored as one key per chunk and class,
``u{unit}.{class}.{chunk}``, so an optimizer job brings one chunk, not the unit:
the optimizer's host working set is bounded whatever the unit's size. Whole-shard
verbs (``get``, ``read``, ``update``, the gather's parameter) assemble the chunks
into one tensor outside the store's budget, for as long as the caller holds it;
the hot path (gradient folds, optimizer jobs) works chunk by chunk.

The engine's verbs (:meth:`param_for_gather`, :meth:`fold_grad`,
:meth:`job_field`, ...) are the in-memory shard's, done through the store for
stored classes: a gather reads a pinned device copy, a first gradient replaces
the stored one without reading it, an optimizer job names store keys.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading

import torch

from infinity.optim.moment_codes import FLAT_LAYOUT
from infinity.store import BudgetError, TensorStore, Tier
from infinity.zero.grad_staging import STAGING_BUFFERS, STAGING_SLICE_BYTES, FoldStaging, PendingFold
from infinity.zero.pins import PinOwner
from infinity.zero.placement import OPTIMIZER_CLASSES, Placement, UnitPlacement, chunk_bounds, store_key
from infinity.zero.units import TensorClass, UnitShard

__all__ = ["StoreUnitShard", "LentCopies", "store_shards", "fold_staging"]


class LentCopies:
    """Working copies handed out by ``get`` that the caller may have written; one list per store.

    :meth:`write_back` marks each one changed and starts its write-back. It runs
    before the next operation any shard or the engine does on the store, so a
    lent copy is still current then (nothing between could have moved it).
    """

    def __init__(self, store: TensorStore):
        self.store = store
        self._lent: list = []   # (keys, tier, each key's view of the assembled tensor, or None)

    def add(self, keys: tuple, tier, pieces: list | None = None) -> None:
        """One key lent as the store's own copy, or chunk keys lent as one assembled tensor
        (``pieces[i]``: key i's part of it), copied back into the chunks on write-back."""
        self._lent.append((keys, tier, pieces))

    def write_back(self) -> None:
        lent, self._lent = self._lent, []
        for keys, tier, pieces in lent:
            for i, key in enumerate(keys):
                if key not in self.store:
                    continue   # released since (the engine closed)
                if pieces is None:
                    self.store.mark_dirty(key, tier)
                else:
                    with self.store.use(key, tier, dirty=True) as t:
                        t.copy_(pieces[i])
                if self.store.home(key) is not tier:
                    self.store.write_back(key)   # in the background; a later bring waits for it


class StoreUnitShard(UnitShard):
    """This rank's tensors of one unit: in memory or in the store, as ``placement`` says.

    ``bounds`` are the chunks' element ranges (``Placement`` / :func:`chunk_bounds`); one range
    covering the shard stores each class as one key, as before chunking existed.
    """

    def __init__(self, store: TensorStore, unit_index: int, placement: Placement, lent: LentCopies,
                 bounds: list | None = None, resident: frozenset = frozenset(), stream_states: bool = False,
                 staging: FoldStaging | None = None, write_kept_grads: bool = False):
        super().__init__()
        self.store, self.unit_index, self.placement, self.lent = store, unit_index, placement, lent
        # the rank's queue of pending folds and their staging buffers (shared by its shards: store_shards)
        self.staging = staging if staging is not None else FoldStaging(store)
        self.resident = resident   # (class, chunk) homed in host memory instead of on NVMe
        self.stream_states = stream_states   # NVMe-homed optimizer states: no host copy kept after the update
        # a speculative update's kept gradient is written home at once (UnitPlacement.writes_kept_grads)
        self.write_kept_grads = write_kept_grads
        # folded gradients wait unwritten for this step's update (set per step: set_step_speculates)
        self.defers_grad_writes = placement.defer_grad_writes
        self.bounds = list(bounds) if bounds else None   # None: one key per class, whatever its size
        self._keys: dict = {}     # TensorClass -> tuple of store keys, one per chunk
        # TensorClass -> its stored layout (int8 moments: rows of blocks, moment_codes); others flat
        self._layouts: dict = {}

    @property
    def chunked(self) -> bool:
        return self.bounds is not None and len(self.bounds) > 1

    def chunks(self) -> list:
        """Element ranges of the optimizer jobs this shard makes (one when not chunked)."""
        return list(self.bounds) if self.chunked else [None]

    def _rows(self, cls: TensorClass, tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of a whole-shard tensor of ``cls`` (rows of blocks for int8 moments)."""
        return self._layouts.get(cls, FLAT_LAYOUT).rows(tensor, lo, hi)

    def _chunk_views(self, cls: TensorClass, tensor: torch.Tensor) -> list:
        return [self._rows(cls, tensor, lo, hi) for lo, hi in self.bounds]

    def _chunk_keys(self, cls: TensorClass) -> tuple:
        if not self.chunked:
            return (store_key(self.unit_index, cls),)
        return tuple(store_key(self.unit_index, cls, c) for c in range(len(self.bounds)))

    def _home(self, cls: TensorClass, chunk: int) -> Tier:
        """The chunk's home: the class's, or host memory for a chunk kept resident
        (UnitPlacement.host_resident_plan)."""
        return Tier.HOST if (cls, chunk) in self.resident else self.placement.home(cls)

    def _register(self, cls: TensorClass, make, dtype=None) -> None:
        """Register each chunk of ``cls`` (``make(lo, hi)``: its tensor or shape), waiting until home."""
        keys = self._chunk_keys(cls)
        bounds = self.bounds if self.chunked else [None]
        futures = [self.store.register(key, make(*(b or (None, None))), dtype=dtype, home=self._home(cls, c))
                   for c, (key, b) in enumerate(zip(keys, bounds))]
        for f in futures:
            self.store.wait(f)
        self._keys[cls] = keys
        # Registering an NVMe-homed key stages it through a host copy, which would stay cached: not for a
        # gradient (its first fold overwrites it unread) nor for streamed states (evicted before their use)
        for c, key in enumerate(keys):
            if self._home(cls, c) is Tier.NVME and (cls is TensorClass.GRAD or self.streams(cls, c)):
                self.store.wait(self.store.evict(key, Tier.HOST))

    def put(self, cls: TensorClass, tensor: torch.Tensor) -> None:
        """Memory classes keep ``tensor``; stored ones copy it into new keys (waits until home)."""
        if self.placement.home(cls) is None:
            super().put(cls, tensor)
            return
        self._register(cls, lambda lo, hi: tensor if lo is None else self._rows(cls, tensor, lo, hi))

    def put_zeros(self, cls: TensorClass, numel: int, dtype: torch.dtype, device, layout=None) -> None:
        """Like ``put(cls, torch.zeros(...))`` without building the zeros in memory for stored classes;
        ``layout`` (a :class:`~infinity.optim.moment_codes.MomentFormat`) shapes the stored tensor."""
        layout = layout or FLAT_LAYOUT
        if layout is not FLAT_LAYOUT:
            self._layouts[cls] = layout
        if self.placement.home(cls) is None:
            super().put_zeros(cls, numel, dtype, device, layout)
            return
        self._register(cls, lambda lo, hi: layout.shape(numel if lo is None else hi - lo), dtype)

    def alias(self, cls: TensorClass, same_as: TensorClass) -> None:
        """``cls`` is the very tensor of ``same_as`` (stored or not)."""
        if same_as in self._keys:
            self._keys[cls] = self._keys[same_as]
        else:
            super().put(cls, super().get(same_as))

    def keys(self, cls: TensorClass) -> tuple:
        """The store keys of a stored class, one per chunk; () for a class held in memory."""
        return self._keys.get(cls, ())

    def get(self, cls: TensorClass) -> torch.Tensor:
        """The class's tensor, usable at once; a stored one is lent (see the module doc)."""
        return self._fetch(cls, lend=True)

    def read(self, cls: TensorClass) -> torch.Tensor:
        """Like :meth:`get` for a caller that will not write: nothing is written back."""
        return self._fetch(cls, lend=False)

    def _fetch(self, cls: TensorClass, lend: bool) -> torch.Tensor:
        keys = self._keys.get(cls)
        if keys is None:
            return super().get(cls)
        self.lent.write_back()
        tier = self.placement.work_tier(cls)
        if not self.chunked:
            tensor = self.store.wait(self.store.bring(keys[0], tier))
            if lend:
                self.lent.add(keys, tier)
            return tensor
        tensor = self._assemble(cls, keys, tier)
        if lend:
            self.lent.add(keys, tier, self._chunk_views(cls, tensor))
        return tensor

    def _assemble(self, cls: TensorClass, keys: tuple, tier: Tier) -> torch.Tensor:
        """One tensor of every chunk, brought one at a time (each pinned only while it is copied)."""
        out = None
        for key, (lo, hi) in zip(keys, self.bounds):
            with self.store.use(key, tier) as t:
                if out is None:
                    shape = self._layouts.get(cls, FLAT_LAYOUT).shape(self.bounds[-1][1])
                    out = torch.empty(shape, dtype=t.dtype, device=t.device)
                self._rows(cls, out, lo, hi).copy_(t)
        return out

    def has(self, cls: TensorClass) -> bool:
        return cls in self._keys or super().has(cls)

    def is_alias(self, cls: TensorClass, other: TensorClass) -> bool:
        if cls in self._keys or other in self._keys:
            return self._keys.get(cls) is not None and self._keys.get(cls) == self._keys.get(other)
        return super().has(cls) and super().has(other) and super().get(cls) is super().get(other)

    @contextlib.contextmanager
    def update(self, cls: TensorClass):
        """``with shard.update(cls) as t:`` change a class in place (stored: pinned, marked dirty,
        written back home asynchronously afterwards; chunked: assembled, then copied back per chunk)."""
        keys = self._keys.get(cls)
        if keys is None:
            yield super().get(cls)
            return
        self.lent.write_back()
        tier = self.placement.work_tier(cls)
        if self.chunked:
            t = self._assemble(cls, keys, tier)
            yield t
            self.lent.add(keys, tier, self._chunk_views(cls, t))
            self.lent.write_back()
            return
        with self.store.use(keys[0], tier, dirty=True) as t:
            yield t
        if self.store.home(keys[0]) is not tier:
            self.store.write_back(keys[0])   # completes in the background; a later bring waits for it

    def replace(self, cls: TensorClass, tensor: torch.Tensor):
        """New contents for a stored class without reading the old ones (the keys are re-registered:
        NVMe homes get a fresh extent, one write and no read). Returns one future, done when every
        chunk is home; the tensor is copied off the caller's thread (``tensor`` must stay unchanged
        until the future is done), and a later bring of a key waits for its copy and write. May be
        retried after a BudgetError: a register that failed left its key released, and the retry
        re-registers every chunk."""
        keys = self._keys[cls]
        self.lent.write_back()
        bounds = self.bounds if self.chunked else [(0, tensor.numel())]
        futures = []
        for c, (key, (lo, hi)) in enumerate(zip(keys, bounds)):
            if key in self.store:
                self.store.release(key)
            part = tensor if not self.chunked else self._rows(cls, tensor, lo, hi)
            futures.append(self.store.register(key, part, home=self._home(cls, c), copy_async=True))
        return futures[0] if len(futures) == 1 else _all_of(futures)

    # ------------------------------------------------------------ the engine's verbs

    def param_for_gather(self, into: torch.Tensor | None = None):
        """The parameter shard on the device tier, pinned while the all-gather reads it (an eviction
        meanwhile would hand its budget to another key), and the unpin for when the gather is done.
        Chunked: each chunk is pinned only while it is copied into one buffer outside the budget (so
        that tier's budget must hold one chunk, not the shard): ``into``, the full buffer itself, when
        given (one rank: no shard-sized buffer and no second copy), else a new one."""
        keys = self._keys.get(TensorClass.PARAM)
        if keys is None:
            return super().param_for_gather(into)
        self.lent.write_back()   # a checkpoint load may have written the shard through get()
        tier = Tier.DEVICE
        if not self.chunked:
            # the pin's owner is this gather, not a thread: the unpin may come from another one (on CUDA
            # autograd runs backward hooks on its device thread)
            owner = PinOwner.gather(self.unit_index)
            # room the gradient folds in flight hold (their pinned sums, their claimed copies) is freed by
            # finishing them, which only a caller does: refused room, the gather finishes the oldest and
            # tries again
            src = self.store.wait(self.staging.with_room(lambda: self.store.bring(keys[0], tier, pin=True,
                                                                                  owner=owner)))
            return src, lambda: self.store.unpin(keys[0], tier, owner)
        for key in keys[1:]:   # reads in flight together, as far as the budget has room (best effort)
            try:
                self.store.bring(key, tier)
            except BudgetError:
                break
        if into is not None and into.numel() != self.bounds[-1][1]:
            raise ValueError(f"param_for_gather: the buffer holds {into.numel()} elements, the shard "
                             f"{self.bounds[-1][1]}")
        out = into
        for key, (lo, hi) in zip(keys, self.bounds):
            t = self.store.wait(self.staging.with_room(lambda: self.store.bring(key, tier, pin=True)))
            try:
                if out is None:
                    out = torch.empty(self.bounds[-1][1], dtype=t.dtype, device=t.device)
                # the full buffer is written behind autograd's back, as an all-gather writes it
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out[lo:hi].copy_(t)
            finally:
                self.store.unpin(key, tier)
        return out, None

    def prefetch_param(self) -> None:
        """Start bringing the stored parameter shard to the device tier (raises BudgetError if full)."""
        for key in self._keys.get(TensorClass.PARAM, ()):
            self.store.bring(key, Tier.DEVICE)

    def fold_grad(self, reduced: torch.Tensor, first: bool, inspect=None):
        """Fold a reduced gradient into the stored shard without waiting for it to leave the device
        (:mod:`infinity.zero.grad_staging`). What is left pending is queued in the rank's
        :class:`~infinity.zero.grad_staging.FoldStaging` (:attr:`staging`), which the step empties before
        it reads a gradient; returns this unit's queued folds as one waitable (None: nothing left
        pending). ``reduced`` must stay unchanged until they are finished.

        - Host-homed first gradient: the shard is replaced (re-registered from ``reduced``, copied on the
          device->host lane); the old bytes are never read (zero_grad is lazy, saving a read and a write
          of every stored shard per step).
        - NVMe-homed first gradient: its host copy is claimed with ``reduced`` as the source (same lane),
          and written home once landed. With ``Placement.defer_grad_writes`` (the update overlaps
          backward) it is left there unwritten instead, and dropped unwritten once the optimizer has
          consumed it (:meth:`consumed_after_update`): the gradient shard does not touch the disk. The
          cost: until its update, it holds host room no eviction can take (short of room, the store
          writes such copies home, newest first, and drops them: a spill).
        - Accumulation: the stored sum is brought to host memory while ``reduced`` is copied into a
          staging buffer (:class:`~infinity.zero.grad_staging.FoldStaging`); the sum is made on the host
          once both have landed.

        ``inspect(t, lo)`` (fp16's overflow check, the clip norm's squared sums) sees the folded gradient
        while it is in memory, ``t`` holding its elements from ``lo``: ``reduced`` itself (``lo`` 0) for a
        first gradient, each chunk's host sum for an accumulation."""
        keys = self._keys.get(TensorClass.GRAD)
        if keys is None:
            return super().fold_grad(reduced, first, inspect)
        self.staging.finish_unit(self.unit_index)   # one fold of a key in flight: the last micro-batch's lands first
        if first and inspect is not None:
            inspect(reduced)
        if first and self.placement.home(TensorClass.GRAD) is Tier.HOST:
            return self.staging.track(self.unit_index, self.replace(TensorClass.GRAD, reduced))
        self.lent.write_back()
        for c, (key, b) in enumerate(zip(keys, self.bounds if self.chunked else [None])):
            part = reduced if b is None else reduced[b[0]:b[1]]
            if first:
                self._fold_first(key, part)
            else:
                self._fold_sum(key, c, part, inspect)
        return self.staging.pending(self.unit_index)

    def _fold_first(self, key: str, part: torch.Tensor) -> PendingFold:
        """The chunk's host copy claimed from ``part`` (its stale bytes never read) and, unless deferred,
        written home by the same store operation as soon as it has landed (so it never sits dirty,
        holding host room no eviction can take, until someone waits for it)."""
        write_home = not self.defers_grad_writes
        return self.staging.claim(self.unit_index,
                                  lambda: self.store.claim(key, Tier.HOST, src=part, write_home=write_home))

    def _fold_sum(self, key: str, chunk: int, part: torch.Tensor, inspect) -> PendingFold | None:
        """The chunk's stored sum brought to host (pinned by this fold) while ``part`` is staged, in slices of
        a staging buffer each; each slice summed there once landed, the sum finished by the last."""
        owner = PinOwner.fold(self.unit_index, chunk)
        brought = self.staging.with_room(lambda: self.store.bring(key, Tier.HOST, pin=True, owner=owner))

        def add(staged: torch.Tensor, lo: int, hi: int) -> None:
            g = brought.result()
            g[lo:hi].add_(staged)
            if hi == part.numel():   # the last slice (the queue finishes the ones before it first)
                if inspect is not None:   # the sum itself may overflow, and the clip norm sums it: while it is here
                    inspect(g, self.bounds[chunk][0] if self.chunked else 0)
                self.store.mark_dirty(key, Tier.HOST)
                if not self.defers_grad_writes:
                    self.store.write_back(key)   # in the background; a later bring waits for it

        def unpin() -> None:
            if brought.exception() is None:   # done by now: the fold waited for it
                self.store.unpin(key, Tier.HOST, owner)

        slices = self.staging.slices(part)
        if not slices:
            # no staging buffer (a host budget too near its minimum, the homes and one optimizer job, to set
            # one aside): this one is summed the blocking way
            self.staging.blocking_folds += 1
            try:
                add(part.to(brought.result().device), 0, part.numel())
            finally:
                unpin()
            return None
        left = [len(slices)]   # slices whose fold has not finished: the last one to finish unpins the sum

        def slice_done() -> None:
            left[0] -= 1
            if not left[0]:
                unpin()

        staged = 0
        try:   # the queue finishes a unit's folds in the order they were staged: the last slice's sees the sum whole
            for lo, hi in slices:
                self.staging.stage(self.unit_index, part[lo:hi], lambda t, lo=lo, hi=hi: add(t, lo, hi),
                                   cleanup=slice_done, after=[brought])
                staged += 1
        except BaseException:
            cf.wait([brought])
            for _ in range(len(slices) - staged):
                slice_done()
            raise
        return self.staging.pending(self.unit_index)

    def consumed_after_update(self, chunk: int = 0) -> tuple:
        """The NVMe-homed gradient chunk: dead once Adam has read it (the next fold overwrites it)."""
        keys = self._keys.get(TensorClass.GRAD)
        if keys is None or self.placement.home(TensorClass.GRAD) is not Tier.NVME:
            return ()
        return (keys[chunk],)

    def set_step_speculates(self, speculating: bool) -> None:
        """Told at a speculative mode's first backward of each step. A step that does not speculate
        updates during the next forward, as next_forward does; where a speculation's kept gradients are
        written home anyway (``write_kept_grads``: all of them outweigh the host room), this step's are
        then written at the fold too, as next_forward writes them: held unwritten until the next forward
        they would push out the parameters it reads, and be spilled all the same."""
        self.defers_grad_writes = self.placement.defer_grad_writes and (speculating or not self.write_kept_grads)

    def kept_for_redo(self, chunk: int = 0) -> tuple:
        """The NVMe-homed gradient chunk a speculative update keeps for a possible redo, when it is to be
        written home and its host copy freed once the update is done (``write_kept_grads``); else ()."""
        return self.consumed_after_update(chunk) if self.write_kept_grads else ()

    def streams(self, cls: TensorClass, chunk: int) -> bool:
        """With ``stream_states``: whether the chunk of ``cls`` is an NVMe-homed optimizer state, whose host
        copy is not kept (its next use is a step away, past what the host budget can cache). A master
        that is the parameter itself is kept: the next forward reads it."""
        return (self.stream_states and cls in OPTIMIZER_CLASSES and self._home(cls, chunk) is Tier.NVME
                and not self.is_alias(cls, TensorClass.PARAM))

    def dropped_after_update(self, chunk: int = 0) -> tuple:
        """The chunk's streamed state keys (:meth:`streams`): their host copies are freed once written home."""
        return tuple(self._keys[cls][chunk] for cls in OPTIMIZER_CLASSES
                     if cls in self._keys and self.streams(cls, chunk))

    def job_field(self, cls: TensorClass, chunk: int = 0):
        """Chunk ``chunk``'s store key for a stored class; the in-memory tensor (its chunk's slice
        when chunked) otherwise."""
        keys = self._keys.get(cls)
        if keys is not None:
            return keys[chunk]
        tensor = super().get(cls)
        if not self.chunked:
            return tensor
        lo, hi = self.bounds[chunk]
        return self._rows(cls, tensor, lo, hi)

    def replace_keys(self, old: tuple, new: tuple) -> list:
        """Every class whose chunk keys are ``old`` (a class and its aliases) takes ``new`` instead (a
        speculation's spares committed, :class:`~infinity.zero.spares.SpareSet`); returns those classes."""
        moved = [cls for cls, keys in self._keys.items() if keys is old]
        for cls in moved:
            self._keys[cls] = new
        return moved

    def write_back_lent(self) -> None:
        self.lent.write_back()

    def resident_bytes(self) -> int:
        """Bytes of this shard's chunks homed in host memory instead of on NVMe (UnitPlacement.host_resident_plan)."""
        return sum(self.store.nbytes(self._keys[cls][c]) for cls, c in self.resident if cls in self._keys)

    def write_back_dirty(self) -> list:
        futures = []
        for key in {k for keys in self._keys.values() for k in keys}:
            if key in self.store and self.store.is_dirty(key) and self.store.home(key) is not Tier.HOST:
                futures.append(self.store.write_back(key))
        return futures

    def release(self) -> None:
        """Forget this shard's stored keys (the engine is closing)."""
        self.staging.finish_unit(self.unit_index)   # no copy may still land in a key being released
        for key in {k for keys in self._keys.values() for k in keys}:
            if key in self.store:
                self.store.release(key)
        self._keys.clear()
        super().release()


def store_shards(store: TensorStore, placement: UnitPlacement, budgets: dict):
    """``new_shard(unit)``: a :class:`StoreUnitShard` for ``unit``, cut into the placement's chunks, with
    the resident chunks :meth:`UnitPlacement.host_resident_plan` picks within the host budget (``budgets``:
    bytes per tier), streaming the optimizer states when :meth:`UnitPlacement.streams_optimizer` says so and
    writing a speculation's kept gradients home when :meth:`UnitPlacement.writes_kept_grads` does;
    every shard made by one factory shares one :class:`LentCopies` and one
    :class:`~infinity.zero.grad_staging.FoldStaging` (the staging bound is the rank's, not a shard's),
    sized by :func:`fold_staging`."""
    host = budgets[Tier.HOST]
    chunk = placement.chunk_numel()
    plan = placement.host_resident_plan(placement.resident_room(host))
    staging = fold_staging(store, placement, host - placement.resident_bytes(plan))
    stream = placement.streams_optimizer(plan, host)
    write_kept = placement.writes_kept_grads(plan, host)
    lent = LentCopies(store)
    return lambda unit: StoreUnitShard(store, unit.index, placement, lent, chunk_bounds(unit.shard_numel, chunk),
                                       plan.get(unit.index, frozenset()), stream, staging, write_kept)


def fold_staging(store: TensorStore, placement: UnitPlacement, host_bytes: int) -> FoldStaging:
    """The rank's :class:`~infinity.zero.grad_staging.FoldStaging`, its staging sized: up to
    :data:`~infinity.zero.grad_staging.STAGING_BUFFERS` buffers, each the largest accumulation a fold
    stages (:meth:`UnitPlacement.fold_staging_bytes`) or one slice of it
    (:data:`~infinity.zero.grad_staging.STAGING_SLICE_BYTES`), as many as ``host_bytes`` (the host budget
    less what resident chunks hold) keeps beyond :meth:`UnitPlacement.min_budgets`' host minimum, so the
    rest of the step keeps all the room it needs while they are reserved (an accumulation's phase). None
    fit: every accumulation is summed the blocking way."""
    need = min(placement.fold_staging_bytes(), STAGING_SLICE_BYTES)
    if not need:
        return FoldStaging(store, max_buffers=0)
    spare = host_bytes - placement.min_budgets()[Tier.HOST][0]
    count = min(STAGING_BUFFERS, max(0, spare) // store.pool.buffer_bytes(need))
    return FoldStaging(store, max_buffers=count, buffer_bytes=need)


def _all_of(futures: list) -> cf.Future:
    """A future done once every one of ``futures`` is: None, or the first of their errors."""
    out: cf.Future = cf.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_f: cf.Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(None)

    for f in futures:
        f.add_done_callback(one_done)
    return out
