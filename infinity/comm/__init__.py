"""Collectives with byte accounting, and ZeRO++'s variants of them.

- :mod:`~infinity.comm.collectives`: :class:`Collectives` over a process group (or
  :class:`LocalCollectives` for one process), each call counting the bytes it moves,
  split into intra- and cross-node bytes by the node layout.
- :mod:`~infinity.comm.watchdog`: names the collective a rank is stuck in and the ranks it
  waits for; turns the process group's timeout into one :class:`CollectiveTimeout` line.
- :mod:`~infinity.comm.quantize`: block-wise int8 / int4 quantization of a flat tensor.
- :mod:`~infinity.comm.node_layout`: which ranks share a node, as the launcher placed them
  (torchrun's ``GROUP_RANK``, SLURM's node id, else the host name).
- :mod:`~infinity.comm.zeropp`: ZeRO++ (qwZ quantized weight gathers, hpZ node-local
  secondary shards, qgZ quantized hierarchical gradient reduction), supplying gather
  and reduce callables with the plain collectives' signatures.

Imports nothing above ``infinity.config``.
"""

from infinity.comm.collectives import Collectives, CommCounters, LocalCollectives, make_collectives
from infinity.comm.watchdog import CollectiveTimeout

__all__ = ["Collectives", "LocalCollectives", "CommCounters", "make_collectives", "CollectiveTimeout"]
