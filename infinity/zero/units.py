"""Flat units: how a model's parameters are cut, flattened, padded and sharded.

A *unit* is a set of parameters that is gathered, reduced and updated as one
flat buffer (by default each child of the model's largest ``nn.ModuleList``,
plus one *root* unit for everything else). :class:`FlatUnit` is the layout: the
parameters' names, shapes and offsets in the flat buffer, the per-group element
ranges (params are ordered by param group, so each group is one contiguous
range and one collective serves all groups), and the padding that makes the
buffer split evenly over the ranks with each shard's byte size a multiple of
4096 in every dtype it is stored in (direct I/O needs that).

:class:`UnitShard` holds this rank's tensors for one unit, by
:class:`TensorClass`, behind :meth:`UnitShard.get` / :meth:`UnitShard.put` so a
store-backed shard (host / NVMe tiers) can replace the in-memory one.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = [
    "DIRECT_IO_ALIGN_BYTES", "UnitState", "TensorClass", "ParamSlot", "FlatUnit", "UnitShard",
    "choose_unit_modules", "plan_units", "shard_align_numel",
]

DIRECT_IO_ALIGN_BYTES = 4096
ROOT_UNIT_NAME = "<root>"


class UnitState(enum.Enum):
    """Where a unit's full (gathered) compute-precision parameters are."""

    SHARDED = "sharded"      # only this rank's shard exists; the full buffer's storage is freed
    GATHERING = "gathering"  # full buffer allocated, all-gather launched, not yet waited on
    GATHERED = "gathered"    # full buffer holds every rank's shard; parameters are usable views


_ALLOWED = {
    UnitState.SHARDED: {UnitState.GATHERING},
    UnitState.GATHERING: {UnitState.GATHERED},
    UnitState.GATHERED: {UnitState.SHARDED},
}


class TensorClass(enum.Enum):
    """The per-shard tensors of a unit (DESIGN §3, tensor classes)."""

    PARAM = "param"            # compute precision (fp32 / bf16 / fp16)
    GRAD = "grad"              # reduce precision, reduced over ranks
    MASTER = "master"          # fp32 master weights (the PARAM tensor itself when compute is fp32)
    EXP_AVG = "exp_avg"        # Adam first moment, fp32
    EXP_AVG_SQ = "exp_avg_sq"  # Adam second moment, fp32


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its unit's flat buffer."""

    name: str            # first qualified name (tied params have more; see FlatUnit.aliases)
    shape: tuple
    offset: int          # element offset in the flat buffer
    numel: int
    group_index: int     # which optimizer param group it belongs to


def shard_align_numel(dtypes) -> int:
    """Elements per shard must be a multiple of this so every dtype's shard is 4096-byte sized."""
    return max(DIRECT_IO_ALIGN_BYTES // torch.empty((), dtype=d).element_size() for d in dtypes)


class FlatUnit:
    """Layout and lifecycle of one unit. Tensors live in :class:`UnitShard` and ``full_param``."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list, names: list,
                 group_of: dict, shard_world: int, align_numel: int):
        self.index, self.name, self.module = index, name, module
        order = sorted(range(len(params)), key=lambda i: group_of[id(params[i])])  # stable: groups contiguous
        self.params = [params[i] for i in order]
        slots, offset = [], 0
        for i in order:
            p = params[i]
            slots.append(ParamSlot(names[i], tuple(p.shape), offset, p.numel(), group_of[id(p)]))
            offset += p.numel()
        self.slots = slots
        self.numel = offset
        chunk = shard_world * align_numel
        self.padded_numel = max(chunk, math.ceil(offset / chunk) * chunk)
        self.shard_world = shard_world
        self.shard_numel = self.padded_numel // shard_world
        # group_index -> [start, end) in the flat buffer
        self.group_ranges = []
        for s in slots:
            if self.group_ranges and self.group_ranges[-1][0] == s.group_index:
                g, a, _ = self.group_ranges[-1]
                self.group_ranges[-1] = (g, a, s.offset + s.numel)
            else:
                self.group_ranges.append((s.group_index, s.offset, s.offset + s.numel))
        self.state = UnitState.GATHERED
        self.full_param: torch.Tensor | None = None   # compute dtype, padded_numel; storage freed when SHARDED
        self.full_grad: torch.Tensor | None = None    # reduce dtype, padded_numel, while gradients accumulate
        self.shard: UnitShard | None = None

    @property
    def is_root(self) -> bool:
        return self.name == ROOT_UNIT_NAME

    def transition(self, new: UnitState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"unit {self.name}: illegal transition {self.state.value} -> {new.value}")
        self.state = new
        if new is UnitState.GATHERED:
            self._point_params(live=True)
        elif new is UnitState.SHARDED:
            self._point_params(live=False)

    def _point_params(self, live: bool) -> None:
        """Parameters are views of the full buffer while it is live and empty tensors otherwise:
        reading a view of a freed storage would crash (segfault on CPU) instead of showing nothing.
        Autograd's saved views hold the storage object itself, which a gather refills in place."""
        if self.full_param is None:
            return
        if live:
            full = self.full_param
            for slot, p in zip(self.slots, self.params):
                p.data = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        else:
            empty = self.full_param.new_empty(0)
            for p in self.params:
                p.data = empty

    def shard_group_ranges(self, shard_rank: int) -> list:
        """(group_index, lo, hi) in shard-local element coordinates; padding is in no group."""
        base = shard_rank * self.shard_numel
        out = []
        for g, a, b in self.group_ranges:
            lo, hi = max(a, base), min(b, base + self.shard_numel)
            if lo < hi:
                out.append((g, lo - base, hi - base))
        return out

    def signature(self) -> tuple:
        """What every rank must agree on (checked at initialize)."""
        return (self.name, self.padded_numel, tuple((s.name, s.shape, s.group_index) for s in self.slots))

    def __repr__(self):
        return (f"FlatUnit({self.name!r}, params={len(self.slots)}, numel={self.numel}, "
                f"padded={self.padded_numel}, shard={self.shard_numel}, state={self.state.value})")


class UnitShard:
    """This rank's tensors of one unit, in memory. Tensors of a class may alias (see TensorClass.MASTER)."""

    def __init__(self):
        self._tensors: dict = {}

    def put(self, cls: TensorClass, tensor: torch.Tensor) -> None:
        self._tensors[cls] = tensor

    def get(self, cls: TensorClass) -> torch.Tensor:
        try:
            return self._tensors[cls]
        except KeyError:
            raise KeyError(f"unit shard holds no {cls.value} tensor") from None

    def read(self, cls: TensorClass) -> torch.Tensor:
        """Like :meth:`get` for a caller that will not write (a store-backed shard then skips the write-back)."""
        return self.get(cls)

    def has(self, cls: TensorClass) -> bool:
        return cls in self._tensors


# ---------------------------------------------------------------- partitioning

def choose_unit_modules(model: nn.Module, unit_classes=()) -> list:
    """(qualified name, module) of each unit module, in model order (the root unit is separate).

    Default: the children of the ModuleList holding the most parameters. With
    ``unit_classes``: every outermost module whose class name is listed.
    """
    if unit_classes:
        wanted = set(unit_classes)
        found, seen_classes = [], set()
        for name, mod in model.named_modules():
            if mod is model:
                continue
            seen_classes.add(type(mod).__name__)
            if type(mod).__name__ in wanted and not any(name.startswith(f + ".") for f, _ in found):
                found.append((name, mod))
        hit = {type(m).__name__ for _, m in found}
        missing = sorted(wanted - hit)
        if missing:
            raise ValueError(
                f"zero.unit_classes: {missing[0]!r} matches no module in {type(model).__name__}; "
                f"module classes present: {', '.join(sorted(seen_classes))}")
        return found
    best, best_numel = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            numel = sum(p.numel() for p in mod.parameters())
            if numel > best_numel:
                best, best_numel = (name, mod), numel
    if best is None:
        return []
    prefix = best[0] + "." if best[0] else ""
    return [(prefix + child_name, child) for child_name, child in best[1].named_children()
            if any(p.requires_grad for p in child.parameters())]


def plan_units(model: nn.Module, group_of: dict, unit_classes, shard_world: int, align_numel: int) -> list:
    """Cut the model's trainable parameters into FlatUnits (unit modules in order, root last).

    A parameter reachable from two units (tied weights) goes to the root unit,
    whose full buffer is live for the whole forward and backward.
    """
    unit_mods = choose_unit_modules(model, unit_classes)
    prefixes = [(n + ".", i) for i, (n, _) in enumerate(unit_mods)]
    owner: dict = {}     # id(param) -> set of unit indices (len(unit_mods) = root)
    first_name: dict = {}
    by_id: dict = {}
    root = len(unit_mods)
    for pname, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        idx = next((i for pre, i in prefixes if pname.startswith(pre)), root)
        owner.setdefault(id(p), set()).add(idx)
        first_name.setdefault(id(p), pname)
        by_id[id(p)] = p
    members = [[] for _ in range(root + 1)]
    for pid, idxs in owner.items():
        members[next(iter(idxs)) if len(idxs) == 1 else root].append(pid)
    units = []
    for i in range(root + 1):
        if not members[i]:
            continue
        name, mod = unit_mods[i] if i < root else (ROOT_UNIT_NAME, model)
        ps = [by_id[pid] for pid in members[i]]
        units.append(FlatUnit(len(units), name, mod, ps, [first_name[id(p)] for p in ps],
                              group_of, shard_world, align_numel))
    return units
