"""Checked state machines: every lifecycle in the project is an enum plus one :class:`Transitions` table.

A table lists, for each state, the states it may move to; anything else is a
bug or a misuse, and :meth:`Transitions.check` says so in words (which machine,
which object, from and to, and what was allowed). The residency of a stored
copy, an extent of a swap file, a unit's gather state and use, the engine's
step, the overlapped update and the prefetch trace all check their moves here,
so a change in how transitions are checked is made once.

This module is the lowest layer: it imports nothing of the project.
"""

from __future__ import annotations

import enum
from typing import Iterable, Mapping

__all__ = ["Transitions", "TransitionError"]


class TransitionError(RuntimeError):
    """A state machine was asked to make a move its table does not allow."""


class Transitions:
    """The allowed moves of one enum-valued state machine.

    ``edges[state]`` is every state ``state`` may move to; every member of the
    enum must appear as a key (a state with no way out is listed with an empty set).
    """

    def __init__(self, name: str, edges: Mapping[enum.Enum, Iterable[enum.Enum]]):
        self.name = name
        self.edges = {state: frozenset(to) for state, to in edges.items()}
        members = set(type(next(iter(self.edges))))
        missing = members - set(self.edges)
        if missing:
            raise ValueError(f"{name}: no edges listed for {sorted(m.value for m in missing)}")

    def allows(self, old: enum.Enum, new: enum.Enum) -> bool:
        return new in self.edges[old]

    def check(self, old: enum.Enum, new: enum.Enum, who: str = "", error: type = TransitionError,
              what: str = "transition") -> enum.Enum:
        """Return ``new`` if ``old -> new`` is allowed; else raise ``error`` naming the machine, ``who`` and
        ``what`` moved (e.g. "use transition")."""
        if new not in self.edges[old]:
            allowed = ", ".join(sorted(s.value for s in self.edges[old])) or "none"
            raise error(f"{who or self.name}: illegal {what} {old.value} -> {new.value} "
                        f"({self.name}: from {old.value} only {allowed})")
        return new
