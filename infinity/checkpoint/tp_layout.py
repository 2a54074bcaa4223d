"""Tensor-parallel layout in checkpoints: saving it, and loading at another number of ``tp`` ways.

A checkpoint saved at ``T`` tensor-parallel ways holds, for every ``tp`` rank
``t``, that rank's units (local shapes, the same layout on every ``t``) sharded
over the dp ranks. The manifest's ``tensor_parallel`` says ``T`` and, for each
split parameter, ``[dim, parts]`` (:class:`~infinity.parallel.tensor_parallel.TPSpec`).

Loading at the same ``T`` reads this ``tp`` rank's files by element ranges, as
without TP. Loading at another ``T'`` (1 included) goes parameter by parameter:
each split parameter is reassembled from the ``T`` saved slices
(:func:`~infinity.parallel.tensor_parallel.assemble`), cut again for this rank
(:func:`~infinity.parallel.tensor_parallel.shard_of`), and the part inside this
rank's dp shard is copied in; a replicated one is read from saved ``tp`` rank 0.
Peak extra memory: one whole parameter (fp32) at a time. ``consolidate`` uses
:func:`read_full_param` the same way.
"""

from __future__ import annotations

import torch

from infinity.checkpoint.tensor_file import CheckpointError
from infinity.parallel.tensor_parallel import TPSpec, assemble, full_shape, shard_of

__all__ = ["tp_manifest", "check_full_layout", "read_full_param", "load_unit_resharded", "saved_spec"]


def tp_manifest(tp) -> dict:
    """The manifest's ``tensor_parallel`` entry for the engine's TP state (None: no tensor parallelism)."""
    if tp is None:
        return {"size": 1, "specs": {}}
    return {"size": tp.size, "specs": {n: [s.dim, s.parts] for n, s in sorted(tp.specs.items())}}


def saved_spec(ckpt, name: str) -> TPSpec | None:
    d = ckpt.tp_specs.get(name)
    return TPSpec(*d) if d is not None else None


def _full_slots(unit: dict, size: int, spec_of) -> list:
    return [(s["name"], full_shape(s["shape"], spec_of(s["name"]), size), s["group_index"]) for s in unit["slots"]]


def check_full_layout(ckpt, layout: list, tp, num_groups: int) -> None:
    """Saved and current layouts describe the same full model (names, full shapes, groups) when their
    tensor-parallel ways differ; a parameter split differently in the two is refused."""
    where = f"checkpoint {ckpt.dir}"
    size = tp.size if tp is not None else 1
    if len(layout) != len(ckpt.units):
        raise CheckpointError(f"{where}: saved with {len(ckpt.units)} units, the model has {len(layout)}")
    for mine, saved in zip(layout, ckpt.units):
        a = _full_slots(mine, size, lambda n: tp.spec(n) if tp is not None else None)
        b = _full_slots(saved, ckpt.tp_size, lambda n: saved_spec(ckpt, n))
        if mine["name"] != saved["name"] or a != b:
            diff = next(((x, y) for x, y in zip(a, b) if x != y), (len(a), len(b)))
            raise CheckpointError(f"{where}: unit {saved['name']!r} differs from the model's (full shapes, saved "
                                  f"at tensor parallel {ckpt.tp_size}, loading at {size}): {diff[1]} vs {diff[0]}")
        for s in mine["slots"]:
            theirs, ours = saved_spec(ckpt, s["name"]), (tp.spec(s["name"]) if tp is not None else None)
            if theirs is not None and ours is not None and theirs != ours:
                raise CheckpointError(f"{where}: {s['name']!r} was split as {theirs}, the model splits it as {ours}")
    saved_groups = len(ckpt.manifest["optimizer"]["param_groups"])
    if saved_groups != num_groups:
        raise CheckpointError(f"{where}: saved with {saved_groups} param groups, the optimizer has {num_groups}")


def read_full_param(reader, ckpt, unit_index: int, slot: dict, tensor: str) -> torch.Tensor:
    """The whole fp32 parameter of saved ``slot`` (its ``tensor``: master, exp_avg, exp_avg_sq)."""
    lo, hi = int(slot["offset"]), int(slot["offset"]) + int(slot["numel"])
    spec = saved_spec(ckpt, slot["name"])
    ranks = range(ckpt.tp_size) if spec is not None else (0,)
    pieces = []
    for t in ranks:
        out = torch.empty(hi - lo, dtype=torch.float32)
        reader.read(unit_index, tensor, lo, hi, out, tp_rank=t)
        pieces.append(out.view(slot["shape"]))
    return assemble(pieces, spec) if spec is not None else pieces[0]


def load_unit_resharded(engine, unit, reader, ckpt, tensors, lo: int, hi: int) -> dict:
    """This rank's unpadded elements [lo, hi) of ``unit``'s flat buffer, per saved tensor, built parameter by
    parameter from a checkpoint saved at another number of tensor-parallel ways: {tensor: fp32 (hi - lo)}."""
    saved = {s["name"]: s for s in ckpt.units[unit.index]["slots"]}
    tp = engine.tp
    out = {name: torch.zeros(hi - lo, dtype=torch.float32) for name in tensors}
    for slot in unit.slots:
        a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        if a >= b:
            continue
        spec = tp.spec(slot.name) if tp is not None else None
        for name in tensors:
            full = read_full_param(reader, ckpt, unit.index, saved[slot.name], name)
            local = shard_of(full, spec, tp.rank, tp.size, slot.name) if spec is not None else full
            if tuple(local.shape) != tuple(slot.shape):
                raise CheckpointError(f"checkpoint {ckpt.dir}: {slot.name!r} re-split to {list(local.shape)}, the "
                                      f"model holds {list(slot.shape)}")
            flat = local.reshape(-1)
            out[name][a - lo:b - lo] = flat[a - slot.offset:b - slot.offset]
    return out
