"""Collectives over the data-parallel group, with byte accounting.

Every collective the engine issues goes through :class:`Collectives`, which
counts, per kind, the logical elements and bytes (the size of the full
gathered / reduced buffer; what the ZeRO paper calls "volume") and the bytes
this rank sends and receives under a ring schedule (``(N-1)/N`` of the buffer
for an all-gather or a reduce-scatter, twice that for an all-reduce).

:class:`LocalCollectives` is the world-size-1 version with the same API: no
process group needed, every collective is a copy (or nothing), and the same
logical volume is counted so the theory checks read the same at every size.

With a node layout (:meth:`Collectives.set_nodes`, from where the launcher
put each rank, or :meth:`Collectives.set_ranks_per_node`: consecutive ranks
share a node) the bytes this rank sends are also split into
``intra_node_bytes`` and ``cross_node_bytes``, counted pairwise: what the
collective delivers from this rank to each other member of its group, booked
by whether that member is on this rank's node. An all-gather delivers this
rank's shard to every other member, a reduce-scatter (or an all-to-all) one
slice to each, an all-reduce twice that. For every call the two add up to
``sent_bytes``; it is the count the ZeRO++ paper uses for cross-node volume,
and what :mod:`infinity.estimate` predicts. Without a layout every rank is on
one node: cross-node bytes are 0. :meth:`Collectives.subgroup` makes the same
collectives over a sub-group (ZeRO++'s intra-node and cross-node groups),
booking into the same counters.

Time: ``wait_s`` is the host's time in :meth:`Pending.wait`. Under NCCL a
wait only makes the caller's stream wait for the collective's, so the host
returns at once and ``wait_s`` reads ~0 however long the compute stream
stalls; there each wait is also bracketed by two timing events on the current
stream, and ``wait_device_s`` sums the device time between them: how long the
compute stream sat waiting for communication (collectives launched without
``async_op``, small control ones, are not in it). Reading the events waits once
per snapshot for the last of them.

The torch 2.13 names are used (``all_gather_single``, ``reduce_scatter_single``);
older torch falls back to ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from infinity.comm.watchdog import watch

__all__ = ["Collectives", "LocalCollectives", "CommCounters", "make_collectives"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")

_THREAD_WAITS = threading.local()   # per thread, across every CommCounters (see CommCounters.thread_wait_s)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCounters:
    """Per-kind totals since the last :meth:`reset`."""

    calls: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    elements: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    # ZeRO-paper volume: an all-reduce counts twice (reduce-scatter + all-gather)
    volume_elements: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    sent_bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    received_bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    # pairwise bytes this rank delivers to other members, by where they are (see the module doc)
    intra_node_bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    cross_node_bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    wait_s: float = 0.0
    # NCCL: (before, after) timing events around each wait (module doc); None off CUDA
    device_waits: list | None = None
    # CUDA-only by default; tests give a fake with record() / synchronize() / elapsed_time(end) in ms
    make_timing_event: object = None

    def add_wait(self, seconds: float) -> None:
        """Book ``seconds`` the calling thread spent blocked on a collective."""
        self.wait_s += seconds
        _THREAD_WAITS.s = getattr(_THREAD_WAITS, "s", 0.0) + seconds

    @staticmethod
    def thread_wait_s() -> float:
        """Seconds the calling thread has spent blocked on collectives (any counters), never reset: a
        caller takes differences to attribute waits to what its own thread was doing."""
        return getattr(_THREAD_WAITS, "s", 0.0)

    def timing_event(self):
        make = self.make_timing_event or (lambda: torch.cuda.Event(enable_timing=True, blocking=True))
        event = make()
        event.record()   # on the calling thread's current stream: the one that will wait
        return event

    def add(self, kind: str, numel: int, itemsize: int, ring_fraction: float, peer_bytes: int = 0,
            peers: tuple = (0, 0)) -> None:
        """One call of ``kind`` on a buffer of ``numel`` elements; ``peer_bytes`` delivered to each of
        ``peers`` = (other members on this node, members on other nodes)."""
        self.calls[kind] += 1
        self.elements[kind] += numel
        self.volume_elements[kind] += 2 * numel if kind == "all_reduce" else numel
        self.bytes[kind] += numel * itemsize
        moved = int(round(numel * itemsize * ring_fraction))
        self.sent_bytes[kind] += moved
        self.received_bytes[kind] += moved
        self.intra_node_bytes[kind] += peer_bytes * peers[0]
        self.cross_node_bytes[kind] += peer_bytes * peers[1]

    def reset(self) -> None:
        for d in (self.calls, self.elements, self.volume_elements, self.bytes, self.sent_bytes,
                  self.received_bytes, self.intra_node_bytes, self.cross_node_bytes):
            for k in d:
                d[k] = 0
        self.wait_s = 0.0
        if self.device_waits is not None:
            self.device_waits = []

    def snapshot(self) -> dict:
        return {
            "calls": dict(self.calls), "elements": dict(self.elements),
            "volume_elements": dict(self.volume_elements), "bytes": dict(self.bytes),
            "sent_bytes": dict(self.sent_bytes), "received_bytes": dict(self.received_bytes),
            "intra_node_bytes": dict(self.intra_node_bytes), "cross_node_bytes": dict(self.cross_node_bytes),
            "wait_s": self.wait_s, "wait_device_s": self._device_wait_s(),
        }

    def _device_wait_s(self) -> float | None:
        if self.device_waits is None:
            return None
        if self.device_waits:
            self.device_waits[-1][1].synchronize()   # one stream: the last covers the rest
        for _, after in self.device_waits:
            after.synchronize()   # waits from another thread's stream (autograd's) may trail
        return sum(before.elapsed_time(after) for before, after in self.device_waits) / 1e3


class Pending:
    """A launched collective; :meth:`wait` blocks (watched, as ``what``) and books the wait time."""

    __slots__ = ("_work", "_counters", "_then", "_what")

    def __init__(self, work, counters: CommCounters, then=None, what: str = "a collective"):
        self._work, self._counters, self._then, self._what = work, counters, then, what

    def wait(self) -> None:
        if self._work is not None:
            counters = self._counters
            timed = counters.device_waits is not None
            before = counters.timing_event() if timed else None
            t0 = time.perf_counter()
            with watch(self._what):
                self._work.wait()
            counters.add_wait(time.perf_counter() - t0)
            if timed:   # the current stream now waits for the collective: the stall lies between the two
                counters.device_waits.append((before, counters.timing_event()))
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _finish(work, counters: CommCounters, then, async_op: bool, what: str = "a collective") -> Pending:
    """Async: the caller waits (and ``then`` runs on wait). Sync: ``then`` runs now."""
    pending = Pending(work, counters, then, what)
    if not async_op:
        pending.wait()
    return pending


class Collectives:
    """The data-parallel process group; one instance per engine (and one per ZeRO++ sub-group)."""

    def __init__(self, group=None, counters: CommCounters | None = None, ranks_per_node: int | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Collectives needs torch.distributed initialized; use LocalCollectives at world size 1")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.counters = counters if counters is not None else CommCounters()
        if self.backend == "nccl" and self.counters.device_waits is None:
            self.counters.device_waits = []   # CUDA-only: time waits on the device too (module doc)
        # global ranks of the group's members, in group-rank order
        self.members = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self.global_rank = self.members[self.rank]
        self.set_ranks_per_node(ranks_per_node or dist.get_world_size())

    def set_ranks_per_node(self, ranks_per_node: int) -> None:
        """Consecutive global ranks share a node, ``ranks_per_node`` of them; sets the byte split."""
        self.set_nodes({m: m // ranks_per_node for m in self.members}, ranks_per_node)

    def set_nodes(self, node_of: dict, ranks_per_node: int | None) -> None:
        """``node_of``: each member's node (by global rank), as the launcher placed them
        (:mod:`infinity.comm.node_layout`); ``ranks_per_node``: its size where every node holds the same
        number of consecutive ranks, else None. Sets the byte split."""
        self.node_of, self.ranks_per_node = dict(node_of), ranks_per_node
        node = self.node_of[self.global_rank]
        others = [m for m in self.members if m != self.global_rank]
        intra = sum(1 for m in others if self.node_of[m] == node)
        self._peers = (intra, len(others) - intra)

    def subgroup(self, group) -> "Collectives":
        """The same collectives over ``group`` (this rank a member), booking into the same counters."""
        sub = Collectives(group, self.counters)
        sub.set_nodes({m: self.node_of[m] for m in sub.members}, self.ranks_per_node)
        return sub

    def _ring(self, times: int = 1) -> float:
        return times * (self.world_size - 1) / self.world_size

    def _add(self, kind: str, t: torch.Tensor, ring_times: int, peer_bytes: int) -> None:
        self.counters.add(kind, t.numel(), t.element_size(), self._ring(ring_times), peer_bytes, self._peers)

    def _what(self, kind: str, t: torch.Tensor | None = None, label: str | None = None) -> str:
        """How the watchdog names a call: kind, what it is for (e.g. the unit), size, group (ranks)."""
        size = f" of {t.numel() * t.element_size():,} bytes" if t is not None else ""
        return f"{kind}{f' ({label})' if label else ''}{size} over ranks {self.members}"

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False, then=None,
                   label: str | None = None) -> Pending:
        """``full`` (N * shard numel) <- every rank's ``shard``, in rank order. ``label``: what the
        watchdog says the call is for (e.g. ``unit 'h.3'``)."""
        if full.numel() != shard.numel() * self.world_size:
            raise ValueError(f"all_gather: full buffer has {full.numel()} elements, expected "
                             f"{self.world_size} x {shard.numel()} (rank {self.rank})")
        self._add("all_gather", full, 1, shard.numel() * shard.element_size())
        what = self._what("all_gather", full, label)
        with watch(what):   # async: returns at once; the wait in Pending.wait is the watched one
            work = _all_gather(full, shard, group=self.group, async_op=async_op)
        return _finish(work if async_op else None, self.counters, then, async_op, what)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, average: bool = True,
                       async_op: bool = False, then=None, label: str | None = None) -> Pending:
        """``shard`` <- this rank's slice of the sum (or mean) of every rank's ``full``."""
        if full.numel() != shard.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input has {full.numel()} elements, expected "
                             f"{self.world_size} x {shard.numel()} (rank {self.rank})")
        self._add("reduce_scatter", full, 1, shard.numel() * full.element_size())
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        what = self._what("reduce_scatter", full, label)
        with watch(what):   # async: returns at once; the wait in Pending.wait is the watched one
            work = _reduce_scatter(shard, full, op=op, group=self.group, async_op=async_op)
        return _finish(work if async_op else None, self.counters, then, async_op, what)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, kind: str = "reduce_scatter", async_op: bool = False,
                   then=None) -> Pending:
        """Row i of ``inp`` (shape [group size, row]) goes to member i; ``out`` row j came from member j.
        Booked as ``kind``: ZeRO++'s quantized reduce-scatter is made of these."""
        if inp.shape[0] != self.world_size or out.shape != inp.shape:
            raise ValueError(f"all_to_all: expected [{self.world_size}, row] in and out, got {tuple(inp.shape)} "
                             f"and {tuple(out.shape)} (rank {self.rank})")
        self._add(kind, inp, 1, inp[0].numel() * inp.element_size())
        what = self._what("all_to_all", inp)
        with watch(what):   # async: returns at once; the wait in Pending.wait is the watched one
            work = dist.all_to_all_single(out, inp, group=self.group, async_op=async_op)
        return _finish(work if async_op else None, self.counters, then, async_op, what)

    def all_reduce(self, tensor: torch.Tensor, average: bool = True, async_op: bool = False, then=None) -> Pending:
        self._add("all_reduce", tensor, 2, 2 * _slice_bytes(tensor, self.world_size))
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        what = self._what("all_reduce", tensor)
        with watch(what):   # async: returns at once; the wait in Pending.wait is the watched one
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        return _finish(work if async_op else None, self.counters, then, async_op, what)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Small control all-reduce (overflow flags); counted like any other."""
        self._add("all_reduce", tensor, 2, 2 * _slice_bytes(tensor, self.world_size))
        with watch(self._what("all_reduce (max)", tensor)):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._add("all_reduce", tensor, 2, 2 * _slice_bytes(tensor, self.world_size))
        with watch(self._what("all_reduce (sum)", tensor)):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._add("broadcast", tensor, 1, _slice_bytes(tensor, self.world_size))
        with watch(self._what("broadcast", tensor)):
            dist.broadcast(tensor, group_src=src, group=self.group)   # src: a rank of this group

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (control data, e.g. structure signatures); not counted."""
        out = [None] * self.world_size
        with watch(self._what("all_gather_object")):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_agree(self, ok: bool) -> bool:
        """True only if every rank's ``ok`` is True (control data, 4 bytes; not counted)."""
        device = "cuda" if self.backend == "nccl" else "cpu"   # CUDA-only: NCCL reduces device tensors
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
        with watch(self._what("all_agree")):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.item() == 0


def _slice_bytes(t: torch.Tensor, n: int) -> int:
    """Bytes of one member's slice of ``t`` (a ring moves this much per peer, per pass)."""
    return t.numel() * t.element_size() // n


class LocalCollectives:
    """World size 1, no process group: same API, same logical volume counted, nothing sent."""

    rank = 0
    global_rank = 0
    world_size = 1
    backend = "local"
    group = None
    members = [0]
    ranks_per_node = 1

    def __init__(self):
        self.counters = CommCounters()

    def set_ranks_per_node(self, ranks_per_node: int) -> None:
        pass   # one rank: nothing to split

    def set_nodes(self, node_of: dict, ranks_per_node: int | None) -> None:
        pass

    def subgroup(self, group) -> "LocalCollectives":
        return self

    def all_to_all(self, out, inp, kind="reduce_scatter", async_op=False, then=None) -> Pending:
        self.counters.add(kind, inp.numel(), inp.element_size(), 0.0)
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return _finish(None, self.counters, then, async_op)

    def all_gather(self, full, shard, async_op=False, then=None, label=None) -> Pending:
        self.counters.add("all_gather", full.numel(), full.element_size(), 0.0)
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return _finish(None, self.counters, then, async_op)

    def reduce_scatter(self, shard, full, average=True, async_op=False, then=None, label=None) -> Pending:
        self.counters.add("reduce_scatter", full.numel(), full.element_size(), 0.0)
        if full.data_ptr() != shard.data_ptr():
            shard.copy_(full)
        return _finish(None, self.counters, then, async_op)

    def all_reduce(self, tensor, average=True, async_op=False, then=None) -> Pending:
        self.counters.add("all_reduce", tensor.numel(), tensor.element_size(), 0.0)
        return _finish(None, self.counters, then, async_op)

    def all_reduce_max(self, tensor) -> None:
        self.counters.add("all_reduce", tensor.numel(), tensor.element_size(), 0.0)

    def all_reduce_sum(self, tensor) -> None:
        self.counters.add("all_reduce", tensor.numel(), tensor.element_size(), 0.0)

    def broadcast(self, tensor, src=0) -> None:
        self.counters.add("broadcast", tensor.numel(), tensor.element_size(), 0.0)

    def all_gather_object(self, obj) -> list:
        return [pickle.loads(pickle.dumps(obj))]

    def all_agree(self, ok: bool) -> bool:
        return bool(ok)


def make_collectives(group=None):
    """The process group's collectives if torch.distributed is up (world > 1 or not), else the local ones."""
    if dist.is_available() and dist.is_initialized():
        return Collectives(group)
    return LocalCollectives()
