"""Who holds a pin on a stored copy: the zero layer's typed owner tokens.

The store takes any hashable token as a pin's owner (:meth:`TensorStore.pin
<infinity.store.tensor_store.TensorStore.pin>`) and lets any thread drop a pin
by naming it. The parts of a step that pin copies across calls name themselves
with a :class:`PinOwner`: a unit's all-gather (its shard's device copy, until
the gather has read it), a gradient fold (the brought sum of one chunk, until
the fold lands), and a saved activation (its host copy, while autograd holds a
view of it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["PinKind", "PinOwner"]


class PinKind(enum.Enum):
    GATHER = "gather"            # a unit's all-gather reads its shard's copy
    FOLD = "fold"                # a gradient fold's brought sum (one chunk)
    ACTIVATION = "activation"    # a saved activation's host copy that autograd views (CPU device)


@dataclass(frozen=True)
class PinOwner:
    """One pin owner: its kind, the unit (or the activation's sequence number) and the chunk."""

    kind: PinKind
    index: int
    chunk: int = 0

    @classmethod
    def gather(cls, unit_index: int) -> "PinOwner":
        return cls(PinKind.GATHER, unit_index)

    @classmethod
    def fold(cls, unit_index: int, chunk: int) -> "PinOwner":
        return cls(PinKind.FOLD, unit_index, chunk)

    @classmethod
    def activation(cls, seq: int) -> "PinOwner":
        return cls(PinKind.ACTIVATION, seq)
