"""``ZeroAdamW``: the optimizer ``infinity.initialize`` returns, a real ``torch.optim.Optimizer``.

It holds what a torch optimizer holds for the user — ``param_groups`` (with
their ``lr``, ``betas``, ``eps``, ``weight_decay``) and ``defaults`` — so LR
schedulers and anything reading ``group["lr"]`` work, and it never touches
the parameters or moves data: the engine owns the shards and runs the update
(:mod:`infinity.zero.update`), reading the same ``param_groups`` list at each
step. Step counts (per group, for AdamW's bias correction) are the engine's,
since only the engine knows when a step is complete; they are readable and
settable here as ``group_steps`` (checkpoints restore them).

The math is AdamW with decoupled weight decay, torch's fused kernel
(:func:`infinity.optim.cpu_adam.adamw_`), so results match ``torch.optim.AdamW``.
"""

from __future__ import annotations

import torch

__all__ = ["ZeroAdamW"]


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW over the engine's shards. ``step`` counts are per param group."""

    def __init__(self, params, engine, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if lr < 0:
            raise ValueError(f"optimizer: lr must be >= 0, got {lr}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for i, g in enumerate(self.param_groups):
            b = g["betas"]
            if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
                raise ValueError(f"optimizer: param group {i} betas must be two numbers in [0, 1), got {b}")
        # the user's handle on the engine's step: step / zero_grad / clip go to it; the group dicts are
        # the ones the engine was built with (torch keeps the dicts it is given), so it sees lr changes
        self.engine = engine

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "engine", None) is not None:
            raise RuntimeError("ZeroAdamW: param groups are fixed at initialize (they are laid out in the "
                               "flat units); pass every group to infinity.initialize(params=...)")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict`` for the hyper-parameters, but into the existing
        group dicts, which the engine reads at each step (torch's would replace them, and the engine
        would go on reading the old ones). Shard states are loaded with ``infinity.load_checkpoint``."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError(f"ZeroAdamW.load_state_dict: {len(groups) if isinstance(groups, list) else 'no'} "
                             f"param groups for the optimizer's {len(self.param_groups)}")
        for mine, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v

    @property
    def group_steps(self) -> list:
        """Steps taken by each param group (skipped fp16-overflow steps not counted)."""
        return self.engine.hyper.group_steps

    @group_steps.setter
    def group_steps(self, steps) -> None:
        steps = [int(x) for x in steps]
        if len(steps) != len(self.param_groups):
            raise ValueError(f"group_steps: {len(steps)} counts for {len(self.param_groups)} param groups")
        self.engine.hyper.group_steps[:] = steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because fp16 gradients overflowed."""
        return self.engine.hyper.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.engine.hyper.skipped_steps = int(value)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on every shard (skipped on fp16 overflow). If it raises, the step counts and
        loss scale are unchanged and calling it again finishes the same step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards (parameters' ``.grad`` are always None: gradients live in the shards)."""
        self.engine.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping."""
        return self.engine.clip_grad_norm_(max_norm)
