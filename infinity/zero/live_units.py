"""The cap on gathered stage-3 parameters (``prefetch.max_live_bytes``): who is live, who may go.

At stage 3 a unit's full (gathered) parameters are *live* from the moment its
all-gather is launched (GATHERING) until it is released (SHARDED). The sum of
their bytes is what ``prefetch.max_live_bytes`` caps, for every gather the
step makes: the one-ahead prefetch gather and the on-demand gather of a unit
needed now. :class:`LiveUnits` keeps that sum, its high-water mark per step,
and the order in which units became releasable; each unit's own
:class:`~infinity.zero.units.UnitUse` (on the unit, its one runtime object) says
whether the cap may release it:

- a unit *in use* (its forward or backward is running; the root unit from the
  start of forward to the end of backward) is never released;
- a unit gathered *ahead* by prefetch and not used yet, or one *kept* gathered
  for its backward after its forward (``reshard_after_forward: false``), may be
  released to make room; it is gathered again when it is needed.

A prefetch gather that does not fit is not started; an on-demand gather that
does not fit first releases ahead units (newest first: needed last), then kept
ones (oldest first: their backward comes last). If the units in use plus the
one needed now exceed the cap, the cap cannot be honoured and the gather raises
instead of exceeding it. :func:`check_cap` refuses, at initialize, a cap below
the root unit plus the largest other unit, which every step needs at once.

Trade-off: a cap of root + largest unit holds the least memory but leaves no
room to gather ahead, so every all-gather is waited on; each further unit's
worth lets the next gather overlap compute. Units gathered outside the step
(``engine.gathered()``) are not capped: that block asks for every unit.

The engine makes the same decisions on every rank (the hooks run in the same
order everywhere), which matters: a gather is a collective, and ranks that
disagreed on whether to start one would deadlock.
"""

from __future__ import annotations

from typing import Mapping

from infinity.config import ConfigError
from infinity.zero.units import UnitUse

__all__ = ["UnitUse", "LiveUnits", "check_cap", "resolve_cap"]

KEY = "prefetch.max_live_bytes"
AUTO_FLOOR_BYTES = 2**30


def resolve_cap(value, full_bytes: Mapping[str, int], root: str | None) -> int:
    """``auto``: 1 GiB, or room for the root, the unit in use and one gathered ahead if that is more
    (so the default never refuses a model whose units are large); a size is taken as given."""
    if value != "auto":
        return int(value)
    others = sorted((b for n, b in full_bytes.items() if n != root), reverse=True)
    need = (full_bytes[root] if root is not None else 0) + 2 * (others[0] if others else 0)
    return max(AUTO_FLOOR_BYTES, need)


def check_cap(max_live_bytes: int, full_bytes: Mapping[str, int], root: str | None) -> None:
    """Raise ConfigError if the cap cannot hold the root unit and the largest other unit at once.

    ``full_bytes``: unit name -> gathered bytes; ``root``: the root unit's name (None: no root unit).
    """
    others = {n: b for n, b in full_bytes.items() if n != root}
    parts = []
    if root is not None:
        parts.append((root, full_bytes[root]))
    if others:
        name = max(others, key=lambda n: others[n])   # first of the largest: deterministic
        parts.append((name, others[name]))
    need = sum(b for _, b in parts)
    if max_live_bytes < need:
        what = " and ".join(f"unit {n!r} ({b} bytes)" for n, b in parts)
        raise ConfigError(
            f"{KEY}: {max_live_bytes} bytes cannot hold {what} gathered at once, which every stage-3 step "
            f"needs ({need} bytes); set {KEY} to at least {need}")


class LiveUnits:
    """Live (gathered) bytes over the units, their per-step peak, and the releasable units in the order
    the cap frees them. A unit's use is its own (``unit.use``); set it through :meth:`set_use`, which
    keeps that order.

    ``full_bytes``: unit index -> its gathered bytes. The gathers report every SHARDED -> GATHERING
    (:meth:`gathering`) and GATHERED -> SHARDED (:meth:`released`) transition; units start gathered
    (as :class:`~infinity.zero.units.FlatUnit` does).
    """

    def __init__(self, units: list, full_bytes: Mapping[int, int], max_live_bytes: int):
        self.units, self.full_bytes = list(units), dict(full_bytes)
        self.max_live_bytes = max_live_bytes
        self._live: set = {u.index for u in units}
        self.live_bytes = sum(self.full_bytes[u.index] for u in units)
        self.peak_bytes = self.live_bytes
        self.cap_releases = 0            # units released to make room, this step
        self._ahead: list = []           # AHEAD units, oldest first
        self._kept: list = []            # KEPT units, oldest first

    # ------------------------------------------------------------ accounting

    def gathering(self, unit) -> None:
        if unit.index in self._live:
            raise RuntimeError(f"unit {unit.name}: gathered twice without a release")
        self._live.add(unit.index)
        self.live_bytes += self.full_bytes[unit.index]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def released(self, unit) -> None:
        if unit.index not in self._live:
            raise RuntimeError(f"unit {unit.name}: released while not gathered")
        self._live.remove(unit.index)
        self.live_bytes -= self.full_bytes[unit.index]
        self.set_use(unit, UnitUse.IDLE)

    def take_step_stats(self) -> dict:
        """This step's peak and cap releases; the next step's peak starts from what is live now."""
        out = {"live_peak_bytes": self.peak_bytes, "live_cap_releases": self.cap_releases}
        self.reset_step()
        return out

    def reset_step(self) -> None:
        self.peak_bytes, self.cap_releases = self.live_bytes, 0

    # ------------------------------------------------------------ use

    def set_use(self, unit, new: UnitUse) -> None:
        """``unit.set_use(new)`` (checked there), keeping the releasable units' order."""
        old = unit.set_use(new)
        if new is old:
            return
        for queue, state in ((self._ahead, UnitUse.AHEAD), (self._kept, UnitUse.KEPT)):
            if old is state:
                queue.remove(unit)
            if new is state:
                queue.append(unit)

    # ------------------------------------------------------------ the cap

    def fits(self, unit) -> bool:
        """Would gathering ``unit`` now keep live bytes within the cap?"""
        return self.live_bytes + self.full_bytes[unit.index] <= self.max_live_bytes

    def victims_for(self, unit, rank: int) -> list:
        """Releasable units to free, in order, so ``unit`` (needed now) fits; raises if none suffice."""
        size = self.full_bytes
        over = self.live_bytes + size[unit.index] - self.max_live_bytes
        out = []
        # ahead, newest first (the furthest along the trace); then kept, oldest first (backward reaches them last)
        for u in [*reversed(self._ahead), *self._kept]:
            if over <= 0:
                break
            out.append(u)   # AHEAD and KEPT units are live: release() sets IDLE
            over -= size[u.index]
        if over > 0:
            held = ", ".join(f"{u.name} ({size[u.index]} bytes, {u.use.value})"
                             for u in self.units if u.index in self._live and u not in out)
            need = self.live_bytes + size[unit.index] - sum(size[u.index] for u in out)
            raise RuntimeError(
                f"{KEY} = {self.max_live_bytes} bytes cannot be honoured on rank {rank}: unit "
                f"{unit.name} ({size[unit.index]} bytes) is needed now while units that may not "
                f"be released are gathered: {held or 'none'}; together {need} bytes. Set {KEY} to at "
                f"least {need} (a unit whose forward runs inside another unit's needs both)")
        self.cap_releases += len(out)
        return out
