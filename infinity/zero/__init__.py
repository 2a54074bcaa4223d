"""ZeRO stages 0-3 over flat units: the engine and what a step is made of.

Units and their shards, placement, gathers, gradient reduction, the update and
the step's lifecycle; collectives are :mod:`infinity.comm`'s, tensor parallel
layers :mod:`infinity.parallel`'s.
"""

from infinity.zero.engine import ZeroEngine
from infinity.zero.optimizer import ZeroAdamW

__all__ = ["ZeroEngine", "ZeroAdamW"]
