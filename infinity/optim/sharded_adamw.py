"""AdamW as a real ``torch.optim.Optimizer`` whose state lives in flat shards.

The optimizer keeps the user's ``param_groups`` and ``defaults`` (so LR
schedulers and anything reading ``group["lr"]`` work) but never touches the
parameters themselves: it asks a :class:`ShardSource` (the ZeRO engine) for
this rank's flat fp32 master / gradient / moment slices, each tagged with the
param group it belongs to, and applies that group's hyper-parameters. The math
is torch's single-tensor AdamW, element for element, so results match
``torch.optim.AdamW`` on the same inputs.

This module knows nothing of ZeRO; the engine implements the protocol.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

__all__ = ["ShardSource", "ShardedAdamW", "adamw_"]


class ShardSource(Protocol):
    """What the optimizer needs from whoever owns the shards."""

    def prepare_step(self) -> bool:
        """Finish gradient reduction; False means skip this step (fp16 overflow)."""

    def shard_slices(self) -> Iterable[tuple]:
        """(group_index, master fp32, grad, exp_avg fp32, exp_avg_sq fp32, param_out or None) per slice.

        The consumer finishes updating a slice before it asks for the next one, so the source may
        start moving an updated unit (e.g. all-gather it) while the rest is being updated."""

    def finish_step(self) -> None:
        """After the update: refresh compute-precision params (e.g. all-gather them)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...

    def zero_grad(self) -> None: ...


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
           step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update in place on flat fp32 tensors; the same ops as torch's ``_single_tensor_adam``."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over shards. ``step`` counts are per param group (all of a group's shards move together)."""

    def __init__(self, params, source: ShardSource, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if lr < 0:
            raise ValueError(f"optimizer: lr must be >= 0, got {lr}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for i, g in enumerate(self.param_groups):
            b = g["betas"]
            if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
                raise ValueError(f"optimizer: param group {i} betas must be two numbers in [0, 1), got {b}")
        self.source = source
        self.group_steps = [0] * len(self.param_groups)
        self.skipped_steps = 0

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "source", None) is not None:
            raise RuntimeError("ShardedAdamW: param groups are fixed at initialize (they are laid out in the "
                               "flat units); pass every group to infinity.initialize(params=...)")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.source.prepare_step():
            self.skipped_steps += 1
            return loss
        self._count_step()
        self._update_shards()
        self.source.finish_step()
        return loss

    def _count_step(self) -> None:
        """Every group takes one more step (AdamW's bias correction reads the count)."""
        for i in range(len(self.param_groups)):
            self.group_steps[i] += 1

    def _hyper(self, gi: int) -> dict:
        """Param group ``gi``'s AdamW settings for this step."""
        g = self.param_groups[gi]
        return dict(step=self.group_steps[gi], lr=g["lr"], betas=g["betas"], eps=g["eps"],
                    weight_decay=g["weight_decay"])

    def _update_shards(self) -> None:
        """AdamW on every shard slice where it lives (in memory here; offloaded in OffloadAdamW)."""
        for gi, master, grad, exp_avg, exp_avg_sq, out in self.source.shard_slices():
            h = self._hyper(gi)
            grad32 = grad if grad.dtype == torch.float32 else grad.float()
            adamw_(master, grad32, exp_avg, exp_avg_sq, step=h["step"], lr=h["lr"], beta1=h["betas"][0],
                   beta2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"])
            if out is not None:
                out.copy_(master)  # low-precision copy-back into the compute-dtype param shard

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards (parameters' ``.grad`` are always None: gradients live in the shards)."""
        self.source.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping."""
        return self.source.clip_grad_norm_(max_norm)
