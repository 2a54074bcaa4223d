"""ZeRO stages 0-3 over flat units: layout, collectives, hooks and the engine."""

from infinity.zero.collectives import Collectives, LocalCollectives, make_collectives
from infinity.zero.engine import ZeroEngine
from infinity.zero.optimizer import ZeroAdamW
from infinity.zero.units import FlatUnit, TensorClass, UnitShard, UnitState

__all__ = ["ZeroEngine", "ZeroAdamW", "FlatUnit", "UnitShard", "UnitState", "TensorClass", "Collectives",
           "LocalCollectives", "make_collectives"]
