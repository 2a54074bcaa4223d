"""``optimizer.update_at`` -> the :class:`~infinity.zero.update.UpdateSchedule` that runs it, decided once.

The engine builds one schedule from the resolved value (:meth:`Config.update_schedule`) and only sends it
events; nothing else compares the value (see :mod:`infinity.zero.update` for the events).
"""

from __future__ import annotations

from infinity.zero.speculation import SpeculativeUpdate
from infinity.zero.update import UpdateAtStep, UpdateSchedule
from infinity.zero.update_backward import UpdateInBackward
from infinity.zero.update_next_forward import UpdateAtNextForward

__all__ = ["SCHEDULES", "make_schedule"]

SCHEDULES = {cls.name: cls for cls in (UpdateAtStep, UpdateInBackward, UpdateAtNextForward, SpeculativeUpdate)}


def make_schedule(update_at: str, *args, **kwargs) -> UpdateSchedule:
    """The schedule for a resolved ``update_at`` (``step``, ``backward``, ``next_forward``, ``speculative``),
    built with :class:`UpdateSchedule`'s arguments."""
    if update_at not in SCHEDULES:
        raise ValueError(f"optimizer.update_at: no schedule {update_at!r}; resolve auto first "
                         f"(Config.update_schedule); schedules: {', '.join(SCHEDULES)}")
    return SCHEDULES[update_at](*args, **kwargs)
