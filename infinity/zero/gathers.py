"""Stage 3: each unit's full parameters, gathered just before use and released just after.

A unit is SHARDED (only this rank's shard exists), GATHERING (its full buffer
allocated and the all-gather launched) or GATHERED (parameters are usable
views). The shard an all-gather reads comes from the unit's home
(:meth:`UnitShard.param_for_gather`: in memory, or a pinned device copy from
the store). Gathered bytes are capped by ``prefetch.max_live_bytes``
(:mod:`infinity.zero.live_units`): a gather for use releases units gathered
ahead or kept for backward first, a gather ahead only starts if it fits.

How a gather moves bytes is the passed-in unit collectives' business
(:class:`~infinity.comm.unit_collectives.UnitCollectives`, or ZeRO++'s
:class:`~infinity.comm.zeropp.ZeroPlusPlus` with the same methods), not when it
happens: with qwZ the shard travels block-quantized, with hpZ a unit's
backward gather reads the secondary shards its forward left inside the node
(kept in :meth:`UnitGathers.after_forward`, dropped in
:meth:`UnitGathers.release_all` at the end of backward).

The recorded unit order (the engine's :class:`TracePrefetcher`) drives both
kinds of prefetch: the stored shards of the next units are brought toward the
device within ``prefetch.bytes``, and the next unit's all-gather starts early.
Only training passes are recorded; a ``torch.no_grad()`` pass gathers on
demand and leaves the trace alone. Every rank makes the same decisions (the
hooks run in the same order everywhere), which matters: a gather is a
collective, and ranks that disagreed on whether to start one would deadlock.
"""

from __future__ import annotations

import time

from infinity.store import BudgetError
from infinity.zero.storage_pool import StoragePool
from infinity.zero.units import UnitState, UnitUse

__all__ = ["UnitGathers", "ReplicatedParams"]


class _Gather:
    """A launched all-gather: its collective, what to do once it is done, and when it started."""

    __slots__ = ("pending", "done", "t0")

    def __init__(self, pending, done, t0: float):
        self.pending, self.done, self.t0 = pending, done, t0


class UnitGathers:
    """Gather / release of the engine's units. ``update`` says which units the running (overlapped)
    update is writing, which must not be gathered, and waits for host room it holds."""

    def __init__(self, units: list, unit_comm, live, prefetcher, update, tracer, reshard_after_forward: bool,
                 rank: int, buffers: StoragePool | None = None):
        self.units, self.unit_comm, self.live, self.prefetcher = units, unit_comm, live, prefetcher
        self.update, self.tracer = update, tracer
        self.reshard_after_forward, self.rank = reshard_after_forward, rank
        # the full buffers' memory: reused between gathers on a CPU device (storage_pool's module doc)
        self.buffers = buffers if buffers is not None else StoragePool(reuse=False)

    def gather(self, unit, wait: bool = True) -> None:
        """SHARDED -> GATHERING (-> GATHERED if ``wait``); a no-op if already on the way."""
        if unit.state is UnitState.SHARDED:
            self.update.check_gather(unit)
            full = unit.full_param
            self.buffers.fill(full.untyped_storage(), unit.padded_numel * full.element_size())
            try:
                if self.unit_comm.has_secondary(unit.index):
                    src, done = None, None   # hpZ: gathered from the node's secondary shards, not the stored one
                else:
                    # one rank: a chunked shard is assembled in the full buffer itself (no copy of it)
                    into = full if self.unit_comm.gathers_in_place else None
                    src, done = unit.shard.param_for_gather(into)
            except BaseException:
                self.buffers.empty(full.untyped_storage())   # still SHARDED: its buffer must not stay allocated
                raise
            unit.transition(UnitState.GATHERING)
            self.live.gathering(unit)
            pending = self.unit_comm.all_gather(unit, full, src)   # keeps autograd's version counter
            unit.gather = _Gather(pending, done, time.perf_counter())
        if wait and unit.state is UnitState.GATHERING:
            g, unit.gather = unit.gather, None
            try:
                g.pending.wait()
            finally:
                if g.done is not None:
                    g.done()   # the gather no longer reads its source (e.g. unpin the stored shard)
                if unit.compute_param is not None:
                    self._upcast(unit)
                unit.transition(UnitState.GATHERED)
            self.tracer.add(f"all-gather {unit.name}", g.t0, time.perf_counter(), lane="comm")

    def _upcast(self, unit) -> None:
        """The gathered stored-dtype buffer into the compute-dtype one (refilled in place: autograd's saved
        views hold that storage), then the stored-dtype buffer is freed: the parameters view the upcast."""
        compute = unit.compute_param
        self.buffers.fill(compute.untyped_storage(), unit.padded_numel * compute.element_size())
        compute.set_(compute.untyped_storage(), 0, (unit.padded_numel,))
        compute.copy_(unit.full_param)
        self.buffers.empty(unit.full_param.untyped_storage())

    def release(self, unit) -> None:
        """Free the full buffer (parameters stay views of it, unusable until the next gather)."""
        if unit.state is UnitState.GATHERING:
            self.gather(unit)  # the collective must finish before its output storage is freed
        if unit.state is UnitState.GATHERED:
            unit.transition(UnitState.SHARDED)
            self.live.released(unit)
            self.buffers.empty(unit.full_param.untyped_storage())   # (already empty once upcast)
            if unit.compute_param is not None:
                self.buffers.empty(unit.compute_param.untyped_storage())
        elif unit.use is not UnitUse.IDLE:
            self.live.set_use(unit, UnitUse.IDLE)   # wanted, but its gather never started (it raised)

    def release_all(self) -> None:
        """Release every unit; the end of a backward (or of a pass that will have none): hpZ's secondary
        shards, kept for this backward, are dropped too."""
        for unit in self.units:
            self.release(unit)
        self.unit_comm.drop_secondaries()

    def acquire(self, unit) -> None:
        """Gather ``unit`` for use now (its forward or backward; the root's whole step). It stays in use,
        never released for the cap, until :meth:`release` or :meth:`after_forward`. If gathering it would
        exceed ``prefetch.max_live_bytes``, units gathered but not in use are released first; if that is
        not enough, raises RuntimeError instead of exceeding the cap."""
        if unit.state is UnitState.SHARDED and not self.live.fits(unit):
            for victim in self.live.victims_for(unit, self.rank):
                self.release(victim)   # a gathering victim is waited on first (see release)
        self.live.set_use(unit, UnitUse.IN_USE)
        self.gather(unit)

    def after_forward(self, unit) -> None:
        """A unit's forward is done: release it (``reshard_after_forward``), or keep it gathered for its
        backward, where the cap may release it (its backward then gathers it again)."""
        if self.reshard_after_forward:
            if unit.state is UnitState.GATHERED:
                self.unit_comm.keep_secondary(unit)   # hpZ: the backward gathers inside the node
            self.release(unit)
        elif unit.state is not UnitState.SHARDED:
            self.live.set_use(unit, UnitUse.KEPT)

    def gather_ahead(self, unit) -> None:
        """Prefetch: start ``unit``'s all-gather now if it is sharded and fits under the cap (nothing is
        released for it)."""
        if unit.state is UnitState.SHARDED and self.live.fits(unit) and not self.update.updating(unit):
            self.live.set_use(unit, UnitUse.AHEAD)
            self.gather(unit, wait=False)

    def end_step(self, all_agree) -> None:
        """The step is done: every rank keeps or re-records the prefetch trace together (``all_agree``, a
        collective): a rank prefetching along a dropped trace would start all-gathers in an order the
        others do not, and deadlock."""
        self.prefetcher.end_step(all_agree)

    def step_peak_bytes(self, live_peak_bytes: int) -> int:
        """The step's gathered bytes for the memory report: the live peak, or (CPU device) the full
        buffers' memory with what is kept for reuse."""
        return max(live_peak_bytes, self.buffers.take_window_peak())

    def use_unit(self, unit, training: bool) -> None:
        """A unit's forward or backward is about to run: gather it for use; in a training pass record
        the use and prefetch along the trace (see the module doc)."""
        if not training:
            self.acquire(unit)
            return
        fetch = self.prefetcher.on_use(unit.index)
        self.acquire(unit)
        for index in fetch:
            if self.update.updating(self.units[index]):
                continue   # Adam is writing its shard (a trace from another step's order): no use this step
            if self.unit_comm.has_secondary(index):
                continue   # hpZ: its backward gathers from the secondary shards, the stored one is not read
            try:
                self.units[index].shard.prefetch_param()
            except BudgetError:
                break   # the device tier is full of pinned copies: fetch on demand instead
        nxt = self.prefetcher.upcoming(1)
        if nxt:
            self.gather_ahead(self.units[nxt[0]])   # only if it fits prefetch.max_live_bytes


class ReplicatedParams:
    """Stages 0-2: every rank holds every unit's full parameters for the whole run, so there is nothing to
    gather or release. The engine sends the same verbs at every stage; here each is a no-op."""

    def __init__(self):
        self.buffers = StoragePool(reuse=False)   # never filled: trimmed at close like stage 3's

    def gather(self, unit, wait: bool = True) -> None:
        pass

    def release(self, unit) -> None:
        pass

    def release_all(self) -> None:
        pass

    def acquire(self, unit) -> None:
        pass

    def after_forward(self, unit) -> None:
        pass

    def use_unit(self, unit, training: bool) -> None:
        pass

    def end_step(self, all_agree) -> None:
        pass   # no trace is recorded: nothing is prefetched

    def step_peak_bytes(self, live_peak_bytes: int) -> int:
        return 0   # the full parameters are resident, counted there
