"""The hooks that drive the engine from an ordinary forward and ``loss.backward()``.

- root forward pre-hook: stage 3 gathers the root unit (in use until the end of
  backward); starts the forward clock.
- root forward hook: fp16 wraps the outputs in :class:`ScaleGrad`; registers a
  grad hook on the outputs that marks the start of backward (and queues the
  end-of-backward flush).
- unit forward pre-hook (stage 3): gather this unit for use (``engine.acquire``,
  within ``prefetch.max_live_bytes``), prefetch the next one.
- unit forward hook (stage 3): release the unit (``reshard_after_forward``) or
  keep it for backward (``engine.after_forward``), and register a grad hook on
  its outputs that acquires it again just before its backward runs.
- per-parameter post-accumulate-grad hook: moves ``.grad`` into the unit's flat
  gradient; the unit's last one triggers its reduction (and, stage 3, release).

Nothing is attached to parameters or modules beyond these removable handles.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.autograd.graph import register_multi_grad_hook

from infinity.zero.loss_scale import ScaleGrad

__all__ = ["install", "output_tensors"]


def output_tensors(out) -> list:
    """Tensors requiring grad inside a module's output (tensor, tuple/list, dict, ModelOutput)."""
    found = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "__dataclass_fields__"):
            for k in x.__dataclass_fields__:
                walk(getattr(x, k))

    walk(out)
    return found


def _scale_outputs(out, scale: float):
    """Same structure, every grad-requiring float tensor routed through ScaleGrad."""
    if isinstance(out, torch.Tensor):
        return ScaleGrad.apply(out, scale) if out.requires_grad and out.is_floating_point() else out
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # namedtuple
        return type(out)(*(_scale_outputs(x, scale) for x in out))
    if isinstance(out, (list, tuple)):
        return type(out)(_scale_outputs(x, scale) for x in out)
    if isinstance(out, dict):  # includes transformers' ModelOutput, whose __setitem__ keeps attributes in sync
        for k in list(out.keys()):
            out[k] = _scale_outputs(out[k], scale)
        return out
    if dataclasses.is_dataclass(out) and not isinstance(out, type):  # frozen ones too
        return dataclasses.replace(out, **{f.name: _scale_outputs(getattr(out, f.name), scale)
                                           for f in dataclasses.fields(out) if f.init})
    return out


def install(engine) -> list:
    """Register every hook the stage needs; returns the removable handles."""
    handles = []
    root_unit = next((u for u in engine.units if u.is_root), None)

    def root_pre(module, args):
        engine.stats.start("forward")
        if engine.stage == 3 and root_unit is not None:
            _record(engine, engine.forward_order, root_unit)
            engine.acquire(root_unit)
            engine.prefetch_after(root_unit, engine.forward_order)

    def root_post(module, args, out):
        if not torch.is_grad_enabled():
            if engine.stage == 3:  # no backward will follow: nothing may stay gathered
                for u in engine.units:
                    engine.release(u)
            engine.stats.stop("forward")
            return None
        if engine.loss_scaler is not None:
            out = _scale_outputs(out, engine.loss_scaler.scale)
        tensors = output_tensors(out)
        if tensors:
            # lives on this forward's graph (freed with it), so no handle is kept
            register_multi_grad_hook(tensors, lambda grad: engine.enter_backward(), mode="any")
        engine.stats.stop("forward")
        return out

    handles.append(engine.model.register_forward_pre_hook(root_pre))
    handles.append(engine.model.register_forward_hook(root_post))

    if engine.stage == 3:
        for unit in engine.units:
            if unit.is_root:
                continue
            handles.append(unit.module.register_forward_pre_hook(_unit_pre(engine, unit)))
            handles.append(unit.module.register_forward_hook(_unit_post(engine, unit)))

    for unit in engine.units:
        for slot, p in zip(unit.slots, unit.params):
            handles.append(p.register_post_accumulate_grad_hook(
                lambda param, unit=unit, slot=slot: engine.param_grad_ready(unit, slot, param)))
    return handles


def _record(engine, order: list, unit) -> None:
    if not engine._order_frozen and unit.index not in order:
        order.append(unit.index)


def _unit_pre(engine, unit):
    def pre(module, args):
        _record(engine, engine.forward_order, unit)
        engine.acquire(unit)
        engine.prefetch_after(unit, engine.forward_order)
    return pre


def _unit_post(engine, unit):
    def post(module, args, out):
        if not torch.is_grad_enabled():
            engine.release(unit)
            return None
        engine.after_forward(unit)
        tensors = output_tensors(out)
        if tensors:
            def before_backward(grad):
                engine.enter_backward()
                _record(engine, engine.backward_order, unit)
                engine.acquire(unit)   # in use until its gradients are reduced (then released)
                engine.prefetch_after(unit, engine.backward_order)
            register_multi_grad_hook(tensors, before_backward, mode="any")
        return None
    return post
