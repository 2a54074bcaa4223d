"""Materializing a model built on the meta device, one unit at a time (DESIGN §3, "nothing is ever whole").

A model built under ``with torch.device("meta"):`` has shapes but no storage.
The engine gives each unit's parameters real storage as views into that unit's
fp32 flat buffer, runs the initializers that write them, and moves the unit
into its shards' home tiers before the next unit gets memory — so only one
unit (plus the root unit, whose parameters interleave with the others in
module order) is ever materialized at once.

Initializers run in ``model.modules()`` order, each parameter once: a unit
module is passed to ``init_fn`` whole (``gpt_init_`` needs a whole Block to
know the residual projections), any other module holding parameters of its own
is passed alone. Without ``init_fn`` each module's ``reset_parameters()`` runs.
That is the order ``infinity.models.GPT(cfg)`` draws its random numbers in, so
``torch.manual_seed(s)`` before initialize gives the same weights as
``torch.manual_seed(s); GPT(cfg)``, at any world size (every rank draws every
unit, and rank 0's values are broadcast anyway).

Parameters keep their identity (``torch.utils.swap_tensors``), so ties and
the references in param groups stay valid.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

__all__ = ["is_meta_model", "InitStep", "init_plan", "give_storage", "run_init", "check_no_meta", "place_units",
           "move_unsharded", "materialize_steps"]


def is_meta_model(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


class InitStep:
    """One initializer call: ``module`` (whole if ``whole``) and the ids of the parameters it writes."""

    def __init__(self, module: nn.Module, whole: bool, param_ids: list):
        self.module, self.whole, self.param_ids = module, whole, param_ids


def init_plan(model: nn.Module, unit_modules: list) -> list:
    """The initializer calls in ``model.modules()`` order, each parameter in exactly one call."""
    units = {id(m) for m in unit_modules}
    steps, done, skip_under = [], set(), []
    for name, mod in model.named_modules():
        if any(name.startswith(prefix) for prefix in skip_under):
            continue
        whole = id(mod) in units
        params = list(mod.parameters()) if whole else list(mod.parameters(recurse=False))
        if whole:
            skip_under.append(name + ".")
        fresh = [p for p in params if id(p) not in done]
        if not fresh:
            continue   # e.g. a tied head whose weight the embedding already initialized
        if len(fresh) != len(params) and not whole:
            stale = next(n for n, p in mod.named_parameters(recurse=False) if id(p) in done)
            raise ValueError(f"initialize (meta model): module {name!r} ({type(mod).__name__}) holds parameter "
                             f"{stale!r} that an earlier module already initialized, beside new ones; its "
                             "initializer would overwrite it. Tie whole modules, or materialize the model first")
        done.update(id(p) for p in fresh)
        steps.append(InitStep(mod, whole, [id(p) for p in fresh]))
    return steps


def give_storage(param: nn.Parameter, storage: torch.Tensor) -> None:
    """Make a meta parameter a real one whose data is ``storage`` (same shape), keeping its identity."""
    if not param.is_meta:
        raise ValueError(f"give_storage: parameter of shape {tuple(param.shape)} is not on the meta device")
    real = nn.Parameter(torch.empty(0, dtype=storage.dtype, device=storage.device), requires_grad=param.requires_grad)
    # ``.data =`` keeps the parameter's own version counter: one shared with ``storage`` (as a view
    # would) would be bumped by the all-gathers writing the unit's buffer, and backward would then
    # see its saved parameters as modified in place
    real.data = storage.view(param.shape)
    torch.utils.swap_tensors(param, real)


def run_init(step: InitStep, init_fn: Callable | None) -> None:
    mods = [step.module] if init_fn is not None else \
        [m for m in (step.module.modules() if step.whole else [step.module])
         if any(True for _ in m.parameters(recurse=False))]
    with torch.no_grad():
        for m in mods:
            if init_fn is not None:
                init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
            else:
                raise ValueError(
                    f"initialize (meta model): {type(m).__name__} holds parameters but has no reset_parameters(); "
                    "pass init_fn=... to initialize (called on each unit module and each other module with "
                    "parameters, in model order)")


def check_no_meta(model: nn.Module) -> None:
    """Buffers cannot be recomputed from a meta model; they must be real before initialize."""
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(f"initialize (meta model): buffer {name!r} is on the meta device; initialize "
                             "materializes parameters only. Build buffers on a real device (e.g. register them "
                             "outside the meta context) or call model.to_empty() and fill them first")


def place_units(model: nn.Module, units: list, init_fn: Callable | None, place: Callable, device) -> None:
    """Hand each unit's parameters, as one fp32 flat buffer on ``device``, to ``place(unit, flat32)``.

    A real model's values are copied unit by unit. A meta model is walked in
    initializer order (:func:`init_plan`), and each unit is placed as soon as its
    last parameter is written, so only one unit (plus the root) is ever materialized.
    """
    if not is_meta_model(model):
        if init_fn is not None:
            raise ValueError("initialize: init_fn is only used for a model built on the meta device")
        for unit in units:
            flat32 = torch.zeros(unit.padded_numel, dtype=torch.float32, device=device)
            for slot, p in zip(unit.slots, unit.params):
                flat32[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            place(unit, flat32)
        return
    check_no_meta(model)
    steps = init_plan(model, [u.module for u in units if not u.is_root])
    where = {id(p): (u, s) for u in units for s, p in zip(u.slots, u.params)}
    left = {u.index: len(u.params) for u in units}
    flats: dict = {}
    by_id = {id(p): p for p in model.parameters()}
    for step in steps:
        for pid in step.param_ids:
            p = by_id[pid]
            if pid not in where:   # frozen: not sharded, just made real
                give_storage(p, torch.empty(p.shape, dtype=p.dtype, device=device))
                continue
            unit, slot = where[pid]
            if unit.index not in flats:
                flats[unit.index] = torch.zeros(unit.padded_numel, dtype=torch.float32, device=device)
            give_storage(p, flats[unit.index][slot.offset:slot.offset + slot.numel])
        run_init(step, init_fn)
        for pid in step.param_ids:
            if pid in where:
                unit = where[pid][0]
                left[unit.index] -= 1
                if left[unit.index] == 0:
                    place(unit, flats.pop(unit.index))


def move_unsharded(model: nn.Module, units: list, device) -> None:
    """Move what no unit holds (buffers, frozen parameters) onto ``device``, one tensor at a time.

    ``initialize`` shards a real model from wherever it was built (host memory, usually) and each
    unit's flat buffer is made on the device (:func:`place_units`), so the whole model is never on the
    device at once, and the device budget is measured without it; this moves the rest, as
    ``model.to(device)`` would have. Meta tensors are left alone (a meta model makes its own)."""
    device = torch.device(device)
    sharded = {id(p) for u in units for p in u.params}
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and not buf.is_meta and buf.device != device:
                setattr(module, name, buf.to(device))
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in sharded or p.is_meta or p.device == device:
                continue
            moved = p.data.to(device)
            if torch._has_compatible_shallow_copy_type(p, moved):   # as nn.Module._apply decides
                p.data = moved   # the same Parameter object (host -> CUDA)
            else:
                setattr(module, name, nn.Parameter(moved, requires_grad=p.requires_grad))


def materialize_steps(model: nn.Module, unit_modules: list, init_fn: Callable | None, device):
    """Give a meta model's parameters real fp32 storage and run the initializers one step at a time, in the
    order (so with the values) of :func:`place_units`; yields each step's module once it is initialized.

    Tensor parallelism consumes it: each split layer is sliced as soon as its step has run
    (:func:`~infinity.parallel.tensor_parallel.apply_plan`), so one unit at a time is whole, as here
    without TP; what stays is this rank's slices plus the replicated parameters.
    """
    check_no_meta(model)
    by_id = {id(p): p for p in model.parameters()}
    for step in init_plan(model, unit_modules):
        for pid in step.param_ids:
            p = by_id[pid]
            give_storage(p, torch.empty(p.shape, dtype=torch.float32 if p.is_floating_point() else p.dtype,
                                        device=device))
        run_init(step, init_fn)
        yield step.module
