"""Where a stored tensor's copies are, and which moves between states are legal.

A key has at most one copy per :class:`Tier`. Its *home* copy always exists
(from ``register`` until ``release``); copies in faster tiers are working
copies. Each copy is in one :class:`Residency` state, and every change of state
goes through :func:`check_transition`, so a move the design does not allow (say,
dropping a copy that is being read by a transfer) fails loudly instead of
corrupting data.

Contents are tracked by version, not by a dirty bit: each key has a ``latest``
version number and each copy records the version it holds. A copy is *current*
when it holds ``latest``; the key is *dirty* when its home copy is not current.
That one number answers "may this copy be dropped?" (yes, unless it is the only
current copy and home is stale) and "may it be handed out?" (only if current
and at rest), even while transfers and ``mark_dirty`` race.
"""

from __future__ import annotations

import enum

from infinity.transitions import Transitions

__all__ = ["Tier", "Residency", "StoreError", "IllegalTransition", "check_transition"]


class StoreError(RuntimeError):
    """A store operation cannot be done as asked (unknown key, wrong tier, pinned copy...)."""


class IllegalTransition(StoreError):
    """A copy was asked to move between two states the residency machine does not connect."""

    def __init__(self, key: str, tier: "Tier", old: "Residency", new: "Residency", op: str):
        super().__init__(
            f"store key {key!r}: {op} cannot move the {tier.value} copy from {old.name} to {new.name}")
        self.key, self.tier, self.old, self.new, self.op = key, tier, old, new, op


class Tier(enum.Enum):
    """Storage tiers, fastest first. Declaration order is the speed order (see :attr:`rank`)."""

    DEVICE = "device"  # compute-device memory (CUDA), or plain memory with its own budget on CPU
    HOST = "host"      # host memory from the host buffer pool (pinned when CUDA is present)
    NVME = "nvme"      # an extent in this rank's swap file; only ever a home, never a working copy

    @property
    def rank(self) -> int:
        """0 for the fastest tier; a copy moving between tiers passes every tier in between."""
        return _TIER_RANK[self]

    @classmethod
    def parse(cls, value: "Tier | str") -> "Tier":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise StoreError(f"unknown tier {value!r}; valid tiers: {[t.value for t in cls]}") from None


_TIER_RANK = {t: i for i, t in enumerate(Tier)}


class Residency(enum.Enum):
    """The state of one copy of one key in one tier."""

    ABSENT = "absent"      # no bytes held in this tier (none reserved against its budget)
    FILLING = "filling"    # bytes reserved; contents arriving from another tier; never handed out
    RESIDENT = "resident"  # bytes held and at rest; handed out by get() only if the copy is current
    DRAINING = "draining"  # contents being read by a transfer to another tier; not handed out,
                           # because a caller writing to it now would tear the copy being made


# from-state -> states it may move to. Anything else is a bug or a misuse.
_MOVES = Transitions("residency", {
    Residency.ABSENT: {Residency.FILLING,     # a bring/write-back reserves bytes for a new copy
                       Residency.RESIDENT},   # register fills a host/device home synchronously
    Residency.FILLING: {Residency.RESIDENT,   # the transfer landed (or failed on a home copy,
                                              # which is kept and marked not current)
                        Residency.ABSENT},    # the transfer failed: the new copy is dropped
    Residency.RESIDENT: {Residency.FILLING,   # a stale copy is refreshed in place
                         Residency.DRAINING,  # this copy is the source of a transfer
                         Residency.ABSENT},   # evicted or released
    Residency.DRAINING: {Residency.RESIDENT},  # the transfer finished (either way); the source is unchanged
})


def check_transition(key: str, tier: Tier, old: Residency, new: Residency, op: str) -> None:
    """Raise :class:`IllegalTransition` unless ``old -> new`` is an edge of the machine."""
    if not _MOVES.allows(old, new):
        raise IllegalTransition(key, tier, old, new, op)
