"""Sequence parallelism: the parts of a block between the split matmuls run on 1/T of the sequence.

With plain tensor parallelism every ``tp`` rank computes the norms, residual
adds and dropout of a block on the whole sequence, the same values ``T``
times. Sequence parallelism (Korthikanti et al. 2022, torch's
``SequenceParallel``) shards those regions along the sequence: the
column-split layer's input is all-gathered along the sequence (its backward
reduce-scatters) instead of being copied, and the row-split layer's output is
reduce-scattered (backward: all-gathered) instead of all-reduced. The bytes
on the ``tp`` axis are the same (an all-reduce is a reduce-scatter plus an
all-gather); the activations of the sharded regions shrink ``T`` times.

Styles (plan values, beside :class:`~infinity.parallel.tensor_parallel.Colwise`
and ``Rowwise`` with ``sequence_dim`` set):

- :class:`ScatterOutput` ``(dim)``: keep this rank's slice of the module's
  output along ``dim`` (the embeddings); backward all-gathers the gradient.
- :class:`GatherOutput` ``(dim)``: all-gather the output along ``dim`` (the
  final norm, before a replicated head); backward keeps this rank's slice
  (the head's gradient is the same on every rank).
- :class:`SequenceParallel`: the module runs on a sequence slice, so its
  parameters' gradients are partial: each is summed over ``tp`` as soon as
  autograd has accumulated it (before the engine takes it). Row-split biases
  under ``sequence_dim`` get the same treatment.

The sequence length must divide by ``T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["ScatterOutput", "GatherOutput", "SequenceParallel", "gather_sequence", "reduce_scatter_sequence",
           "apply_sequence_style", "sum_grad_over_tp"]


@dataclass(frozen=True)
class ScatterOutput:
    """Keep this rank's slice of the module's output along ``dim`` (backward: all-gather)."""

    dim: int


@dataclass(frozen=True)
class GatherOutput:
    """All-gather the module's output along ``dim`` (backward: this rank's slice)."""

    dim: int


@dataclass(frozen=True)
class SequenceParallel:
    """The module runs on a sequence slice: its parameters' gradients are summed over ``tp``."""


def _check(x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] % size:
        raise ValueError(f"sequence parallel: {what} has {x.shape[dim]} positions along dim {dim}, not divisible "
                         f"by parallel.tensor {size}; use a sequence length that is a multiple of it")


def _all_gather(x: torch.Tensor, tp, dim: int) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()   # the collective works on contiguous rank-major chunks
    out = front.new_empty((front.shape[0] * tp.size, *front.shape[1:]))
    tp.coll.all_gather(out.view(-1), front.view(-1))
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, tp, dim: int) -> torch.Tensor:
    _check(x, dim, tp.size, "a reduce-scattered activation")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // tp.size, *front.shape[1:]))
    tp.coll.reduce_scatter(out.view(-1), front.view(-1), average=False)
    return out.movedim(0, dim)


def _slice(x: torch.Tensor, tp, dim: int) -> torch.Tensor:
    _check(x, dim, tp.size, "a scattered activation")
    return x.chunk(tp.size, dim)[tp.rank].contiguous()


class _Conjugate(torch.autograd.Function):
    """``forward(x)`` in forward and ``backward(grad)`` in backward: each collective of sequence
    parallelism is paired with its conjugate (all-gather <-> reduce-scatter, slice <-> all-gather)."""

    @staticmethod
    def forward(ctx, x, tp, dim, forward, backward):
        ctx.tp, ctx.dim, ctx.conjugate = tp, dim, backward
        return forward(x, tp, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.conjugate(grad, ctx.tp, ctx.dim), None, None, None, None


def gather_sequence(x: torch.Tensor, tp, dim: int) -> torch.Tensor:
    """Into a column-split layer: all-gather along the sequence; backward reduce-scatters (each rank's
    slice of the output used the whole input)."""
    return _Conjugate.apply(x, tp, dim, _all_gather, _reduce_scatter)


def reduce_scatter_sequence(x: torch.Tensor, tp, dim: int) -> torch.Tensor:
    """Out of a row-split layer: sum the partial products and keep this rank's sequence slice; backward
    all-gathers."""
    return _Conjugate.apply(x, tp, dim, _reduce_scatter, _all_gather)


def _scatter_replicated(x: torch.Tensor, tp, dim: int) -> torch.Tensor:
    """Replicated -> this rank's slice; backward all-gathers the slices' gradients."""
    return _Conjugate.apply(x, tp, dim, _slice, _all_gather)


def _gather_replicated(x: torch.Tensor, tp, dim: int) -> torch.Tensor:
    """Slices -> the whole, consumed alike on every rank; backward keeps this rank's slice."""
    return _Conjugate.apply(x, tp, dim, _all_gather, _slice)


def sum_grad_over_tp(param: nn.Parameter, tp) -> None:
    """Sum ``param``'s gradient over ``tp`` once autograd has accumulated it (registered before the
    engine's own hook, so the engine takes the sum)."""
    def hook(p):
        if p.grad is not None:
            tp.coll.all_reduce(p.grad, average=False)
    param.register_post_accumulate_grad_hook(hook)


def apply_sequence_style(module: nn.Module, name: str, style, tp) -> None:
    """Install ``style`` (ScatterOutput, GatherOutput, SequenceParallel) on ``module``."""
    if isinstance(style, SequenceParallel):
        params = list(module.parameters(recurse=False))
        if not params:
            raise ValueError(f"sequence parallel plan: {name!r} holds no parameters of its own")
        for p in params:
            sum_grad_over_tp(p, tp)
        return
    fn = _scatter_replicated if isinstance(style, ScatterOutput) else _gather_replicated

    def hook(mod, args, out):
        return fn(out, tp, style.dim)
    module.register_forward_hook(hook)
