"""Which copies to drop when a tier is full: a small pluggable policy.

The store hands the policy only copies that are safe to drop without I/O:
resident, unpinned, not a home copy, of a key with no operation in flight, and
either stale or not the only current copy. The policy never sees dirty data, so
no choice it makes can lose an update; it only decides *which* safe copies go.

Policies are stateless functions of the candidates: recency comes in as
``last_use_tick``, a counter the store bumps on each use, not a clock, so the
same sequence of operations always evicts the same copies.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from infinity.store.residency import Tier

__all__ = ["Candidate", "EvictionPolicy", "LRUPolicy"]


@dataclass(frozen=True)
class Candidate:
    """A copy the store could drop right now."""

    key: str
    tier: Tier
    nbytes: int          # bytes its removal frees against the tier budget
    last_use_tick: int   # store-wide use counter at its last bring/get/pin; lower = older
    stale: bool          # holds an old version: worthless, the cheapest thing to drop


class EvictionPolicy(abc.ABC):
    """Chooses copies to drop so that at least ``needed_bytes`` are freed."""

    @abc.abstractmethod
    def choose(self, candidates: list[Candidate], needed_bytes: int) -> list[Candidate]:
        """Return a subset of ``candidates`` whose ``nbytes`` sum to >= ``needed_bytes``.

        Called only when ``sum(c.nbytes for c in candidates) >= needed_bytes``,
        with candidates in a deterministic order (by key); must be deterministic.
        """


class LRUPolicy(EvictionPolicy):
    """Stale copies first, then least recently used; ties broken by key.

    Good when the access pattern repeats (a training step walks units in the
    same order each time), though for a strictly cyclic walk larger than the
    tier LRU evicts exactly the copy needed next; a trace-aware policy can
    replace it without touching the store.

    The stage-3 device cache of parameter shards is not such a walk: a step
    gathers units forward (1..N), then backward (N..1), then forward again, a
    palindrome. There the least recently used copy is always the one whose next
    use is farthest away (forward evicts the earliest units, which backward
    reaches last; backward evicts the latest, which the next forward reaches
    last), so LRU makes the choice a next-use-distance (Belady) policy would,
    without a trace and without the store asking anyone above it.
    """

    def choose(self, candidates: list[Candidate], needed_bytes: int) -> list[Candidate]:
        chosen, freed_bytes = [], 0
        for c in sorted(candidates, key=lambda c: (not c.stale, c.last_use_tick, c.key)):
            if freed_bytes >= needed_bytes:
                break
            chosen.append(c)
            freed_bytes += c.nbytes
        return chosen
