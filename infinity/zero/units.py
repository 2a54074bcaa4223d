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
:class:`TensorClass`, in memory. It is one of two homes behind the same verbs
(the other is :class:`~infinity.zero.store_shard.StoreUnitShard`, for classes
placed on host or NVMe): the engine asks a shard for the parameter to gather,
folds a reduced gradient into it, takes its optimizer job fields, and saves or
loads it for checkpoints, without knowing where it lives.

A :class:`FlatUnit` is also the unit's one runtime object during a step (the
role of FSDP2's ``FSDPParamGroup``, which likewise keeps its sharded state and
its training state apart): where its full parameters are (:class:`UnitState`,
with the in-flight all-gather) and why the step wants them (:class:`UnitUse`),
both checked on every change; the gradients still to arrive in this backward,
which slots were written since ``zero_grad``, whether its gradient shard still
holds values from before ``zero_grad``, the
bytes of activations its forward moved out (``zero.activation_offload``),
whether the running optimizer step has updated it, and whether an update of
its shard runs that its next use must wait for or refuse (:class:`UpdateMark`,
checked too; a launched update's mark carries the jobs to wait for). The
gathers, the gradient reducer, the activation offload and the update schedules
read and set these. The unit hooks call its verbs (:meth:`FlatUnit.pre_forward`,
``post_forward``, ``pre_backward``, ``pre_recompute``, ``saves_begin``,
``saves_end``), which drive the parts the engine bound to it once
(:class:`UnitParts`); what is still kept apart is the cap's release order
(:class:`~infinity.zero.live_units.LiveUnits`) and its folds left pending, in
the rank's one queue of them, tagged with the unit, oldest first
(:class:`~infinity.zero.grad_staging.FoldStaging`: the staging bounds finish
the oldest of any unit).
"""

from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from infinity.transitions import Transitions

__all__ = [
    "DIRECT_IO_ALIGN_BYTES", "UnitState", "UnitUse", "UpdateMark", "TensorClass", "ParamSlot", "UnitParts", "FlatUnit",
    "UnitShard",
    "choose_unit_modules", "plan_units", "shard_align_numel", "group_index", "check_structure", "memory_bytes",
]

DIRECT_IO_ALIGN_BYTES = 4096
ROOT_UNIT_NAME = "<root>"


class UnitState(enum.Enum):
    """Where a unit's full (gathered) compute-precision parameters are."""

    SHARDED = "sharded"      # only this rank's shard exists; the full buffer's storage is freed
    GATHERING = "gathering"  # full buffer allocated, all-gather launched, not yet waited on
    GATHERED = "gathered"    # full buffer holds every rank's shard; parameters are usable views


_MOVES = Transitions("unit gather state", {
    UnitState.SHARDED: {UnitState.GATHERING},
    UnitState.GATHERING: {UnitState.GATHERED},
    UnitState.GATHERED: {UnitState.SHARDED},
})


class UnitUse(enum.Enum):
    """Why the step wants a unit's full parameters; decides whether ``prefetch.max_live_bytes`` may release
    them (:mod:`infinity.zero.live_units`)."""

    IDLE = "idle"        # not wanted by the step: sharded, or gathered outside it (engine.gathered())
    AHEAD = "ahead"      # gathered early by prefetch, not used yet: released first when room is needed
    IN_USE = "in_use"    # its forward or backward is running (the root: through backward): never released
    KEPT = "kept"        # forward done, kept for backward (reshard_after_forward off): released under pressure


_USES = Transitions("unit use", {
    UnitUse.IDLE: {UnitUse.AHEAD, UnitUse.IN_USE},
    UnitUse.AHEAD: {UnitUse.IN_USE, UnitUse.IDLE},
    UnitUse.IN_USE: {UnitUse.KEPT, UnitUse.IDLE},
    UnitUse.KEPT: {UnitUse.IN_USE, UnitUse.IDLE},
})


class UpdateMark(enum.Enum):
    """Whether an update of the unit's shard runs that its next gather must not read past; nothing prefetches
    a marked unit (the update schedules set and clear the mark: :mod:`infinity.zero.update`)."""

    NONE = "none"            # no update of its shard runs unwaited for
    BEGUN = "begun"          # begun in the step's last backward (update_at backward, speculative): a gather
                             # is refused until the step ends
    LAUNCHED = "launched"    # launched by optimizer.step() (update_at next_forward): its next use waits for it


_MARKS = Transitions("unit update mark", {
    UpdateMark.NONE: {UpdateMark.BEGUN, UpdateMark.LAUNCHED},
    UpdateMark.BEGUN: {UpdateMark.NONE},       # the step ended, or was aborted or dropped
    UpdateMark.LAUNCHED: {UpdateMark.NONE},    # waited for before its use, drained, or aborted
})


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


@dataclass(frozen=True)
class UnitParts:
    """What a unit's hook verbs drive, bound once by the engine (none of them holds the engine): stage 3's
    ``gathers`` (:class:`~infinity.zero.gathers.UnitGathers`; below it the no-op
    :class:`~infinity.zero.gathers.ReplicatedParams`), the ``update`` schedule (a launched update is
    waited for before use), the ``activations`` offload (None: ``zero.activation_offload`` is off) and
    ``timed``, the context the engine's verbs run in (:meth:`~infinity.zero.stats.EngineStats.engine_time`)."""

    gathers: Any
    update: Any
    activations: Any
    timed: Callable[[], contextlib.AbstractContextManager]


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
        self.full_param: torch.Tensor | None = None   # stored dtype, padded_numel; storage freed when SHARDED
        # a compute dtype wider than the stored one (fp32 over bf16): the gathered unit upcast, the buffer the
        # parameters view while GATHERED (full_param's storage is freed once it is filled); else None
        self.compute_param: torch.Tensor | None = None
        self.full_grad: torch.Tensor | None = None    # reduce dtype, padded_numel, while gradients accumulate
        self.shard: UnitShard | None = None
        # ---- runtime state of the step (reset by the engine; see the module doc)
        self.gather = None                  # the in-flight all-gather while GATHERING (UnitGathers')
        self.use = UnitUse.IDLE             # why the step wants the full parameters (set_use: checked)
        self.grads_pending = len(slots)     # parameter gradients still to arrive in this backward
        self.reduced = False                # this backward's reduction of the unit has been launched
        self.unwritten: set | None = None   # slot offsets not written since zero_grad (None: all real)
        self.grad_stale = False             # the gradient shard predates zero_grad: the next fold copies
        # the clip norm's squared sums of the gradient shard, per piece start, taken at its last fold while
        # it was in memory (GradReducer.clip reads none back); None: not taken
        self.grad_square_sums: dict | None = None
        self.offloaded_bytes = 0            # activations its last training forward moved out of the device
        self.updated = False                # the running optimizer step has updated this unit's shard
        self.chunks_updated = 0             # ... or its first chunks so far (a step that failed part-way)
        self.update_mark = UpdateMark.NONE  # an update of its shard runs, not yet waited for (set_update_mark)
        self.launched_jobs: tuple = ()      # LAUNCHED: the names of the update's jobs its next use waits for
        self.parts: UnitParts | None = None  # what the hook verbs drive (bind)

    # ---- the verbs the unit hooks call (infinity.zero.hooks; FSDP2's FSDPParamGroup.pre_forward and kin)

    def bind(self, parts: UnitParts) -> None:
        """Give the unit the parts its verbs drive (the engine does, once, before the hooks are installed)."""
        self.parts = parts

    def pre_forward(self, training: bool) -> None:
        """The unit's forward starts: its launched update is waited for (``update_at`` next_forward), stage 3
        gathers it for use (within ``prefetch.max_live_bytes``; a training pass records the use in the trace
        and prefetches along it)."""
        with self.parts.timed():
            self.parts.update.before_use(self)
            self.parts.gathers.use_unit(self, training)

    def post_forward(self, training: bool) -> None:
        """The unit's forward is done: a training pass releases it (``reshard_after_forward``) or keeps it for
        backward; any other pass releases it."""
        with self.parts.timed():
            if training:
                self.parts.gathers.after_forward(self)
            else:
                self.parts.gathers.release(self)

    def pre_backward(self) -> None:
        """The unit's backward is about to run (the engine has entered backward): gathered and in use until
        its gradients are reduced (then released)."""
        with self.parts.timed():
            self.parts.gathers.use_unit(self, training=True)

    def pre_recompute(self) -> None:
        """Activation checkpointing reruns the unit's forward inside its backward: it is gathered already."""
        with self.parts.timed():
            self.parts.gathers.acquire(self)

    def saves_begin(self) -> None:
        """The unit's training forward starts: what autograd saves for its backward goes to the tier."""
        self.parts.activations.begin_unit(self)

    def saves_end(self) -> None:
        """The unit's forward ended (or raised): autograd's saves are kept again; a failed write raises."""
        self.parts.activations.end_unit()

    # ---- the step's state

    def clear_update(self) -> None:
        """A new optimizer step: nothing of this unit's shard is updated yet. The update mark is the
        schedule's to clear (a launched update is waited for after its step has ended)."""
        self.updated, self.chunks_updated = False, 0

    def set_update_mark(self, new: UpdateMark, launched_jobs=()) -> None:
        """Mark an update of this unit's shard begun or launched (``launched_jobs``: the names of its jobs),
        or waited for (``NONE``): a checked transition; marking it as it is already marked changes nothing
        but the jobs."""
        if new is not self.update_mark:
            self.update_mark = _MARKS.check(self.update_mark, new, f"unit {self.name}", what="update mark transition")
        self.launched_jobs = tuple(launched_jobs)

    def start_backward_pass(self) -> None:
        """A new backward pass: every parameter's gradient is still to come."""
        self.grads_pending, self.reduced = len(self.slots), False

    def set_use(self, new: UnitUse) -> UnitUse:
        """Change why the step wants this unit (a checked transition); returns the use it had."""
        old = self.use
        if new is not old:
            self.use = _USES.check(old, new, f"unit {self.name}", what="use transition")
        return old

    @property
    def is_root(self) -> bool:
        return self.name == ROOT_UNIT_NAME

    def transition(self, new: UnitState) -> None:
        self.state = _MOVES.check(self.state, new, f"unit {self.name}")
        if new is UnitState.GATHERED:
            self._point_params(live=True)
        elif new is UnitState.SHARDED:
            self._point_params(live=False)

    def _point_params(self, live: bool) -> None:
        """Parameters are views of the full buffer while it is live and empty tensors otherwise:
        reading a view of a freed storage would crash (segfault on CPU) instead of showing nothing.
        Autograd's saved views hold the storage object itself, which a gather refills in place."""
        full = self.full_param if self.compute_param is None else self.compute_param
        if full is None:
            return
        if live:
            for slot, p in zip(self.slots, self.params):
                p.data = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        else:
            empty = full.new_empty(0)
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
    """This rank's tensors of one unit, in memory. Tensors of a class may alias (see TensorClass.MASTER).

    The verbs the engine uses are the same for every home (see the module doc);
    here each is the plain in-memory operation.
    """

    # where the shard queues folds it leaves pending (a stored shard's FoldStaging); in memory every fold
    # is done at once
    staging = None

    def __init__(self):
        self._tensors: dict = {}

    # ---- contents
    def put(self, cls: TensorClass, tensor: torch.Tensor) -> None:
        self._tensors[cls] = tensor

    def put_zeros(self, cls: TensorClass, numel: int, dtype: torch.dtype, device, layout=None) -> None:
        """Zeros for ``numel`` elements; ``layout`` (a :class:`~infinity.optim.moment_codes.MomentFormat`:
        int8 moments are rows of blocks) gives the tensor's shape, else flat."""
        shape = layout.shape(numel) if layout is not None else (numel,)
        self._tensors[cls] = torch.zeros(shape, dtype=dtype, device=device)

    def alias(self, cls: TensorClass, same_as: TensorClass) -> None:
        """``cls`` is the very tensor of ``same_as``."""
        self._tensors[cls] = self.get(same_as)

    def get(self, cls: TensorClass) -> torch.Tensor:
        """The class's tensor, for reading or writing."""
        try:
            return self._tensors[cls]
        except KeyError:
            raise KeyError(f"unit shard holds no {cls.value} tensor") from None

    def read(self, cls: TensorClass) -> torch.Tensor:
        """Like :meth:`get` for a caller that will not write (a store-backed shard then skips the write-back)."""
        return self.get(cls)

    def has(self, cls: TensorClass) -> bool:
        return cls in self._tensors

    def keys(self, cls: TensorClass) -> tuple:
        """The store keys of a stored class (one per chunk); (): held in memory (always, here)."""
        return ()

    def is_alias(self, cls: TensorClass, other: TensorClass) -> bool:
        return self.has(cls) and self.has(other) and self.get(cls) is self.get(other)

    def resident_bytes(self) -> int:
        """Bytes of NVMe-placed chunks homed in host memory instead: none (nothing here is stored)."""
        return 0

    @contextlib.contextmanager
    def update(self, cls: TensorClass):
        """``with shard.update(cls) as t:`` change a class in place."""
        yield self.get(cls)

    # ---- the engine's verbs
    def param_for_gather(self, into: torch.Tensor | None = None):
        """(the parameter shard an all-gather reads, a call for when the gather is done, or None).
        ``into``: the full buffer, when it is this rank's shard (one rank, :attr:`gathers_in_place`): a
        shard assembled from pieces is assembled there; one in memory is returned as it is."""
        return self.get(TensorClass.PARAM), None

    def prefetch_param(self) -> None:
        """Start bringing the parameter shard toward the device (stage-3 prefetch); nothing in memory."""

    def fold_grad(self, reduced: torch.Tensor, first: bool, inspect=None):
        """Fold a reduce-scattered gradient into the shard: a copy when ``first`` (the shard predates
        zero_grad), else a sum. ``inspect(result)`` sees the folded gradient while it is in memory
        (fp16's overflow check, the clip norm's squared sums), so nothing is read back for it. Returns the
        future of a write still in flight, or None."""
        grad = self.get(TensorClass.GRAD)
        if first:
            grad.copy_(reduced)
        else:
            grad.add_(reduced)
        if inspect is not None:
            inspect(grad)
        return None

    def chunks(self) -> list:
        """Element ranges of the optimizer jobs this shard makes; ``[None]``: one job, the whole shard."""
        return [None]

    def job_field(self, cls: TensorClass, chunk: int = 0):
        """What the optimizer :class:`~infinity.optim.shard_job.ShardJob` of chunk ``chunk``
        takes for ``cls``: a store key, or the in-memory tensor."""
        return self.get(cls)

    def consumed_after_update(self, chunk: int = 0) -> tuple:
        """Store keys of chunk ``chunk`` whose newest bytes are dead once its update is done (none here)."""
        return ()

    def dropped_after_update(self, chunk: int = 0) -> tuple:
        """Store keys of chunk ``chunk`` whose host copy is freed once written home (none here)."""
        return ()

    def set_step_speculates(self, speculating: bool) -> None:
        """Whether this step's last backward updates speculatively (a store-backed shard may then fold
        its gradients differently); nothing here."""

    def write_back_lent(self) -> None:
        """Finish what earlier ``get`` calls lent out (a store-backed shard writes it home)."""

    def write_back_dirty(self) -> list:
        """Start writing home copies that are newer than their home (after a failed write); futures."""
        return []

    def release(self) -> None:
        """Forget the tensors (the engine is closing)."""
        self._tensors.clear()


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


def group_index(model: nn.Module, param_groups: list) -> dict:
    """id(param) -> its param group's index; every trainable parameter in exactly one group."""
    group_of = {}
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            if id(p) in group_of:
                raise ValueError(f"initialize: a parameter appears in param groups {group_of[id(p)]} and {gi}")
            group_of[id(p)] = gi
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"initialize: {type(model).__name__} has no trainable parameters "
                         "(none with requires_grad=True); there is nothing to train")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(f"initialize: parameter {missing[0]!r} requires grad but is in no param group "
                         f"({len(missing)} such); add it to a group or set requires_grad=False")
    foreign = [gi for pid, gi in group_of.items() if pid not in names]
    if foreign:
        raise ValueError(f"initialize: param group {foreign[0]} holds a tensor that is not a parameter of the model")
    by_name = dict(model.named_parameters())
    frozen = [names[pid] for pid in group_of if not by_name[names[pid]].requires_grad]
    if frozen:
        raise ValueError(f"initialize: parameter {frozen[0]!r} is in a param group but has requires_grad=False")
    return group_of


def check_structure(units: list, coll) -> None:
    """Every rank must have cut the same units (names, sizes, parameters, groups); raise naming the first
    rank and difference otherwise (before any collective that would hang on a mismatch)."""
    mine = [u.signature() for u in units]
    every = coll.all_gather_object(mine)
    for r, theirs in enumerate(every):
        if theirs == every[0]:
            continue
        if len(theirs) != len(every[0]):
            detail = f"{len(theirs)} units vs {len(every[0])}"
        else:
            a, b = next((a, b) for a, b in zip(every[0], theirs) if a != b)
            detail = f"unit {b[0]!r}: {_first_difference(a, b)}"
        raise RuntimeError(
            f"initialize: rank {r} disagrees with rank 0 on the model's structure ({detail}); "
            "every rank must build the same model with the same param groups")


def _first_difference(a, b) -> str:
    if a[1] != b[1]:
        return f"padded size {b[1]} vs {a[1]}"
    for sa, sb in zip(a[2], b[2]):
        if sa != sb:
            return f"parameter {sb[0]!r} shape {sb[1]} group {sb[2]} vs {sa[0]!r} shape {sa[1]} group {sa[2]}"
    return f"{len(b[2])} parameters vs {len(a[2])}"


def memory_bytes(units: list, arena: torch.Tensor | None) -> dict:
    """Bytes the units hold in memory now, by class: params, grads, optimizer. Each storage is counted
    once (views share one); freed buffers and classes kept in the store count nothing."""
    seen, out = set(), {"params": 0, "grads": 0, "optimizer": 0}
    kinds = {TensorClass.PARAM: "params", TensorClass.GRAD: "grads"}

    def count(kind, t):
        if t is None:
            return
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            return
        seen.add(st.data_ptr())
        out[kind] += st.nbytes()

    for u in units:
        count("params", u.full_param)
        count("params", u.compute_param)   # the upcast copy a gathered unit computes in, if any
        count("grads", u.full_grad)
        for cls in TensorClass:
            if u.shard is not None and u.shard.has(cls) and not u.shard.keys(cls):
                count(kinds.get(cls, "optimizer"), u.shard.get(cls))
    count("grads", arena)
    return out
