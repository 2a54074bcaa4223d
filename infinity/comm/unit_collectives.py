"""The engine's two collectives per unit, as one small interface with pluggable implementations.

A ZeRO step moves a unit's bytes in two ways: the parameter all-gather (stage 3,
before its forward and its backward) and the gradient reduce-scatter (stages
1-3). :class:`UnitCollectives` is the plain version over
:class:`~infinity.comm.collectives.Collectives`;
:class:`~infinity.comm.zeropp.ZeroPlusPlus` is the other, with the same
methods and signatures, that quantizes them or keeps them inside the node. The
engine picks one at ``initialize`` and passes it to its gathers and gradient
path, which never ask which one they have.

The hpZ verbs (:meth:`has_secondary`, :meth:`keep_secondary`,
:meth:`drop_secondaries`) are part of the interface so the gathers call them
unconditionally: here they keep nothing.
"""

from __future__ import annotations

import contextlib

import torch

from infinity.comm.collectives import LocalCollectives

__all__ = ["UnitCollectives"]


class UnitCollectives:
    """Plain per-unit collectives (``unit``: anything with ``index``, ``name``, ``padded_numel``,
    ``full_param``, as :class:`~infinity.zero.units.FlatUnit`)."""

    def __init__(self, coll):
        self.coll = coll

    def all_gather(self, unit, full: torch.Tensor, src: torch.Tensor):
        """Launch ``unit``'s all-gather of ``src`` (this rank's shard) into ``full``; a Pending."""
        # the collective writes the buffer behind autograd's back; without this the version bump
        # would make saved parameters look modified in-place to backward
        with torch.autograd._unsafe_preserve_version_counter(full):
            return self.coll.all_gather(full, src, async_op=True, label=f"unit {unit.name!r}")

    def reduce_scatter(self, unit, out: torch.Tensor, full: torch.Tensor, then):
        """Launch ``out`` <- this rank's shard of the mean over ranks of ``full``; ``then`` runs when it is
        waited on. A Pending."""
        return self.coll.reduce_scatter(out, full, average=True, async_op=True, then=then,
                                        label=f"gradient of unit {unit.name!r}")

    @property
    def reduces_in_place(self) -> bool:
        """One rank and nothing quantized: the mean is the full gradient itself, so the reduction needs
        no second unit-sized output buffer."""
        return isinstance(self.coll, LocalCollectives)

    @property
    def gathers_in_place(self) -> bool:
        """One rank and nothing quantized: the full parameter buffer is this rank's shard, so a stored
        shard can be written straight into it (the all-gather then moves nothing)."""
        return isinstance(self.coll, LocalCollectives)

    # ------------------------------------------------------------ hpZ's verbs (nothing kept here)

    def has_secondary(self, unit_index: int) -> bool:
        """Whether the unit's next gather reads a node-local secondary shard instead of the stored one."""
        return False

    def keep_secondary(self, unit) -> None:
        """``unit``'s forward is done and it is about to be released (hpZ keeps a slice for backward)."""

    def drop_secondaries(self) -> None:
        """The backward is over (or abandoned): what was kept for it is stale."""

    @contextlib.contextmanager
    def exact_gathers(self):
        """Gathers started inside move exact values (``engine.gathered()``); plain gathers always do."""
        yield

    def resident_bytes(self) -> dict:
        """Bytes these collectives hold between uses, by name (hpZ's secondary shards); none here."""
        return {}
