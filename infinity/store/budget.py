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

__all__ = ["BudgetError", "TierAccount", "DeviceHeadroom", "resolve_budgets", "auto_host_bytes",
           "auto_device_bytes", "local_ranks", "plan_room", "plan_spill"]

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

    def __init__(self, tier: Tier, budget_bytes: int, in_use_bytes: int, requested_bytes: int, why: str):
        super().__init__(
            f"{tier.value} tier: cannot fit {requested_bytes} bytes ({format_size(requested_bytes)}): "
            f"budget {budget_bytes} bytes ({format_size(budget_bytes)}), in use {in_use_bytes} bytes; {why}")
        self.tier, self.budget_bytes = tier, budget_bytes
        self.in_use_bytes, self.requested_bytes = in_use_bytes, requested_bytes


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


@dataclass
class TierAccount:
    """Bytes reserved in one tier. ``budget_bytes`` None = unbounded (NVMe). ``peak_bytes``: the most
    ever reserved; ``window_peak_bytes``: the most since the last :meth:`take_window_peak` (one step)."""

    tier: Tier
    budget_bytes: int | None
    in_use_bytes: int = 0
    peak_bytes: int = 0
    window_peak_bytes: int = 0

    def free_bytes(self) -> int | float:
        return float("inf") if self.budget_bytes is None else self.budget_bytes - self.in_use_bytes

    def reserve(self, nbytes: int) -> None:
        if self.budget_bytes is not None and self.in_use_bytes + nbytes > self.budget_bytes:
            # The store makes room before reserving; getting here means its bookkeeping is wrong.
            raise AssertionError(f"{self.tier.value} tier over budget: {self.in_use_bytes} + {nbytes} "
                                 f"> {self.budget_bytes}")
        self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        self.window_peak_bytes = max(self.window_peak_bytes, self.in_use_bytes)

    def take_window_peak(self) -> int:
        """The window's peak; the next window starts from what is reserved now."""
        peak, self.window_peak_bytes = max(self.window_peak_bytes, self.in_use_bytes), self.in_use_bytes
        return peak

    def unreserve(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.in_use_bytes, (self.tier, nbytes, self.in_use_bytes)
        self.in_use_bytes -= nbytes


def plan_room(accounts: dict[Tier, TierAccount], policy: EvictionPolicy, records: dict[str, KeyRecord],
              needs: dict[Tier, int], key: str) -> list[Candidate] | None:
    """The copies to drop so every tier in ``needs`` has that many free bytes.

    Returns the victims (possibly none), or None when some tier is short but an
    operation in flight holds bytes there (its end frees or unlocks them: wait and
    ask again). Raises :class:`BudgetError` when a tier is short and nothing will
    change that. All or nothing: no victims unless every tier can be satisfied, so a
    request that must wait does not throw cached copies away first.
    """
    victims, short_tiers = [], []
    for tier, nbytes in needs.items():
        acct = accounts[tier]
        if nbytes > acct.budget_bytes:
            rounded = " (host buffers are whole 4096-byte blocks)" if tier is Tier.HOST else ""
            raise BudgetError(tier, acct.budget_bytes, acct.in_use_bytes, nbytes,
                              f"key {key!r} alone is bigger than the whole tier{rounded}")
        short_bytes = nbytes - acct.free_bytes()
        if short_bytes <= 0:
            continue
        candidates = _candidates(records, tier, key)
        if sum(c.nbytes for c in candidates) < short_bytes:
            short_tiers.append((tier, nbytes))
            continue
        chosen = policy.choose(candidates, short_bytes)
        if sum(c.nbytes for c in chosen) < short_bytes or not set(chosen) <= set(candidates):
            raise StoreError(f"eviction policy {type(policy).__name__} returned copies that do not free "
                             f"{short_bytes} bytes from the {tier.value} tier")
        victims += chosen
    for tier, nbytes in short_tiers:
        if _in_motion(records, tier):
            return None
        acct = accounts[tier]
        raise BudgetError(tier, acct.budget_bytes, acct.in_use_bytes, nbytes,
                          f"for key {key!r} nothing can be evicted: {_holders(records, tier)}")
    return victims


def plan_spill(records: dict[str, KeyRecord], tier: Tier, nbytes: int) -> list[str]:
    """The keys whose ``tier`` copy to write home so that at least ``nbytes`` more can be evicted: idle
    copies holding the only newest contents (what :func:`plan_room` cannot drop), most recently used
    first (in a step that walks its shards in order, the copy touched last is the one needed last)."""
    dirty = sorted((rec for rec in _idle(records, tier) if rec.sole_newest(tier)),
                   key=lambda rec: rec.copies[tier].last_use_tick, reverse=True)
    chosen, total = [], 0
    for rec in dirty:
        if total >= nbytes:
            break
        chosen.append(rec.key)
        total += rec.copies[tier].reserved_bytes
    return chosen


def _idle(records: dict[str, KeyRecord], tier: Tier, exclude_key: str | None = None) -> list[KeyRecord]:
    """Records, in key order, with a resident working copy in ``tier`` that no operation moves and no one pins.
    Called for every operation short of room, under the store's lock, over every key (thousands at 2.7B): the
    cheapest test first, and only the few idle copies sorted."""
    idle = [(key, rec) for key, rec in records.items()
            if rec.copies[tier].state is Residency.RESIDENT and rec.op is None and tier is not rec.home
            and key != exclude_key and not rec.copies[tier].pins]
    idle.sort(key=lambda item: item[0])
    return [rec for _, rec in idle]


def _candidates(records: dict[str, KeyRecord], tier: Tier, exclude_key: str) -> list[Candidate]:
    """Copies in ``tier`` that can be dropped with no I/O (see eviction.py), in key order."""
    out = []
    for rec in _idle(records, tier, exclude_key):
        if not rec.sole_newest(tier):   # stale, or another tier holds the newest bytes too
            c = rec.copies[tier]
            out.append(Candidate(rec.key, tier, c.reserved_bytes, c.last_use_tick, c.version != rec.latest))
    return out


def _in_motion(records: dict[str, KeyRecord], tier: Tier) -> bool:
    """Whether an operation in flight holds bytes in ``tier`` (its end may free or unlock them)."""
    return any(rec.op is not None and rec.op.kind != "release" and rec.copies[tier].state is not Residency.ABSENT
               for rec in records.values())


def _holders(records: dict[str, KeyRecord], tier: Tier) -> str:
    """Where a full tier's bytes are, for the error message."""
    kinds: collections.Counter = collections.Counter()
    for rec in records.values():
        c = rec.copies[tier]
        if c.state is Residency.ABSENT:
            continue
        kind = ("home copies" if tier is rec.home else "pinned" if c.pins else
                "in motion" if rec.op is not None else "holding the only newest data (write back first)")
        kinds[kind] += c.reserved_bytes
    return ", ".join(f"{n} bytes {k}" for k, n in sorted(kinds.items())) or "the tier is empty"
