"""Gradient folds into stored shards whose device->host copy is still in flight.

A reduced gradient leaves the device on the store's device->host copier lane
(on CUDA a side stream, after an event recorded on the compute stream behind
the reduce-scatter's wait), so backward never drains the GPU to hand a shard to
host memory. What is left to do once the bytes have landed is a
:class:`PendingFold`, queued with its unit in the rank's one queue of pending
folds (:class:`FoldStaging`), which the step empties before anything reads a
gradient.

- First gradient of a step: the host copy is *claimed* with the device tensor as
  its source (:meth:`~infinity.store.TensorStore.claim` with ``src``): the store
  holds the key busy until the bytes have landed, so any read of it waits for
  them; finishing only starts the write home.
- Accumulation (a later micro-batch): the stored sum is brought to host memory
  (an NVMe read, in flight meanwhile) while the new gradient is copied into a
  staging buffer; finishing adds the staged bytes into the sum on the host, the
  same ``add_`` as the blocking path, so results are bitwise equal.

Why fold on the host after the copy lands, not on the device: a device fold
would bring the stored sum to the device and the new sum back, twice the PCIe
bytes of the host fold and a device buffer of each shard's size, to save one
host ``add_`` of a shard, which CPU memory bandwidth does far faster than the
copy itself. The price is staging memory, reserved when the phase that needs
it starts: the first accumulation a fold stages after the step last read the
gradients sets :class:`FoldStaging`'s ``max_buffers`` staging buffers aside from
the host tier (the engine sizes them out of what the host budget holds beyond
the minimum :meth:`~infinity.zero.placement.UnitPlacement.min_budgets`
enforces: :func:`~infinity.zero.store_shard.fold_staging`), and the step's
wait for every fold (:meth:`FoldStaging.finish_all`) gives them back. A
buffer holds :data:`STAGING_SLICE_BYTES` at most; a larger accumulation is
staged through them in slices, in order. A fold that needs one while all are
in flight first finishes the oldest fold. With
none (a budget at its minimum, which holds the homes and one optimizer job, not
staging; or a tier that cannot set them aside when the phase starts) the
accumulation is summed the blocking way, counted in ``blocking_folds``.
"""

from __future__ import annotations

import collections
import threading

import torch

from infinity.store import BudgetError

__all__ = ["PendingFold", "FoldStaging", "STAGING_BUFFERS", "STAGING_SLICE_BYTES", "CLAIMS_IN_FLIGHT"]

# Staging buffers for accumulation folds in flight at once: one being copied while the one before
# is folded; more would only hold host memory while the same copy lane drains them in order.
STAGING_BUFFERS = 2
# The most one staging buffer holds: a larger accumulation is staged in slices of this, in order, so
# staging holds 32 MiB at most whatever the chunk size, and each slice's add runs while the next one's
# copy is in flight.
STAGING_SLICE_BYTES = 16 * 2**20
# First gradients whose copy may be in flight at once (each holds its device source until it lands).
# A claim that also writes home is in flight until the write is done, so this keeps at most that many
# gradient writes queued too: about the I/O engine's queue depth, more would only wait there.
CLAIMS_IN_FLIGHT = 8


class PendingFold:
    """Work left after a fold's copies land: ``finish()`` runs on the thread that calls :meth:`result`,
    once, after every future in ``copies`` is done; ``cleanup()`` runs then too, even if a copy or
    ``finish`` failed (unpins, gives staging back). Waited on like a Future (``done``, ``result``).

    ``ordered``: the store itself makes every read of the gradient wait for these copies (a claim with a
    source keeps its key busy until they land), so a reader need not wait for this fold first; an
    accumulation's sum is made only by ``finish``, so a reader during backward must."""

    def __init__(self, copies: list, finish=None, cleanup=None, ordered: bool = False):
        self._copies, self._finish, self._cleanup = copies, finish, cleanup
        self.ordered = ordered
        self._ran = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()   # finished once, whichever thread waits first

    @property
    def finished(self) -> bool:
        """Whether :meth:`result` has run (successfully or not)."""
        return self._ran

    def done(self) -> bool:
        """True once :meth:`result` would not wait (every copy landed, or it has run)."""
        return self._ran or all(f.done() for f in self._copies)

    def result(self, timeout=None):
        """Wait for the copies, then finish the fold (first call); a failure is raised at every call."""
        with self._lock:
            self._run(timeout)
        if self._error is not None:
            raise self._error
        return None

    def _run(self, timeout) -> None:
        if not self._ran:
            self._ran = True
            try:
                for f in self._copies:
                    f.result(timeout)
                if self._finish is not None:
                    self._finish()
            except BaseException as e:   # noqa: BLE001 - kept, and raised to every waiter
                self._error = e
            finally:
                cleanup, self._copies, self._finish, self._cleanup = self._cleanup, [], None, None
                if cleanup is not None:   # (the references go: a copy's future holds its host tensor)
                    try:
                        cleanup()
                    except BaseException as e:   # noqa: BLE001
                        self._error = self._error or e


class FoldStaging:
    """The folds in flight of one rank, oldest first: the one queue of pending folds, and the bounds on them.

    Every fold whose work is left pending is queued here, tagged with its unit, by the shard that
    started it (:meth:`stage`, :meth:`claim`, :meth:`track`): the gradient reducer finishes them as they
    land (:meth:`finish_landed`), a unit's own before its gradient is read or folded again
    (:meth:`finish_unit`), and every one before the step reads a gradient (:meth:`finish_all`). A fold
    that failed once finished is kept, and raised by :meth:`finish_all`.

    ``max_buffers`` staging buffers of ``buffer_bytes`` each for accumulations in flight at once, reserved
    from ``store``'s host scratch (pinned on CUDA, counted against the host tier) at the first fold that
    stages after :meth:`finish_all`, and given back by the next :meth:`finish_all`: a phase; none
    (``buffer_bytes`` 0, or ``max_buffers`` 0): every accumulation is summed the blocking way (:meth:`slices`
    is empty). A fold larger than a buffer is staged in slices of one, in order. A tier that cannot set
    them all aside when the phase starts gives it fewer, counted in ``short_phases``; nothing is retried
    for. ``max_claims`` first gradients whose copy may still be in
    flight, each of which keeps its device source (a reduce-scatter's output) alive until it lands, so
    this bounds the device memory that copies behind the compute stream hold. A fold past a bound
    first finishes the oldest one. ``peak_buffers`` / ``peak_bytes``: the most staging held at once;
    ``waits``: folds that had to finish an older one first. ``store`` None: a rank whose gradients live
    in memory (every fold is done at once; nothing is ever queued)."""

    def __init__(self, store=None, max_buffers: int = STAGING_BUFFERS, max_claims: int = CLAIMS_IN_FLIGHT,
                 buffer_bytes: int = 0):
        if max_buffers < 0 or max_claims < 1 or buffer_bytes < 0:
            raise ValueError(f"FoldStaging: max_buffers and buffer_bytes must be >= 0 and max_claims >= 1, got "
                             f"{max_buffers}, {buffer_bytes}, {max_claims}")
        self.store, self.max_claims = store, max_claims
        self.buffer_bytes = buffer_bytes if max_buffers and store is not None else 0
        self._queue: collections.deque = collections.deque()   # (unit index, PendingFold), oldest first
        self._failed: list = []             # finished before finish_all, but failed: raised by it
        self.held_buffers = 0
        self.claims_in_flight = 0
        self.peak_claims = 0
        self.blocking_folds = 0   # accumulations summed the blocking way: no staging buffer for them
        self._held_bytes = 0
        self.peak_buffers = 0
        self.peak_bytes = 0
        self.waits = 0
        self.max_buffers = max_buffers if self.buffer_bytes else 0
        self._reserved: list | None = None   # this phase's staging buffers; None: no phase begun
        self._free: list = []                # ... those not held by a fold in flight
        self.short_phases = 0                # phases that started with fewer than max_buffers

    # ------------------------------------------------------------ the queue

    def pending(self, unit: int):
        """Unit ``unit``'s folds still queued, as one waitable (a :class:`PendingFold` over them, not queued
        itself), or None if it has none."""
        folds = [f for u, f in self._queue if u == unit]
        if not folds:
            return None
        if len(folds) == 1:
            return folds[0]
        return PendingFold(folds, ordered=all(f.ordered for f in folds))

    def track(self, unit: int, future) -> PendingFold:
        """Queue a store operation that is unit ``unit``'s fold (a host-homed first gradient's replacement):
        the store makes every read of the key wait for it, so it is ordered."""
        fold = PendingFold([future], ordered=True)
        self._queue.append((unit, fold))
        return fold

    def finish_landed(self) -> None:
        """Finish the oldest folds whose copies have landed (frees their staging and pins, starts their
        writes home early); copies land in fold order, so this stops at the first one still in flight."""
        while self._queue and self._queue[0][1].done():
            self._retire()

    def finish_unit(self, unit: int, unordered_only: bool = False) -> None:
        """Finish unit ``unit``'s queued folds (``unordered_only``: only those a read would not wait for by
        itself, accumulations whose sum is made by finishing them). A failure is kept for :meth:`finish_all`."""
        mine = [e for e in self._queue if e[0] == unit and not (unordered_only and e[1].ordered)]
        for entry in mine:
            self._queue.remove(entry)
            self._finish(entry[1])

    def finish_all(self, raise_errors: bool = True) -> None:
        """Finish every queued fold, oldest first, and give the phase's staging buffers back; the first
        failure (also one kept from an earlier finish) is raised after all have finished, unless
        ``raise_errors`` is False."""
        while self._queue:
            self._retire()
        self._end_phase()
        failed, self._failed = self._failed, []
        if failed and raise_errors:
            failed[0].result()   # raises its error

    def _retire(self) -> None:
        """Finish the oldest queued fold."""
        self._finish(self._queue.popleft()[1])

    def _finish(self, fold: PendingFold) -> None:
        try:
            fold.result()
        except BaseException:   # noqa: BLE001 - raised again where the step waits (finish_all)
            self._failed.append(fold)

    # ------------------------------------------------------------ staging

    def slices(self, src: torch.Tensor) -> list:
        """How ``src``'s fold is staged: ``[(lo, hi), ...]``, element ranges of it that each fit a staging
        buffer, in order; [] when the phase has no buffer (it is summed the blocking way). The first call
        of a phase reserves them."""
        if self._reserved is None and self.max_buffers:
            self._begin_phase()
        if not self._reserved:
            return []
        step = self.buffer_bytes // src.element_size()
        return [(lo, min(lo + step, src.numel())) for lo in range(0, src.numel(), step)]

    @property
    def reserved_bytes(self) -> int:
        """Host bytes the phase's staging buffers hold (what the store counts for them); 0 between phases."""
        return sum(b.numel() for b in self._reserved or ())

    def _begin_phase(self) -> None:
        """Set the phase's staging buffers aside, as many of ``max_buffers`` as the tier can (no retry)."""
        self._reserved = []
        try:
            while len(self._reserved) < self.max_buffers:
                self._reserved.append(self.store.host_scratch(self.buffer_bytes))
        except BudgetError:
            self.short_phases += 1   # fewer folds staged at once this phase (none: summed the blocking way)
        self._free = list(self._reserved)

    def _end_phase(self) -> None:
        """Every fold is finished: the phase's staging buffers go back to the store."""
        reserved, self._reserved, self._free = self._reserved or [], None, []
        for buf in reserved:
            self.store.release_scratch(buf)

    def stage(self, unit: int, src: torch.Tensor, finish, cleanup=None, after=()) -> PendingFold:
        """Unit ``unit``'s fold, queued: copy ``src`` (device) into a reserved staging buffer on the
        device->host lane (all of them held: the oldest fold is finished first); once it and the futures in
        ``after`` are done, ``finish(staged)`` runs (:class:`PendingFold`), then the buffer goes back, then
        ``cleanup()``. Only for a slice :meth:`slices` gave."""
        nbytes = src.numel() * src.element_size()
        if nbytes > self.buffer_bytes or not self._reserved:
            raise ValueError(f"FoldStaging: no staging buffer for a {nbytes}-byte fold (ask slices() first)")
        self._make_way(lambda: not self._free)
        buf = self._free.pop()
        staged = buf[:nbytes].view(src.dtype).view(src.shape)
        self.held_buffers += 1
        self._held_bytes += buf.numel()
        self.peak_buffers = max(self.peak_buffers, self.held_buffers)
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)
        try:
            copy = self.store.copy_to_host(staged, src)
        except BaseException:
            self._give_back(buf)
            raise

        def done() -> None:
            try:   # the buffer goes back first, then cleanup unpins the brought sum
                self._give_back(buf)
            finally:
                if cleanup is not None:
                    cleanup()

        fold = PendingFold([copy, *after], finish=lambda: finish(staged), cleanup=done)
        self._queue.append((unit, fold))
        return fold

    def claim(self, unit: int, attempt, finish=None) -> PendingFold:
        """Unit ``unit``'s first gradient's fold, queued: ``attempt()`` claims its host copy from the device
        tensor (a store future, done once landed, or written home too), ``finish()`` runs after. Ordered:
        the claim keeps its key busy until then, so readers wait for it without waiting for this fold."""
        self._make_way(lambda: self.claims_in_flight >= self.max_claims)
        claimed = self.with_room(attempt)
        self.claims_in_flight += 1
        self.peak_claims = max(self.peak_claims, self.claims_in_flight)

        def landed() -> None:
            self.claims_in_flight -= 1

        fold = PendingFold([claimed], finish=finish, cleanup=landed, ordered=True)
        self._queue.append((unit, fold))
        return fold

    def _make_way(self, over_bound) -> None:
        """Retire the folds at the head that have landed (no wait), then the oldest while ``over_bound()``
        (what is over a bound is held by the folds queued: finishing them gives it back)."""
        self.finish_landed()
        while self._queue and over_bound():
            self.waits += 1
            self._retire()
        if over_bound():
            raise RuntimeError("FoldStaging: a bound is held with no fold in flight to give it back")

    def with_room(self, attempt):
        """``attempt()`` (a store call for host room: a first gradient's claimed copy, an accumulation's
        brought sum); refused for room (BudgetError) while folds in flight hold some (their pinned sums,
        their claimed copies), the oldest is finished and it is tried again: the folds in flight never
        need more room than one fold done the blocking way. Refused with none in flight, the error
        stands. The folds are this rank's own work: nothing here waits for another party's memory (an
        overlapped update's copies live in a room of their own, staging in buffers reserved for its phase)."""
        while True:
            try:
                return attempt()
            except BudgetError:
                if not self._queue:
                    raise
                self._retire()

    def _give_back(self, buf: torch.Tensor) -> None:
        self.held_buffers -= 1
        self._held_bytes -= buf.numel()
        self._free.append(buf)

    def close(self) -> None:
        """Finish every fold, its error not raised, and give the staging buffers back. Idempotent."""
        self.finish_all(raise_errors=False)

    def stats(self) -> dict:
        return {"max_buffers": self.max_buffers, "buffer_bytes": self.buffer_bytes,
                "reserved_bytes": self.reserved_bytes, "short_phases": self.short_phases,
                "held_buffers": self.held_buffers,
                "max_claims": self.max_claims, "claims_in_flight": self.claims_in_flight,
                "peak_claims": self.peak_claims, "blocking_folds": self.blocking_folds,
                "peak_buffers": self.peak_buffers, "peak_bytes": self.peak_bytes, "waits": self.waits}
