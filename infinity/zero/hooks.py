"""The hooks that drive the engine from an ordinary forward and ``loss.backward()``.

Each hook calls one verb of its :class:`HookTarget` (the engine: the root's
forward, the start of backward, a parameter's gradient, a state dict's read) or
of its unit (:class:`UnitTarget`, a :class:`~infinity.zero.units.FlatUnit`,
FSDP2's ``FSDPParamGroup``: the unit's forward, backward, recompute and saved
activations), and reads nothing else of them:

- root forward pre-hook: ``root_pre_forward`` (notice a backward that raised
  since the last call; stage 3 gathers the root unit, in use until the end of
  backward; the forward clock; counting saved activations when enabled).
- root forward hook: ``root_post_forward`` (it may wrap the outputs: fp16's
  :class:`ScaleGrad`), then a grad hook on the outputs that marks the start of
  backward (``enter_backward``, which queues the end-of-backward flush).
- unit forward pre-hook (stage 3): the unit's ``pre_forward`` gathers it for
  use (within ``prefetch.max_live_bytes``) and, in a training pass, records the
  use in the trace and prefetches along it; ``torch.no_grad()`` passes record nothing.
- unit forward hook (stage 3): the unit's ``post_forward`` releases it
  (``reshard_after_forward``) or keeps it for backward, and a grad hook on its
  outputs calls ``enter_backward`` (a no-op once backward has begun), then the
  unit's ``pre_backward``, just before its backward runs.
- unit forward pre-hook at stages 1-2 with ``optimizer.update_at``
  next_forward: the unit's ``pre_forward`` waits for its update that
  ``optimizer.step()`` launched; a state-dict pre-hook on the model:
  ``drain_update`` (the whole launched update).
- per-parameter post-accumulate-grad hook: ``param_grad_ready`` moves ``.grad``
  into the unit's flat gradient; the unit's last one triggers its reduction.

With ``zero.activation_checkpointing`` each unit module (or the first N) gets PyTorch's
composable activation checkpointing (``torch.distributed._composable.checkpoint``:
hooks, no change to the module tree or names): its activations are recomputed
in backward. The recompute runs the unit's forward hooks again inside the
backward pass; there the unit is already gathered for its backward, so the
pre-hook only makes sure of that (the unit's ``pre_recompute``) and the post-hook does nothing.

With ``zero.activation_offload`` each unit module (the root is never one) gets two more hooks around
everything else: a forward pre-hook ahead of the others (ahead of the checkpoint's too, so the checkpointed
unit's saved input is caught) calls the unit's ``saves_begin`` in a training forward, and a forward hook
that runs last, also when the forward raised, calls its ``saves_end``. Between them autograd's saves go through
the engine's :class:`~infinity.zero.activations.ActivationOffload`. A recompute calls neither.

Nothing is attached to parameters or modules beyond these removable handles
(the checkpointing hooks, when on, stay with the modules).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Protocol

import torch
from torch.autograd.graph import register_multi_grad_hook

from infinity.zero.loss_scale import ScaleGrad

__all__ = ["HookTarget", "UnitTarget", "install", "output_tensors", "scale_outputs"]


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


def scale_outputs(out, scale: float):
    """Same structure, every grad-requiring float tensor routed through ScaleGrad."""
    if isinstance(out, torch.Tensor):
        return ScaleGrad.apply(out, scale) if out.requires_grad and out.is_floating_point() else out
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # namedtuple
        return type(out)(*(scale_outputs(x, scale) for x in out))
    if isinstance(out, (list, tuple)):
        return type(out)(scale_outputs(x, scale) for x in out)
    if isinstance(out, dict):  # includes transformers' ModelOutput, whose __setitem__ keeps attributes in sync
        for k in list(out.keys()):
            out[k] = scale_outputs(out[k], scale)
        return out
    if dataclasses.is_dataclass(out) and not isinstance(out, type):  # frozen ones too
        return dataclasses.replace(out, **{f.name: scale_outputs(getattr(out, f.name), scale)
                                           for f in dataclasses.fields(out) if f.init})
    return out


class HookTarget(Protocol):
    """The verbs of the whole model the hooks call (the engine implements them)."""

    def root_pre_forward(self, training: bool) -> None: ...
    def root_post_forward(self, out, training: bool): ...           # returns the output (fp16 wraps it)
    def enter_backward(self) -> None: ...
    def param_grad_ready(self, unit_index: int, slot_index: int, param) -> None: ...
    def drain_update(self) -> None: ...                            # a launched update finishes first


class UnitTarget(Protocol):
    """A unit as the hooks see it: its module, and the verbs of its own step
    (:class:`~infinity.zero.units.FlatUnit` implements them)."""

    index: int
    module: torch.nn.Module
    params: list

    @property
    def is_root(self) -> bool: ...
    def pre_forward(self, training: bool) -> None: ...
    def post_forward(self, training: bool) -> None: ...
    def pre_backward(self) -> None: ...                             # after the engine's enter_backward
    def pre_recompute(self) -> None: ...                            # activation checkpointing's rerun
    def saves_begin(self) -> None: ...                              # zero.activation_offload
    def saves_end(self) -> None: ...


def install(target: HookTarget, model, units: list[UnitTarget], shard_params: bool, checkpoint_units: int = 0,
            wait_units: bool = False, offload_saves: bool = False) -> list:
    """Register every hook on ``model`` and its ``units``' modules (the unit hooks only when
    ``shard_params``: stage 3 gathers per unit; with ``wait_units`` only the unit pre-hooks, which
    wait for the unit's launched update), activation checkpointing on the first
    ``checkpoint_units`` unit modules (the root is never one), and with ``offload_saves`` the hooks that
    route each unit's saved activations; returns the removable handles."""
    handles = []

    def root_pre(module, args):
        target.root_pre_forward(torch.is_grad_enabled())

    def root_post(module, args, out):
        training = torch.is_grad_enabled()
        out = target.root_post_forward(out, training)
        if training:
            tensors = output_tensors(out)
            if tensors:
                # lives on this forward's graph (freed with it), so no handle is kept
                register_multi_grad_hook(tensors, lambda grad: target.enter_backward(), mode="any")
        return out

    handles.append(model.register_forward_pre_hook(root_pre))
    handles.append(model.register_forward_hook(root_post))
    # a state dict read right after optimizer.step() sees the step's parameters (next_forward)
    handles.append(model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: target.drain_update()))

    if checkpoint_units:
        from torch.distributed._composable import checkpoint
        for unit in [u for u in units if not u.is_root][:checkpoint_units]:
            checkpoint(unit.module)   # registered first: its context wraps the gather hooks below

    if shard_params:
        for unit in units:
            if unit.is_root:
                continue
            handles.append(unit.module.register_forward_pre_hook(_unit_pre(unit)))
            handles.append(unit.module.register_forward_hook(_unit_post(target, unit)))
    elif wait_units:
        for unit in units:
            if not unit.is_root:
                handles.append(unit.module.register_forward_pre_hook(_unit_pre(unit)))

    if offload_saves:   # last: the pre-hook goes first of all, the post-hook runs after every other
        for unit in units:
            if not unit.is_root:
                pre, post = _unit_saves(unit)
                handles.append(unit.module.register_forward_pre_hook(pre, prepend=True))
                handles.append(unit.module.register_forward_hook(post, always_call=True))

    # a parameter's hooks are held by the tensor in C++, where the garbage collector cannot follow
    # them: a closure holding the engine or a unit (which holds the parameter) would keep the engine
    # alive forever, so these hold the target weakly and the unit by index
    target_ref = weakref.ref(target)
    for unit in units:
        for s, p in enumerate(unit.params):
            handles.append(p.register_post_accumulate_grad_hook(
                lambda param, u=unit.index, s=s: _param_grad_ready(target_ref, u, s, param)))
    return handles


def _param_grad_ready(target_ref, unit_index: int, slot_index: int, param) -> None:
    target = target_ref()
    if target is not None:
        target.param_grad_ready(unit_index, slot_index, param)


def _recomputing() -> bool:
    """A forward inside a backward pass: activation checkpointing recomputing a unit."""
    return torch._C._current_graph_task_id() != -1


def _unit_pre(unit):
    def pre(module, args):
        if _recomputing():
            unit.pre_recompute()   # gathered for its backward already (a no-op then)
            return
        unit.pre_forward(torch.is_grad_enabled())
    return pre


def _unit_post(target, unit):
    def post(module, args, out):
        if _recomputing():
            return None   # its backward is running and needs the parameters: keep them gathered
        training = torch.is_grad_enabled()
        unit.post_forward(training)
        if training:
            tensors = output_tensors(out)
            if tensors:
                register_multi_grad_hook(tensors, lambda grad: _unit_pre_backward(target, unit), mode="any")
        return None
    return post


def _unit_pre_backward(target, unit) -> None:
    target.enter_backward()   # the step's backward phase first: nothing of the unit's runs outside it
    unit.pre_backward()


def _unit_saves(unit):
    began = []   # whether this forward's pre-hook began routing saves (not in a recompute or no_grad pass)

    def pre(module, args):
        if torch.is_grad_enabled() and not _recomputing():
            unit.saves_begin()
            began.append(True)

    def post(module, args, out):
        if began:
            began.pop()
            unit.saves_end()
        return None
    return pre, post
