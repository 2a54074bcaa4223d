"""The learning-rate schedule of the ``schedule:`` config section, as a ``torch.optim.lr_scheduler.LambdaLR``.

For optimizer step ``s`` (0-based; the scheduler's ``last_epoch``) and a
group whose starting lr is ``base``::

    s < warmup_steps:   base * (s + 1) / warmup_steps                  (the first step already moves)
    afterwards:         p = (s - warmup_steps) / (total_steps - warmup_steps), clamped to [0, 1]
        constant        base
        linear          base + (min_lr - base) * p
        cosine          min_lr + (base - min_lr) * (1 + cos(pi * p)) / 2

``min_lr`` is absolute (each group decays to it, or holds its own lr if that
is lower). The values equal ``torch.optim.lr_scheduler``'s ``LinearLR``
warmup followed by ``LinearLR`` / ``CosineAnnealingLR`` decay (tested against
them). Library use::

    model, optimizer = infinity.initialize(model, config)
    scheduler = build_lr_scheduler(optimizer, config.schedule, total_steps=1000)
    for batch in loader:
        ...backward...
        if config.schedule.clip_grad_norm is not None:
            optimizer.clip_grad_norm_(config.schedule.clip_grad_norm)
        optimizer.step(); optimizer.zero_grad(); scheduler.step()

The scheduler's ``state_dict()`` is JSON-serializable (the lambdas are not
saved; they are rebuilt from the config), so it fits ``client_state`` of
:func:`infinity.save_checkpoint`.
"""

from __future__ import annotations

import functools
import math

import torch

from infinity.config import ScheduleConfig

__all__ = ["build_lr_scheduler", "lr_factor", "resolve_total_steps"]


def resolve_total_steps(schedule: ScheduleConfig, total_steps: int | None) -> int:
    """``schedule.total_steps``, or ``total_steps`` where the config says ``auto``; checked against warmup."""
    total = schedule.total_steps if schedule.total_steps != "auto" else total_steps
    if schedule.lr_schedule != "constant" or schedule.warmup_steps:
        if total is None:
            raise ValueError("build_lr_scheduler: schedule.total_steps is 'auto'; pass total_steps (the run's "
                             "optimizer steps)")
        if schedule.lr_schedule != "constant" and total <= schedule.warmup_steps:
            raise ValueError(f"schedule: total_steps {total} must exceed warmup_steps {schedule.warmup_steps} "
                             f"for a {schedule.lr_schedule} decay")
    return int(total) if total is not None else 0


def lr_factor(step: int, base_lr: float, schedule: ScheduleConfig, total_steps: int) -> float:
    """The multiplier of ``base_lr`` at optimizer step ``step`` (see the module doc for the formulas)."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if schedule.lr_schedule == "constant" or base_lr <= 0.0:
        return 1.0
    floor = min(schedule.min_lr / base_lr, 1.0)
    p = min(max((step - warmup) / (total_steps - warmup), 0.0), 1.0)
    if schedule.lr_schedule == "linear":
        return 1.0 + (floor - 1.0) * p
    return floor + (1.0 - floor) * (1.0 + math.cos(math.pi * p)) / 2.0


def build_lr_scheduler(optimizer: torch.optim.Optimizer, schedule: ScheduleConfig,
                       total_steps: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over every param group of ``optimizer`` following ``schedule``.

    ``total_steps`` stands in for ``schedule.total_steps: auto``. Call
    ``scheduler.step()`` once after each ``optimizer.step()``. Building it sets
    each group's lr to its step-0 value (``initial_lr`` keeps the base).
    """
    if not isinstance(schedule, ScheduleConfig):
        raise TypeError(f"build_lr_scheduler: expected an infinity.config.ScheduleConfig (config.schedule), "
                        f"got {type(schedule).__name__}")
    total = resolve_total_steps(schedule, total_steps)
    lambdas = [functools.partial(lr_factor, base_lr=g.get("initial_lr", g["lr"]), schedule=schedule,
                                 total_steps=total) for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)

