"""The planner: pick every knob from a measured profile, predict the step, explain it (``infinity plan``, ``auto``).

- :mod:`~infinity.plan.rates`: the measured rates (an ``infinity profile`` JSON, and the model's own
  compute timed at its shapes).
- :mod:`~infinity.plan.cost`: one candidate's predicted step by phase and term (the terms a measured
  step is attributed to), peak RSS by term, bytes per tier pair.
- :mod:`~infinity.plan.planner`: the candidates, the choice, the alternatives and why they lost, the
  refusal of a request nothing fits.
- :mod:`~infinity.plan.auto`: ``offload: auto`` configs, resolved by the planner.

Layer: above ``estimate`` and ``profile`` (it uses their models and measurements), below
``integrations``, ``train`` and ``cli``.
"""

from infinity.plan.cost import Layout, Prediction, predict
from infinity.plan.planner import DIMENSIONS, InfeasiblePlan, Plan, PlanRequest, describe, make_plan
from infinity.plan.rates import ComputeRates, PlanInputError, Rates, load_profile, measure_compute

__all__ = ["PlanRequest", "Plan", "InfeasiblePlan", "DIMENSIONS", "make_plan", "describe", "predict", "Prediction",
           "Layout", "Rates", "ComputeRates", "PlanInputError", "load_profile", "measure_compute"]
