"""The models behind ``infinity estimate``: memory and communication per strategy, and the peak RSS.

- :mod:`~infinity.estimate.strategies`: model-state bytes per tier and communication per
  step for DDP, ZeRO-1/2/3 and ZeRO-Infinity, ZeRO++'s volumes (the ZeRO paper's model).
- :mod:`~infinity.estimate.tensor_parallel`: the same with tensor parallelism on a ``("dp", "tp")`` mesh.
- :mod:`~infinity.estimate.peak_rss`: the predicted peak RSS of a training process by term,
  and the minimum tier budgets ``initialize`` enforces (imports the engine's layout; loaded on use).
"""

from __future__ import annotations

import importlib

from infinity.estimate.strategies import count_params, estimate, estimate_all, estimate_config, parse_param_count

__all__ = ["estimate", "estimate_all", "estimate_config", "count_params", "parse_param_count", "tp_estimate",
           "predict_peak_rss", "bound_for_model", "min_budgets"]

# These import the engine's layout (torch.nn modules, units): loaded on first use.
_LAZY = {"tp_estimate": "infinity.estimate.tensor_parallel", "predict_peak_rss": "infinity.estimate.peak_rss",
         "bound_for_model": "infinity.estimate.peak_rss", "min_budgets": "infinity.estimate.peak_rss"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'infinity.estimate' has no attribute {name!r}")
