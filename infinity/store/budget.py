"""Per-tier byte budgets: what "auto" means, the accounting, and how room is made.

Trade-off: a bigger device budget keeps more working copies resident (fewer
transfers per step) at the cost of memory the model's activations could use; a
bigger host budget caches more NVMe-homed state at the cost of host RAM that
other ranks on the machine share.

``auto`` is measured once, at start-up, and shared out so that it still holds
when every rank of the node has taken its part and the step is at its peak:

- host: ``(available RAM - OS reserve) * HOST_AUTO_FRACTION / local ranks``. The
  OS reserve (``max(OS_RESERVE_MIN_BYTES, OS_RESERVE_FRACTION * total)``) is left
  for the kernel, the page cache and other processes; the other half of the rest
  is the process's own (the model being built, activations and gradients on a
  CPU device, CPU Adam's scratch, buffers outside the store). Every rank of the
  node (``LOCAL_WORLD_SIZE``) measures the same available RAM at start-up, so
  each takes only its share; 8 ranks no longer pin 8 times the machine.
- device (CUDA): ``free - working set - activations - slack``: the caller's
  :class:`DeviceHeadroom` names the gathered working set (full parameters and
  gradients of the units live at once) and the activations (default
  ``ACTIVATION_FRACTION`` of the device, until measured); the slack
  (``max(DEVICE_SLACK_MIN_BYTES, DEVICE_SLACK_FRACTION * total)``) is for NCCL's
  buffers, the caching allocator's fragmentation and the copy streams.
- device (CPU, where the "device" is ordinary memory): 1/4 of the RAM per local
  rank, small enough that the device tier is over-subscribed for real. With the
  host budget auto too, both tiers are that same RAM: the device tier is carved
  out of the host half (at most half of it), so the two together still leave the
  process its own half. On top of each other (3/4 of the RAM and more) the ranks
  of a tight grant were killed by the kernel while their model was loading.

"RAM" and "available" are what this process may use: in a container or a job
whose cgroup grants it less memory than the machine has, the grant
(:mod:`infinity.store.memory_grant`), since the kernel kills the job at its
limit however much the machine has free.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass

import torch

from infinity.config import TiersConfig, format_size
from infinity.store.eviction import Candidate, EvictionPolicy
from infinity.store.memory_grant import host_memory
from infinity.store.records import KeyRecord
from infinity.store.residency import Residency, StoreError, Tier

__all__ = ["BudgetError", "Room", "pool_of", "TierAccount", "DeviceHeadroom", "resolve_budgets", "auto_host_bytes",
           "auto_device_bytes", "local_ranks", "plan_room", "plan_spill", "idle_copies", "idle_candidates"]

GiB = 2**30
OS_RESERVE_MIN_BYTES = 2 * GiB      # host RAM auto never plans for: kernel, page cache, other processes
OS_RESERVE_FRACTION = 0.10          # ... or this share of physical RAM, if more
HOST_AUTO_FRACTION = 0.5            # of the rest, for the host tier; the other half is the process's own
CPU_DEVICE_FRACTION = 0.25          # of physical RAM, for a CPU "device" tier
ACTIVATION_FRACTION = 0.25          # of device memory, for activations until the caller measures them
DEVICE_SLACK_MIN_BYTES = 1 * GiB    # NCCL buffers, allocator fragmentation, streams, CUDA context growth
DEVICE_SLACK_FRACTION = 0.05        # ... or this share of device memory, if more

log = logging.getLogger(__name__)


class BudgetError(StoreError):
    """A tier cannot make room: nothing in it can be evicted and nothing in flight will free space."""

    def __init__(self, tier: Tier, budget_bytes: int, in_use_bytes: int, requested_bytes: int, why: str,
                 room=None):
        super().__init__(
            f"{tier.value} tier: cannot fit {requested_bytes} bytes ({format_size(requested_bytes)}): "
            f"budget {budget_bytes} bytes ({format_size(budget_bytes)}), in use {in_use_bytes} bytes; {why}")
        self.tier, self.budget_bytes = tier, budget_bytes
        self.in_use_bytes, self.requested_bytes = in_use_bytes, requested_bytes
        self.room = room   # the Room that is short; None: the tier's shared pool


@dataclass(frozen=True)
class DeviceHeadroom:
    """Device bytes an ``auto`` device budget leaves outside the tier, besides the slack.

    ``working_set_bytes``: what the step holds on the device outside the store at its peak (full
    parameters and gradients of the units gathered at once, reduce buckets). ``activation_bytes``:
    the activations of one micro-batch; None = ``ACTIVATION_FRACTION`` of the device's memory.
    """

    working_set_bytes: int = 0
    activation_bytes: int | None = None


def local_ranks() -> int:
    """Ranks sharing this machine: ``LOCAL_WORLD_SIZE`` (torchrun and our launcher set it), else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1") or "1"
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not a number of ranks; unset it or set the count "
                         "of ranks on this machine") from None
    if n < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={n}: must be >= 1 (the ranks on this machine)")
    return n


def auto_host_bytes(available_bytes: int, total_bytes: int, ranks: int) -> int:
    """``tiers.host_bytes: auto`` for one of ``ranks`` ranks on a machine (module doc)."""
    os_reserve = max(OS_RESERVE_MIN_BYTES, int(OS_RESERVE_FRACTION * total_bytes))
    return max(0, int((available_bytes - os_reserve) * HOST_AUTO_FRACTION)) // ranks


def auto_device_bytes(free_bytes: int, total_bytes: int, headroom: DeviceHeadroom) -> int:
    """``tiers.device_bytes: auto`` on a CUDA device with ``free_bytes`` of ``total_bytes`` free (module doc)."""
    activations = (headroom.activation_bytes if headroom.activation_bytes is not None
                   else int(ACTIVATION_FRACTION * total_bytes))
    slack = max(DEVICE_SLACK_MIN_BYTES, int(DEVICE_SLACK_FRACTION * total_bytes))
    return max(0, free_bytes - headroom.working_set_bytes - activations - slack)


def resolve_budgets(tiers: TiersConfig, device: torch.device,
                    headroom: DeviceHeadroom | None = None) -> dict[Tier, int]:
    """Byte budgets for the device and host tiers (NVMe is bounded by the disk, not by us); ``auto`` as
    in the module doc, measured now."""
    headroom = headroom if headroom is not None else DeviceHeadroom()
    auto = "auto" in (tiers.device_bytes, tiers.host_bytes)
    ranks = local_ranks() if auto else 1
    memory = host_memory() if auto else None   # RAM this process may use: the machine's, or its cgroup's grant
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    if tiers.device_bytes != "auto":
        device_bytes = tiers.device_bytes
    elif on_cuda:
        free, total = torch.cuda.mem_get_info(device)   # CUDA-only: this device's (free, total) bytes
        device_bytes = auto_device_bytes(free, total, headroom)
    else:
        device_bytes = int(memory.total_bytes * CPU_DEVICE_FRACTION) // ranks
    if tiers.host_bytes != "auto":
        host_bytes = tiers.host_bytes
    else:
        host_bytes = auto_host_bytes(memory.available_bytes, memory.total_bytes, ranks)
        if tiers.device_bytes == "auto" and not on_cuda:
            # a CPU "device" is the host's RAM: both tiers share the host half (module doc)
            device_bytes = min(device_bytes, host_bytes // 2)
            host_bytes -= device_bytes
    if auto:
        log.info("infinity: tier budgets per rank: device %d bytes (%s), host %d bytes (%s); %d local rank(s), %s",
                 device_bytes, format_size(device_bytes), host_bytes, format_size(host_bytes), ranks,
                 memory.grant.describe() if memory.grant is not None else "no memory grant (the machine's RAM)")
    return {Tier.DEVICE: int(device_bytes), Tier.HOST: int(host_bytes)}


@dataclass(eq=False)
class Room:
    """Bytes of one tier held for one party through a phase (:meth:`TensorStore.open_room
    <infinity.store.tensor_store.TensorStore.open_room>`). The copies and scratch buffers the party asks
    for ``within`` it are charged to it, up to ``size_bytes``. ``backed_bytes``: bytes set aside for it
    and not yet used, which nobody else's request can take; it starts with what the tier has free and
    grows, as the party needs it, over copies nobody holds (evicted from the shared pool) and over copies
    the party pins (they move in). It holds what its party holds, and ``floor_bytes`` at least (used and
    backed together, set aside when it opens): a copy whose last pin goes becomes the shared pool's where
    the room keeps its floor without it (else it stays, idle, the room's to drop), and the bytes of its
    copies that are dropped stay set aside for it up to the floor, the rest return to the tier. Making
    room inside it drops only its own idle copies. Closed, its set-aside bytes return to the tier and its
    copies become ordinary ones."""

    name: str
    tier: Tier
    size_bytes: int
    floor_bytes: int = 0      # what it keeps set aside as its copies go: the bytes its party needs at least
    used_bytes: int = 0
    backed_bytes: int = 0
    open: bool = True


def pool_of(room) -> "Room | None":
    """The room a copy or request is charged to while that room is open; None: the tier's shared pool."""
    return room if room is not None and room.open else None


@dataclass
class TierAccount:
    """Bytes reserved in one tier. ``budget_bytes`` None = unbounded (NVMe). ``peak_bytes``: the most
    ever reserved; ``window_peak_bytes``: the most since the last :meth:`take_window_peak` (one step).
    ``set_aside_bytes``: the open rooms' backed bytes, which the shared pool cannot take."""

    tier: Tier
    budget_bytes: int | None
    in_use_bytes: int = 0
    peak_bytes: int = 0
    window_peak_bytes: int = 0
    set_aside_bytes: int = 0

    def free_bytes(self) -> int | float:
        """Free bytes of the shared pool."""
        return float("inf") if self.budget_bytes is None else \
            self.budget_bytes - self.in_use_bytes - self.set_aside_bytes

    def reserve(self, nbytes: int, room: Room | None = None) -> None:
        """Charge ``nbytes`` to the shared pool, or to ``room`` out of its backed bytes."""
        if nbytes > (room.backed_bytes if room is not None else self.free_bytes()):
            # The store makes room before reserving; getting here means its bookkeeping is wrong.
            where = f"room {room.name!r}" if room is not None else "tier"
            raise AssertionError(f"{self.tier.value} {where} over budget: {self.in_use_bytes} + {nbytes} "
                                 f"> {self.budget_bytes} - {self.set_aside_bytes} set aside")
        if room is not None:
            room.backed_bytes -= nbytes
            room.used_bytes += nbytes
            self.set_aside_bytes -= nbytes
        self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        self.window_peak_bytes = max(self.window_peak_bytes, self.in_use_bytes)

    def take_window_peak(self) -> int:
        """The window's peak; the next window starts from what is reserved now."""
        peak, self.window_peak_bytes = max(self.window_peak_bytes, self.in_use_bytes), self.in_use_bytes
        return peak

    def unreserve(self, nbytes: int, room: Room | None = None) -> None:
        """``room``: the room the bytes were charged to; while it is open they stay set aside for it up to its
        floor."""
        assert 0 <= nbytes <= self.in_use_bytes, (self.tier, nbytes, self.in_use_bytes)
        self.in_use_bytes -= nbytes
        if room is not None:
            room.used_bytes -= nbytes
            if room.open:
                keep = max(0, min(nbytes, room.floor_bytes - room.used_bytes - room.backed_bytes))
                room.backed_bytes += keep
                self.set_aside_bytes += keep

    def join_room(self, nbytes: int, room: Room) -> None:
        """A shared copy of ``nbytes`` becomes ``room``'s own."""
        room.used_bytes += nbytes

    def leave_room(self, nbytes: int, room: Room) -> None:
        """A copy of ``nbytes`` charged to ``room`` becomes the shared pool's (its party let it go)."""
        room.used_bytes -= nbytes

    def back(self, room: Room, nbytes: int) -> None:
        """Set ``nbytes`` of the shared pool's free bytes aside for ``room``."""
        assert 0 <= nbytes <= self.free_bytes(), (self.tier, nbytes, self.free_bytes())
        room.backed_bytes += nbytes
        self.set_aside_bytes += nbytes

    def give_back(self, room: Room) -> None:
        """Close ``room``: its backed bytes return to the shared pool; what is charged to it stays in use."""
        room.open = False
        self.set_aside_bytes -= room.backed_bytes
        room.backed_bytes = 0


def plan_room(accounts: dict[Tier, TierAccount], policy: EvictionPolicy, records: dict[str, KeyRecord],
              needs: dict[Tier, int], key: str, room: Room | None = None, backing: bool = True):
    """The copies to drop so every tier in ``needs`` can take that many bytes: ``(victims, backs)``, or
    None when some tier is short but an operation in flight holds bytes there (its end frees or unlocks
    them: wait and ask again). Raises :class:`BudgetError` (``.room``: the pool that is short) when a tier
    is short and nothing will change that.

    In the shared pool, its free bytes, else its idle clean copies (the policy picks). In ``room`` (for its
    tier): see :func:`_plan_in_room`; ``backs`` is ``{room: bytes}``, the backed bytes the room must have
    once the victims are dropped (what it lacks is set aside from the shared pool); ``backing`` False takes
    nothing from the shared pool (a copy moving into the room brings its own bytes). All or nothing: no
    victims unless every tier can be satisfied, so a request that must wait does not throw cached copies
    away first.
    """
    victims, short, backs = [], [], {}
    for tier, nbytes in needs.items():
        acct = accounts[tier]
        pool = room if room is not None and room.tier is tier else None
        if nbytes > (pool.size_bytes if pool is not None else acct.budget_bytes):
            rounded = " (host buffers are whole 4096-byte blocks)" if tier is Tier.HOST else ""
            whole = f"room {pool.name!r} ({pool.size_bytes} bytes)" if pool is not None else "the whole tier"
            raise BudgetError(tier, acct.budget_bytes, acct.in_use_bytes, nbytes,
                              f"key {key!r} alone is bigger than {whole}{rounded}")
        if pool is not None:
            planned = _plan_in_room(records, policy, acct, pool, nbytes, key, backing)
            if planned == "wait":
                return None
            if planned is None:
                short.append((tier, nbytes, pool))
            elif planned == "shared":
                short.append((tier, nbytes, None))
            else:
                victims += planned[0]
                if planned[1]:
                    backs[pool] = planned[1]
            continue
        lack = nbytes - acct.free_bytes()
        if lack > 0:
            chosen = _choose(policy, idle_candidates(records, tier, key, None), lack)
            if chosen is None:
                short.append((tier, nbytes, None))
                continue
            victims += chosen
    for tier, nbytes, pool in short:
        if _in_motion(records, tier, pool):
            return None
        acct = accounts[tier]
        if pool is not None:
            raise BudgetError(tier, acct.budget_bytes, acct.in_use_bytes, nbytes,
                              f"for key {key!r} room {pool.name!r} holds {pool.used_bytes} of its {pool.size_bytes} "
                              f"bytes and nothing of its own can be evicted: {_holders(records, tier, pool)}",
                              room=pool)
        raise BudgetError(tier, acct.budget_bytes, acct.in_use_bytes, nbytes,
                          f"for key {key!r} nothing can be evicted: {_holders(records, tier, None)}"
                          + (f"; {acct.set_aside_bytes} bytes are set aside for open rooms" if acct.set_aside_bytes
                             else ""))
    return victims, backs


def _plan_in_room(records, policy: EvictionPolicy, acct: TierAccount, room: Room, nbytes: int, key: str,
                  backing: bool):
    """:func:`plan_room` for ``nbytes`` in ``room``: ``(victims, bytes the room must have set aside once they
    are dropped)``; None when its own copies cannot make way within its size (wait for its own in flight,
    else refused); "wait" when what it lacks waits for copies in use or in flight; "shared" when the
    shared pool cannot give what it lacks. What it lacks beyond its backed bytes comes from, in turn:
    what its size forces out of its own idle copies; the shared pool's free bytes; the least recently
    used idle copies, its own and the shared pool's alike; its own copies in use and the copies in flight
    (waited for: its party gives them back without waiting for anybody)."""
    own = idle_candidates(records, room.tier, key, room)
    forced = max(0, room.used_bytes + nbytes - room.size_bytes)   # within its size
    victims = _choose(policy, own, forced) if forced else []
    if victims is None:
        return None
    rest = max(0, nbytes - room.backed_bytes - forced - max(0, acct.free_bytes())) if backing else 0
    if rest:   # the least recently used idle copies, its own or the shared pool's, as the shared pool would
        others = [c for c in own if c not in victims] + idle_candidates(records, room.tier, key, None)
        chosen = _choose(policy, others, rest)
        if chosen is None:   # the shared pool is held: wait for the room's own copies in use to go
            held_by_party = room.used_bytes > sum(c.nbytes for c in own)
            return "wait" if held_by_party or _in_motion(records, room.tier, room) or \
                _in_motion(records, room.tier, None) else "shared"
        victims += chosen
    return victims, nbytes if backing else 0


def _choose(policy: EvictionPolicy, candidates: list, nbytes: int) -> list | None:
    """The candidates the policy drops to free ``nbytes``; None when all of them free less."""
    if sum(c.nbytes for c in candidates) < nbytes:
        return None
    chosen = policy.choose(candidates, nbytes)
    if sum(c.nbytes for c in chosen) < nbytes or not set(chosen) <= set(candidates):
        raise StoreError(f"eviction policy {type(policy).__name__} returned copies that do not free "
                         f"{nbytes} bytes")
    return chosen


def plan_spill(records: dict[str, KeyRecord], tier: Tier, nbytes: int, room: Room | None = None) -> list[str]:
    """The keys whose ``tier`` copy to write home so that at least ``nbytes`` more can be evicted from
    ``room`` (None: the shared pool): idle copies holding the only newest contents (what
    :func:`plan_room` cannot drop) whose write needs no room, most recently used first (in a step that
    walks its shards in order, the copy touched last is the one needed last)."""
    dirty = sorted((rec for rec in idle_copies(records, tier, pool=room) if rec.sole_newest(tier)
                    and _writes_without_room(rec, tier)),
                   key=lambda rec: rec.copies[tier].last_use_tick, reverse=True)
    chosen, total = [], 0
    for rec in dirty:
        if total >= nbytes:
            break
        chosen.append(rec.key)
        total += rec.copies[tier].reserved_bytes
    return chosen


def _writes_without_room(rec: KeyRecord, tier: Tier) -> bool:
    """Whether writing the ``tier`` copy home needs no new copy on the way (every tier between has one)."""
    return all(rec.copies[t].state is not Residency.ABSENT for t in Tier if tier.rank < t.rank < rec.home.rank)


def idle_copies(records: dict[str, KeyRecord], tier: Tier, exclude_key: str | None = None,
                pool: Room | None = None) -> list[KeyRecord]:
    """Records, in key order, with a resident working copy in ``tier`` charged to ``pool`` that no operation
    moves and no one pins. Called for every operation short of room, under the store's lock, over every key
    (thousands at 2.7B): the cheapest test first, and only the few idle copies sorted."""
    idle = [(key, rec) for key, rec in records.items()
            if rec.copies[tier].state is Residency.RESIDENT and rec.op is None and tier is not rec.home
            and key != exclude_key and not rec.copies[tier].pins and pool_of(rec.copies[tier].room) is pool]
    idle.sort(key=lambda item: item[0])
    return [rec for _, rec in idle]


def idle_candidates(records: dict[str, KeyRecord], tier: Tier, exclude_key: str,
                    pool: Room | None = None) -> list[Candidate]:
    """Copies in ``tier`` charged to ``pool`` that can be dropped with no I/O (see eviction.py), in key order."""
    out = []
    for rec in idle_copies(records, tier, exclude_key, pool):
        if not rec.sole_newest(tier):   # stale, or another tier holds the newest bytes too
            c = rec.copies[tier]
            out.append(Candidate(rec.key, tier, c.reserved_bytes, c.last_use_tick, c.version != rec.latest))
    return out


def _in_motion(records: dict[str, KeyRecord], tier: Tier, pool: Room | None = None) -> bool:
    """Whether an operation in flight holds bytes in ``tier`` charged to ``pool`` (its end may free or unlock them)."""
    return any(rec.op is not None and rec.op.kind != "release" and rec.copies[tier].state is not Residency.ABSENT
               and pool_of(rec.copies[tier].room) is pool for rec in records.values())


def _holders(records: dict[str, KeyRecord], tier: Tier, pool: Room | None) -> str:
    """Where a full tier's (or room's) bytes are, for the error message."""
    kinds: collections.Counter = collections.Counter()
    for rec in records.values():
        c = rec.copies[tier]
        if c.state is Residency.ABSENT or pool_of(c.room) is not pool:
            continue
        kind = ("home copies" if tier is rec.home else "pinned" if c.pins else
                "in motion" if rec.op is not None else "holding the only newest data (write back first)")
        kinds[kind] += c.reserved_bytes
    return ", ".join(f"{n} bytes {k}" for k, n in sorted(kinds.items())) or "the tier is empty"
