"""Tensor and sequence parallelism beside ZeRO: the ``("dp", "tp")`` mesh, the split layers, default plans.

- :mod:`~infinity.parallel.mesh`: the 2-D device mesh and its sub-groups.
- :mod:`~infinity.parallel.tensor_parallel`: Megatron-style column / row splits as
  plan styles (:class:`Colwise`, :class:`Rowwise`, :class:`DivideAttrs`) and :func:`apply_plan`.
- :mod:`~infinity.parallel.sequence_parallel`: norms and the residual stream on ``1/T`` of the sequence.
- :mod:`~infinity.parallel.plans`: default plans for the built-in GPT, HF GPT-2 and Llama.
- :mod:`~infinity.parallel.norm`: the gradient norm over both mesh axes (replicated elements weighed once).

Uses :mod:`infinity.comm` for its collectives; the ZeRO engine uses these layers, never the reverse.
"""

from infinity.parallel.tensor_parallel import Colwise, DivideAttrs, Rowwise, TensorParallel, apply_plan

__all__ = ["Colwise", "Rowwise", "DivideAttrs", "TensorParallel", "apply_plan"]
