"""Saved activations offloaded between a unit's forward and its backward (``zero.activation_offload``).

While a unit's forward runs, every tensor autograd saves for the unit's backward passes through
:meth:`ActivationOffload.pack` (``torch.autograd.graph.saved_tensors_hooks``, pushed by the unit's forward
pre-hook and popped by its forward hook). With activation checkpointing the unit saves only its input (the
checkpoint's own hooks catch everything inside it and drop it for the recompute); without, every tensor its
backward needs. A saved tensor worth moving (at least :data:`MIN_BYTES`, on the engine's device, laid out
densely, not a parameter's storage) becomes a store key with the chosen home tier: its bytes leave on the
store's copy thread, an NVMe home is written by the I/O engine and the host copy dropped once it is there, and
the graph holds only a :class:`SavedActivation`. A tensor saved twice in one forward (the same input to three
projections) is stored once.

Backward unpacks in the reverse of the pack order. Each unpack first starts bringing the next ones home to
host memory along that order, up to two units' saves (within ``prefetch.bytes``) ahead (the first at
``begin_backward``), so the
recompute finds them in place; then it copies its own into a new device tensor with the original shape and
strides (on a CPU device, whose memory is the host's, it hands autograd a view of the host copy instead,
pinned until the handle goes). The bytes are bitwise the ones saved. A key is released when autograd drops
its handle (the graph freed: after the unit's backward, or when a forward is abandoned), at the next safe
point, or at :meth:`ActivationOffload.close`.

Failures name their cause in one line (:class:`ActivationOffloadError`): a write that failed (ENOSPC) raises
in the forward that saved the tensor, at the unit's end or the next save; a read that failed or a checksum
that does not match raises in the backward that needed it. Neither touches parameters, gradients or optimizer
state, so the step can be run again once the cause is gone.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from infinity.store.residency import StoreError, Tier
from infinity.zero.pins import PinOwner

__all__ = ["ActivationOffload", "ActivationOffloadError", "SavedActivation", "MIN_BYTES", "dense_flat"]

MIN_BYTES = 64 * 2**10   # smaller saved tensors stay where they are: a key costs more than their bytes


class ActivationOffloadError(RuntimeError):
    """A saved activation could not be written to, or read back from, its tier."""


def dense_flat(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s elements in storage order as a 1-D view, or None when its layout has gaps or overlaps
    (strides that are not a permutation of a contiguous layout's)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class SavedActivation:
    """One saved tensor in the store: its key and what rebuilds it. The key is released when autograd
    drops this object (or the offload is closed)."""

    __slots__ = ("seq", "key", "unit", "shape", "stride", "dtype", "nbytes", "written", "brought",
                 "_release", "__weakref__")

    def __init__(self, seq: int, unit: int, t: torch.Tensor, written: cf.Future, release):
        self.seq, self.key, self.unit = seq, f"activation/{seq}", unit
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.written = written       # the store's register (its copier holds t until the bytes left it)
        self.brought: cf.Future | None = None
        self._release = weakref.finalize(self, release, self.key)


class ActivationOffload:
    """The pack / unpack hooks of one engine's units and the store keys they make (see the module doc).

    ``store``: the engine's :class:`~infinity.store.tensor_store.TensorStore`; ``tier``: ``"host"`` or
    ``"nvme"``; ``device``: where compute runs (only tensors there move); ``prefetch_bytes``: how far
    ahead backward brings saved tensors home to host memory (NVMe only)."""

    def __init__(self, store, tier: str, device: torch.device, prefetch_bytes: int):
        self.store, self.tier = store, Tier.parse(tier)
        self.device, self.prefetch_bytes = torch.device(device), prefetch_bytes
        self._seq = itertools.count()
        self._order: dict[int, weakref.ref] = {}   # seq -> handle, in pack order (live handles only)
        self._dropped: collections.deque = collections.deque()   # keys of handles autograd dropped
        self._pinned: dict = {}     # key -> its PinOwner: host copies autograd holds a view of (CPU device)
        self._largest_unit_bytes = 0   # the most one unit's forward moved out (unit.offloaded_bytes)
        self._settling: list[weakref.ref] = []   # handles packed, their write not yet seen done
        self._unit = None              # the unit whose forward runs (its runtime object: FlatUnit)
        self._hooks: saved_tensors_hooks | None = None
        self._seen: dict[int, tuple] = {}           # id(tensor) -> (weakref, handle): this unit's forward
        self._param_ptrs: set | None = None
        self._module = None
        self.stats = {"saved_bytes": 0, "restored_bytes": 0}

    # ------------------------------------------------------------ forward

    def begin_unit(self, unit) -> None:
        """The unit's forward starts (a training pass, not a recompute): its saved tensors come here."""
        if self._hooks is not None:
            raise RuntimeError(f"activation offload: unit {unit.index}'s forward began inside unit "
                               f"{self._unit.index}'s (units do not nest)")
        self.release_dropped()
        self._settle(wait=False)
        self._unit, self._module, self._param_ptrs, self._seen = unit, unit.module, None, {}
        unit.offloaded_bytes = 0
        self._hooks = saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()

    def end_unit(self) -> None:
        """The unit's forward ended (or raised): stop catching saves; raise if a write already failed."""
        if self._hooks is None:
            return
        hooks, self._hooks = self._hooks, None
        self._seen, self._module, self._param_ptrs = {}, None, None
        hooks.__exit__(None, None, None)
        self._settle(wait=False)

    def pack(self, t: torch.Tensor):
        """Autograd saves ``t``: a :class:`SavedActivation` for a tensor worth moving, else ``t`` itself."""
        if not self._worth_moving(t):
            return _kept(t)
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t:
            return seen[1]
        flat = dense_flat(t)
        if flat is None:
            return _kept(t)   # a view with gaps: rebuilding its layout would need its whole storage
        seq = next(self._seq)
        key = f"activation/{seq}"
        try:
            written = self.store.register(key, flat, home=self.tier, copy_async=True)
        except StoreError as e:
            raise ActivationOffloadError(f"activation offload: no room to save unit {self._unit.index}'s "
                                         f"activation ({_size(t)}) in the {self.tier.value} tier: {_cause(e)}") \
                from e
        handle = SavedActivation(seq, self._unit.index, t, written, self._release)
        self._order[seq] = weakref.ref(handle)
        self._settling.append(weakref.ref(handle))
        self._seen[id(t)] = (weakref.ref(t), handle)
        self.stats["saved_bytes"] += handle.nbytes
        self._unit.offloaded_bytes += handle.nbytes
        self._largest_unit_bytes = max(self._largest_unit_bytes, self._unit.offloaded_bytes)
        return handle

    def _worth_moving(self, t: torch.Tensor) -> bool:
        if not _on(t.device, self.device) or t.numel() * t.element_size() < MIN_BYTES or t.is_sparse:
            return False
        if self._param_ptrs is None:   # the unit's parameters are gathered once its forward runs
            self._param_ptrs = {p.untyped_storage().data_ptr() for p in self._module.parameters()}
        return t.untyped_storage().data_ptr() not in self._param_ptrs

    def _settle(self, wait: bool) -> None:
        """Look at saves whose write may have finished: drop an NVMe-homed key's host copy, raise a failed
        write (``wait``: until every one is home). A handle autograd dropped meanwhile is not looked at."""
        settling, self._settling = self._settling, []
        failed = None
        for ref in settling:
            handle = ref()
            if handle is None:
                continue
            if wait and failed is None:
                try:
                    self.store.wait(handle.written)
                except (StoreError, OSError) as e:
                    e.__traceback__ = None   # raised below, with the rest settled first (see _wait)
            if not handle.written.done():
                self._settling.append(ref)
                continue
            if handle.written.exception() is not None:
                failed = failed or handle
            elif self.tier is Tier.NVME and handle.brought is None:
                self.store.evict(handle.key, Tier.HOST)   # clean once home: dropped at once
        if failed is not None:
            error = failed.written.exception()
            raise ActivationOffloadError(f"activation offload: writing unit {failed.unit}'s activation "
                                         f"({_size(failed)}) to {self.tier.value} failed: {_cause(error)}") \
                from error

    # ------------------------------------------------------------ backward

    def begin_backward(self) -> None:
        """Backward starts: bring the last saves home first (they are unpacked first)."""
        self.release_dropped()
        self._settle(wait=False)
        self._prefetch(below=None)

    def unpack(self, handle):
        """Autograd needs a saved tensor back: bring the next ones ahead, then rebuild this one."""
        if not isinstance(handle, SavedActivation):
            return handle
        self.release_dropped()
        self._prefetch(below=handle.seq)
        store = self.store
        if self.tier is Tier.NVME:
            if handle.brought is None or handle.brought.done() and handle.brought.exception() is not None:
                handle.brought = store.bring(handle.key, Tier.HOST)
            _wait(store, handle.brought, handle, "reading")
        else:
            _wait(store, handle.written, handle, "writing")
        owner = PinOwner.activation(handle.seq)
        try:
            if self.device.type == "cpu":
                # the device is host memory: autograd gets a view of the host copy, pinned until the handle
                # is dropped (after the unit's backward), with no copy and no new block for the allocator
                if handle.key not in self._pinned:
                    store.pin(handle.key, Tier.HOST, owner=owner)
                    self._pinned[handle.key] = owner
                host = store.get(handle.key, Tier.HOST)
                out = host.as_strided(handle.shape, handle.stride, host.storage_offset())
            else:
                out = torch.empty_strided(handle.shape, handle.stride, dtype=handle.dtype, device=self.device)
                with store.use(handle.key, Tier.HOST, owner=owner) as host:
                    # a blocking host->device copy: the host buffer is free to reuse once it returns
                    out.as_strided((out.numel(),), (1,), 0).copy_(host)
        except (StoreError, OSError) as e:
            raise ActivationOffloadError(f"activation offload: reading unit {handle.unit}'s activation "
                                         f"({_size(handle)}) from {self.tier.value} failed: {_cause(e)}") from e
        if self.tier is Tier.NVME and handle.key not in self._pinned:
            handle.brought = None
            store.evict(handle.key, Tier.HOST)
        self.stats["restored_bytes"] += handle.nbytes
        return out

    def _prefetch(self, below: int | None) -> None:
        """Start bringing saved tensors home to host memory, newest first from ``below`` down, until the
        window is brought or on the way: ``prefetch_bytes``, at most two units' saves (one unit's
        backward hides the next one's read; more would only hold memory). NVMe only: a host home is there
        already."""
        if self.tier is not Tier.NVME:
            return
        window = min(self.prefetch_bytes, 2 * self._largest_unit_bytes)
        ahead = 0
        for seq in sorted(self._order.copy(), reverse=True):   # a copy: a dropped handle may pop one
            if below is not None and seq >= below:
                continue
            ref = self._order.get(seq)
            handle = ref() if ref is not None else None
            if handle is None:
                continue
            if ahead + handle.nbytes > window and ahead:
                return
            ahead += handle.nbytes
            if handle.brought is None:
                try:
                    handle.brought = self.store.bring(handle.key, Tier.HOST)
                except StoreError:
                    return   # no room ahead now: the unpack brings it when needed

    # ------------------------------------------------------------ keys

    def _release(self, key: str) -> None:
        """A handle was dropped by autograd: its key is released at the next safe point. (A finalizer runs
        wherever the collector does, perhaps inside the store's lock: it must not call the store.)"""
        self._order.pop(int(key.rsplit("/", 1)[1]), None)
        self._dropped.append(key)

    def release_dropped(self) -> None:
        """Forget the keys of handles autograd dropped (the store waits for a write in flight)."""
        while self._dropped:
            key = self._dropped.popleft()
            owner = self._pinned.pop(key, None)
            if owner is not None:
                self.store.unpin(key, Tier.HOST, owner=owner)
            if key in self.store:   # a failed write registered nothing
                self.store.release(key)

    def pending(self) -> int:
        """Saved tensors still held in the store (their graphs not yet freed)."""
        self.release_dropped()
        return len(self._order)

    def close(self) -> None:
        """Forget every key still held (before the store closes); handles dropped later change nothing."""
        if self._hooks is not None:
            try:
                self.end_unit()
            except ActivationOffloadError:
                pass   # a write of a step being abandoned: nothing of it is kept
        for ref in list(self._order.values()):
            handle = ref()
            if handle is not None:
                handle._release.detach()
                self._dropped.append(handle.key)
        self._order.clear()
        self._settling = []
        self.release_dropped()


def _on(device: torch.device, compute: torch.device) -> bool:
    """``device`` is the compute device (``cuda`` without an index names the current one)."""
    return device.type == compute.type and (compute.index is None or device.index == compute.index)


def _kept(t: torch.Tensor) -> torch.Tensor:
    """A tensor saved as it is. Detached when it has a node: an output saved by its own node, held whole,
    would hold that node (a cycle through C++ the collector cannot see), so a forward never followed by a
    backward would keep its graph, and the handles in it, for good; autograd rejoins an unpacked output to
    its node itself."""
    return t.detach() if t.grad_fn is not None else t


def _wait(store, fut: cf.Future, handle: SavedActivation, doing: str):
    try:
        return store.wait(fut)
    except (StoreError, OSError) as e:
        # the future keeps its exception, and a re-raise appends our frames (which hold the handle) to its
        # traceback: cut it, or the store's record would keep the handle, and so the key, alive for good
        e.__traceback__ = None
        handle.brought = None
        raise ActivationOffloadError(f"activation offload: {doing} unit {handle.unit}'s activation "
                                     f"({_size(handle)}) failed: {_cause(e)}") from e


def _size(x) -> str:
    nbytes = x.nbytes if isinstance(x, SavedActivation) else x.numel() * x.element_size()
    return f"{nbytes / 2**20:.1f} MiB"


def _cause(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
