"""Tensor parallelism (Megatron-style column / row split) inside each data-parallel row of the mesh.

A plan maps module names (``fnmatch`` patterns over ``named_modules()``) to a
style:

- :class:`Colwise` (``parts``): the layer's output features are split ``T``
  ways; its weight (and bias) keep this rank's rows. The input is the full,
  replicated activation; backward all-reduces the input gradient over ``tp``
  (:class:`CopyToTensorParallel`). ``parts = 3`` is a fused q|k|v weight: each
  of the three blocks is split ``T`` ways, so rank ``r`` holds q_r | k_r | v_r
  and keeps whole heads.
- :class:`Rowwise`: input features split ``T`` ways (the output of a
  column-split layer), the partial products all-reduced over ``tp`` before the
  (replicated) bias is added (:class:`ReduceFromTensorParallel`).
- :class:`DivideAttrs`: integer attributes (a local head count, a split size)
  divided by ``T``, so attention works on this rank's heads.
- sequence parallelism (:mod:`infinity.parallel.sequence_parallel`): ``Colwise`` /
  ``Rowwise`` with ``sequence_dim``, and ``ScatterOutput`` / ``GatherOutput``
  / ``SequenceParallel`` on the modules between them. A pattern may map to a
  tuple of styles.

``nn.Linear`` and ``transformers``' ``Conv1D`` (GPT-2; weight stored as
``(in, out)``) are supported. A split layer keeps its name and its class's
``isinstance``: like FSDP2's ``fully_shard``, its class becomes a subclass
that only overrides ``forward``, and its parameters become this rank's slices
as ordinary tensors. Everything else (embeddings, norms, row biases) is
replicated over ``tp``: their gradients are equal on every ``tp`` rank.

Why not ``torch.distributed.tensor.parallel`` (measured on torch 2.13, gloo,
CPU; ``parallelize_module`` itself works there): its parameters are
``DTensor``s whose local tensor is held inside the wrapper, and the engine makes
every parameter a view of its unit's flat buffer with ``param.data = view``.
On a ``DTensor`` parameter that assignment raises nothing and is silently
ignored by the forward (it keeps computing with the old local tensor), so ZeRO
gathers and updates would never reach the model. ``ColwiseParallel`` also
refuses GPT-2's ``Conv1D`` (``NotImplementedError``), and a fused q|k|v weight
needs the 3-part split above, which contiguous ``Shard(0)`` does not give.
The plan here is the same data as a ``parallelize_module`` plan (pattern ->
style), so porting one is a renaming.

Every parameter's split is recorded in :class:`TensorParallel.specs` (by
every name of the parameter): checkpoints save it, and
:func:`shard_of` / :func:`assemble` move between full and split tensors.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from infinity.comm.collectives import Collectives
from infinity.parallel.sequence_parallel import (GatherOutput, ScatterOutput, gather_sequence, reduce_scatter_sequence,
                                             SequenceParallel, apply_sequence_style, sum_grad_over_tp)

__all__ = ["Colwise", "Rowwise", "DivideAttrs", "TPSpec", "TensorParallel", "apply_plan", "shard_of", "assemble",
           "CopyToTensorParallel", "ReduceFromTensorParallel", "ScatterOutput", "GatherOutput", "SequenceParallel"]


# ---------------------------------------------------------------- styles (the plan's values)

@dataclass(frozen=True)
class Colwise:
    """Split the output features ``T`` ways; ``parts``: equal blocks (fused q|k|v = 3) each split separately.
    ``sequence_dim``: the input is sequence-sharded along it and all-gathered (sequence parallelism)."""

    parts: int = 1
    sequence_dim: int | None = None


@dataclass(frozen=True)
class Rowwise:
    """Split the input features ``T`` ways; the output is all-reduced over ``tp`` before the bias, or with
    ``sequence_dim`` reduce-scattered along it (sequence parallelism; the bias's gradient is then summed)."""

    sequence_dim: int | None = None


@dataclass(frozen=True)
class DivideAttrs:
    """Divide these integer attributes of the module by ``T`` (local head counts, split sizes)."""

    names: tuple

    def __init__(self, *names: str):
        object.__setattr__(self, "names", tuple(names))


@dataclass(frozen=True)
class TPSpec:
    """How one parameter is split over ``tp``: along ``dim``, each of ``parts`` equal blocks ``T`` ways."""

    dim: int
    parts: int = 1


# ---------------------------------------------------------------- full <-> split

def _blocks(t: torch.Tensor, spec: TPSpec, size: int, name: str) -> list:
    n = t.shape[spec.dim]
    if n % (spec.parts * size):
        raise ValueError(f"tensor parallel: {name} has {n} elements along dim {spec.dim}, not divisible into "
                         f"{spec.parts} part(s) x {size} ranks; choose parallel.tensor dividing it")
    return list(t.chunk(spec.parts, spec.dim))


def shard_of(full: torch.Tensor, spec: TPSpec, rank: int, size: int, name: str = "tensor") -> torch.Tensor:
    """This rank's slice of ``full`` (a new contiguous tensor)."""
    pieces = [b.chunk(size, spec.dim)[rank] for b in _blocks(full, spec, size, name)]
    return torch.cat(pieces, spec.dim).contiguous()


def assemble(pieces: list, spec: TPSpec) -> torch.Tensor:
    """The full tensor from every rank's slice, in rank order (the inverse of :func:`shard_of`)."""
    per_rank = [p.chunk(spec.parts, spec.dim) for p in pieces]
    return torch.cat([torch.cat([r[i] for r in per_rank], spec.dim) for i in range(spec.parts)], spec.dim)


def full_shape(local_shape, spec: TPSpec | None, size: int) -> list:
    shape = list(local_shape)
    if spec is not None:
        shape[spec.dim] *= size
    return shape


# ---------------------------------------------------------------- the tp group and its autograd functions

class TensorParallel:
    """This rank's tensor-parallel group, its byte counters (the ``tp`` axis), and every parameter's split."""

    def __init__(self, group, size: int, rank: int, device_mesh=None):
        self.size, self.rank = size, rank
        self.device_mesh = device_mesh   # the 2-D ("dp", "tp") DeviceMesh this group is a dimension of
        self.coll = Collectives(group)   # counts every activation all-reduce (last_step["collectives_tp"])
        self.specs: dict = {}            # parameter name -> TPSpec; absent: replicated over tp

    def spec(self, name: str) -> TPSpec | None:
        return self.specs.get(name)


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over ``tp`` (each rank saw part of the output)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()   # autograd may hand the same buffer to other consumers
        ctx.tp.coll.all_reduce(grad, average=False)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Forward sums the partial products over ``tp``; backward is the identity (the sum's gradient)."""

    @staticmethod
    def forward(ctx, x, tp):
        out = x.contiguous().clone()   # x is autograd's; summing into it in place would need mark_dirty
        tp.coll.all_reduce(out, average=False)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ColwiseForward:
    def forward(self, x):
        if self.sequence_dim is not None:
            return super().forward(gather_sequence(x, self.tensor_parallel, self.sequence_dim))
        return super().forward(CopyToTensorParallel.apply(x, self.tensor_parallel))


class _RowwiseForward:
    def forward(self, x):
        if self.in_dim == 1:   # nn.Linear: weight (out, in)
            y = F.linear(x, self.weight)
        else:                  # Conv1D: weight (in, out)
            y = torch.matmul(x, self.weight)
        if self.sequence_dim is not None:
            y = reduce_scatter_sequence(y, self.tensor_parallel, self.sequence_dim)
        else:
            y = ReduceFromTensorParallel.apply(y, self.tensor_parallel)
        return y if self.bias is None else y + self.bias


_SUBCLASSES: dict = {}
_STYLES = (Colwise, Rowwise, DivideAttrs, ScatterOutput, GatherOutput, SequenceParallel)


def _swap_class(module: nn.Module, mixin, prefix: str) -> None:
    base = type(module)
    key = (base, mixin)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{prefix}{base.__name__}", (mixin, base), {})
    module.__class__ = _SUBCLASSES[key]


def _layer_dims(module: nn.Module, name: str) -> tuple:
    """(dim of the weight holding output features, dim holding input features)."""
    if isinstance(module, nn.Linear):
        return 0, 1
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):   # transformers' GPT-2 layer
        return 1, 0
    raise TypeError(f"tensor parallel plan: {name!r} is a {type(module).__name__}; Colwise / Rowwise split "
                    "nn.Linear and transformers' Conv1D only")


# ---------------------------------------------------------------- applying a plan

def apply_plan(model: nn.Module, plan: dict, tp: TensorParallel, materialized=None) -> dict:
    """Split ``model`` in place as ``plan`` says; records every split parameter's spec in ``tp.specs``.
    Returns ``{id(full parameter): its split replacement}`` (param groups naming the full ones are remapped).

    Every rank must hold the same full model: each parameter a plan splits is
    broadcast from ``tp`` rank 0 before it is sliced, and every replicated one
    too, so all ``tp`` ranks start equal (as DDP starts from rank 0).
    ``materialized``: for a meta model, an iterator yielding each module as soon
    as its parameters are real and initialized
    (:func:`infinity.zero.materialize.materialize_steps`); split layers inside it
    are sliced right away, so only one unit is ever whole.
    """
    if not isinstance(plan, dict) or not plan:
        raise TypeError(f"tensor parallel plan: expected a non-empty dict of module-name pattern -> style, got "
                        f"{type(plan).__name__}")
    modules = dict(model.named_modules())
    matched: dict = {}        # module name -> its Colwise / Rowwise
    sequence: list = []       # (module name, sequence-parallel style), installed after the split
    for pattern, styles in plan.items():
        for style in (styles if isinstance(styles, (tuple, list)) else (styles,)):
            if not isinstance(style, _STYLES):
                raise TypeError(f"tensor parallel plan: {pattern!r} -> {style!r}; styles are "
                                f"{', '.join(c.__name__ for c in _STYLES)} (infinity.parallel.tensor_parallel, "
                                "infinity.parallel.sequence_parallel)")
            hits = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ValueError(f"tensor parallel plan: {pattern!r} matches no module of {type(model).__name__}")
            for n in hits:
                if isinstance(style, DivideAttrs):
                    _divide_attrs(modules[n], n, style, tp.size)
                elif isinstance(style, (Colwise, Rowwise)):
                    if n in matched:
                        raise ValueError(f"tensor parallel plan: module {n!r} matched by two split styles")
                    matched[n] = style
                else:
                    sequence.append((n, style))
    names_of: dict = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(pname)
    replaced: dict = {}
    name_of = {id(modules[n]): n for n in matched}
    done: set = set()

    def split_ready(root: nn.Module) -> None:
        """Split every planned layer under ``root`` whose parameters are real (the same order on every rank)."""
        for m in root.modules():
            n = name_of.get(id(m))
            if n is None or n in done or any(p.is_meta for p in m.parameters(recurse=False)):
                continue
            for p in m.parameters(recurse=False):   # every rank slices tp rank 0's values
                dist.broadcast(p.data, group_src=0, group=tp.coll.group)
            _split_layer(m, n, matched[n], tp, names_of, replaced)
            done.add(n)

    with torch.no_grad():
        for module in (materialized if materialized is not None else ()):
            split_ready(module)
        split_ready(model)
        sliced = {id(p) for p in replaced.values()}
        for p in model.parameters():   # the replicated ones start from tp rank 0's values too
            if p.is_meta:
                raise ValueError("tensor parallel: a parameter is still on the meta device; pass a materialized "
                                 "model (or materialize it through infinity.initialize)")
            if id(p) not in sliced:
                dist.broadcast(p.data, group_src=0, group=tp.coll.group)
    for n, style in sequence:
        apply_sequence_style(modules[n], n, style, tp)
    # a tp rank that split differently would hang (or silently mix) in the first activation all-reduce
    params = dict(model.named_parameters())
    mine = sorted((n, s.dim, s.parts, tuple(params[n].shape)) for n, s in tp.specs.items())
    every = tp.coll.all_gather_object(mine)
    bad = next((r for r, theirs in enumerate(every) if theirs != every[0]), None)
    if bad is not None:
        raise RuntimeError(f"tensor parallel plan: tp rank {bad} split the model differently from tp rank 0; every "
                           "rank must build the same model and pass the same plan")
    return replaced


def _divide_attrs(module: nn.Module, name: str, style: DivideAttrs, size: int) -> None:
    for a in style.names:
        v = getattr(module, a, None)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"tensor parallel plan: {name}.{a} is {v!r}, not an integer to divide")
        if v % size:
            raise ValueError(f"tensor parallel plan: {name}.{a} = {v} is not divisible by parallel.tensor {size}")
        setattr(module, a, v // size)


def _split_layer(module: nn.Module, name: str, style, tp: TensorParallel, names_of: dict, replaced: dict) -> None:
    out_dim, in_dim = _layer_dims(module, name)
    col = isinstance(style, Colwise)
    w_spec = TPSpec(out_dim if col else in_dim, style.parts if col else 1)
    params = [("weight", w_spec)]
    if module.bias is not None and col:
        params.append(("bias", TPSpec(0, style.parts)))
    for attr, spec in params:
        p = getattr(module, attr)
        names = names_of[id(p)]
        if len(names) > 1:
            raise ValueError(f"tensor parallel plan: {name}.{attr} is tied ({', '.join(names)}); a split "
                             "parameter cannot be shared")
        local = shard_of(p.detach(), spec, tp.rank, tp.size, f"{name}.{attr}")
        setattr(module, attr, nn.Parameter(local, requires_grad=p.requires_grad))
        replaced[id(p)] = getattr(module, attr)
        tp.specs[names[0]] = spec
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    else:
        module.nf = module.weight.shape[1]
    module.tensor_parallel = tp
    module.in_dim = in_dim
    module.sequence_dim = style.sequence_dim
    if not col and style.sequence_dim is not None and module.bias is not None:
        sum_grad_over_tp(module.bias, tp)   # added to this rank's sequence slice only
    _swap_class(module, _ColwiseForward if col else _RowwiseForward, "Colwise" if col else "Rowwise")
