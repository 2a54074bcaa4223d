"""The tiered tensor store (DESIGN §2, layer 2): tensors by key in device, host and NVMe tiers.

``TensorStore`` keeps each key's home copy and working copies in faster tiers,
moves them asynchronously (futures), tracks every copy's :class:`Residency`
with checked transitions, and keeps each tier within its byte budget by
evicting clean copies chosen by an :class:`EvictionPolicy` (writing dirty ones home
first), with :class:`Room` s set aside for a party's phase. Imports only
``infinity.config``, ``infinity.io`` and the leaf ``infinity.native_build``.
"""

from infinity.store.budget import BudgetError, Room, resolve_budgets
from infinity.store.eviction import Candidate, EvictionPolicy, LRUPolicy
from infinity.store.host_pool import HostBufferPool
from infinity.store.residency import IllegalTransition, Residency, StoreError, Tier
from infinity.store.tensor_store import TensorStore

__all__ = [
    "TensorStore",
    "Tier",
    "Residency",
    "StoreError",
    "IllegalTransition",
    "BudgetError",
    "Room",
    "EvictionPolicy",
    "LRUPolicy",
    "Candidate",
    "HostBufferPool",
    "resolve_budgets",
]
