"""fp16 loss scaling: a gradient multiplier applied at the model's outputs, and its dynamic update.

The loss is never touched: :class:`ScaleGrad` is the identity in forward and
multiplies the incoming gradient by the scale in backward, so the user's
``loss.backward()`` produces scaled fp16 gradients and the logged loss stays
true. Scaling too high overflows (that step is skipped and the scale halved);
too low underflows small gradients to zero (the scale doubles after
``window`` good steps).
"""

from __future__ import annotations

import torch

__all__ = ["ScaleGrad", "LossScaler"]


class ScaleGrad(torch.autograd.Function):
    """y = x; dL/dx = scale * dL/dy."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class LossScaler:
    """Static or dynamic loss scale; counts skipped (overflowed) steps."""

    def __init__(self, scale: float, dynamic: bool, window: int):
        if scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.good_steps = 0
        self.skipped_steps = 0

    @classmethod
    def for_params(cls, param_dtype: torch.dtype, precision) -> "LossScaler | None":
        """The scaler ``precision`` (the config's section) asks for parameters of ``param_dtype``: with fp16,
        ``loss_scale`` dynamic (starting at ``initial_loss_scale``) or a number (static); None for any other
        dtype, or with ``loss_scale: none``."""
        if param_dtype != torch.float16 or precision.loss_scale == "none":
            return None
        dynamic = precision.loss_scale == "dynamic"
        return cls(precision.initial_loss_scale if dynamic else precision.loss_scale, dynamic,
                   precision.loss_scale_window)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.dynamic:
                self.scale = max(self.scale / 2.0, 1.0)
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps % self.window == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}
