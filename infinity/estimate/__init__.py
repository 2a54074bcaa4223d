"""The models behind ``infinity estimate``: memory and communication per strategy, and the peak RSS.

- :mod:`~infinity.estimate.strategies`: model-state bytes per tier and communication per
  step for DDP, ZeRO-1/2/3 and ZeRO-Infinity, ZeRO++'s volumes (the ZeRO paper's model).
- :mod:`~infinity.estimate.tensor_parallel`: the same with tensor parallelism on a ``("dp", "tp")`` mesh.
- :mod:`~infinity.estimate.peak_rss`: the predicted peak RSS of a training process by term,
  and the minimum tier budgets ``initialize`` enforces (with the engine's own unit layout).
"""

from infinity.estimate.peak_rss import bound_for_model, min_budgets, predict_peak_rss
from infinity.estimate.strategies import count_params, estimate, estimate_all, estimate_config, parse_param_count
from infinity.estimate.tensor_parallel import tp_estimate

__all__ = ["estimate", "estimate_all", "estimate_config", "count_params", "parse_param_count", "tp_estimate",
           "predict_peak_rss", "bound_for_model", "min_budgets"]
