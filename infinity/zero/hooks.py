"""The hooks that drive the engine from an ordinary forward and ``loss.backward()``.

- root forward pre-hook: notices a backward that raised since the last call
  (``engine.begin_forward``); stage 3 gathers the root unit (in use until the
  end of backward); starts the forward clock; with ``engine.memory`` enabled,
  starts counting the tensors the forward saves for backward.
- root forward hook: stops that count; fp16 wraps the outputs in
  :class:`ScaleGrad`; registers a grad hook on the outputs that marks the start
  of backward (and queues the end-of-backward flush).
- unit forward pre-hook (stage 3): gather this unit for use (``engine.use_unit``,
  within ``prefetch.max_live_bytes``) and, in a training pass, record the use in
  the trace and prefetch along it; ``torch.no_grad()`` passes record nothing.
- unit forward hook (stage 3): release the unit (``reshard_after_forward``) or
  keep it for backward (``engine.after_forward``), and register a grad hook on
  its outputs that acquires it again just before its backward runs.
- per-parameter post-accumulate-grad hook: moves ``.grad`` into the unit's flat
  gradient; the unit's last one triggers its reduction (and, stage 3, release).

With ``zero.activation_checkpointing`` each unit module gets PyTorch's
composable activation checkpointing (``torch.distributed._composable.checkpoint``:
hooks, no change to the module tree or names): its activations are recomputed
in backward. The recompute runs the unit's forward hooks again inside the
backward pass; there the unit is already gathered for its backward, so the
hooks only make sure of that (nothing is released, recorded or hooked).

Nothing is attached to parameters or modules beyond these removable handles
(the checkpointing hooks, when on, stay with the modules).
"""

from __future__ import annotations

import dataclasses
import weakref

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


def install(engine, model, checkpoint_units: bool = False) -> list:
    """Register every hook the stage needs on ``model`` (and activation checkpointing on each unit
    module if ``checkpoint_units``); returns the removable handles."""
    handles = []
    root_unit = next((u for u in engine.units if u.is_root), None)

    def root_pre(module, args):
        engine.begin_forward()
        engine.memory.forward_begins()   # counts saved activations once engine.memory is enabled
        if engine.stage == 3 and root_unit is not None:
            engine.use_unit(root_unit, training=torch.is_grad_enabled())

    def root_post(module, args, out):
        engine.memory.forward_ends()
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

    handles.append(model.register_forward_pre_hook(root_pre))
    handles.append(model.register_forward_hook(root_post))

    if checkpoint_units:
        from torch.distributed._composable import checkpoint
        for unit in engine.units:
            if not unit.is_root:
                checkpoint(unit.module)   # registered first: its context wraps the gather hooks below

    if engine.stage == 3:
        for unit in engine.units:
            if unit.is_root:
                continue
            handles.append(unit.module.register_forward_pre_hook(_unit_pre(engine, unit)))
            handles.append(unit.module.register_forward_hook(_unit_post(engine, unit)))

    # a parameter's hooks are held by the tensor in C++, where the garbage collector cannot follow
    # them: a closure holding the engine or a unit (which holds the parameter) would keep the engine
    # alive forever, so these hold the engine weakly and the unit by index
    engine_ref = weakref.ref(engine)
    for unit in engine.units:
        for s, p in enumerate(unit.params):
            handles.append(p.register_post_accumulate_grad_hook(
                lambda param, u=unit.index, s=s: _param_grad_ready(engine_ref, u, s, param)))
    return handles


def _param_grad_ready(engine_ref, unit_index: int, slot_index: int, param) -> None:
    engine = engine_ref()
    if engine is not None:
        unit = engine.units[unit_index]
        engine.param_grad_ready(unit, unit.slots[slot_index], param)


def _recomputing() -> bool:
    """A forward inside a backward pass: activation checkpointing recomputing a unit."""
    return torch._C._current_graph_task_id() != -1


def _unit_pre(engine, unit):
    def pre(module, args):
        if _recomputing():
            engine.acquire(unit)   # gathered for its backward already (a no-op then)
            return
        engine.use_unit(unit, training=torch.is_grad_enabled())
    return pre


def _unit_post(engine, unit):
    def post(module, args, out):
        if _recomputing():
            return None   # its backward is running and needs the parameters: keep them gathered
        if not torch.is_grad_enabled():
            engine.release(unit)
            return None
        engine.after_forward(unit)
        tensors = output_tensors(out)
        if tensors:
            def before_backward(grad):
                engine.enter_backward()
                engine.use_unit(unit, training=True)   # in use until its gradients are reduced (then released)
            register_multi_grad_hook(tensors, before_backward, mode="any")
        return None
    return post
