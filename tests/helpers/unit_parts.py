"""Small units for the engine parts' own tests at world size 1: a model cut into flat units with
in-memory shards, built without an engine (the parts take their collaborators directly)."""

from __future__ import annotations

import torch
import torch.nn as nn

from infinity.zero.units import TensorClass, UnitShard, group_index, plan_units, shard_align_numel


class Blocks(nn.Module):
    """Three linear blocks in a ModuleList (three units) plus a root head."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def make_units(model: nn.Module, shard_params: bool = False, dtype=torch.float32) -> list:
    """The model's units, each with an in-memory shard (param, master alias, zero moments) and its
    parameters viewing the full buffer, as the engine lays them out at world size 1."""
    groups = [{"params": [p for p in model.parameters()]}]
    units = plan_units(model, group_index(model, groups), (), 1, shard_align_numel({dtype, torch.float32}))
    for unit in units:
        full = torch.zeros(unit.padded_numel, dtype=dtype)
        for slot, p in zip(unit.slots, unit.params):
            full[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            p.data = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        shard = UnitShard()
        shard.put(TensorClass.PARAM, full.clone() if shard_params else full)
        shard.alias(TensorClass.MASTER, TensorClass.PARAM)
        shard.put_zeros(TensorClass.EXP_AVG, unit.shard_numel, torch.float32, "cpu")
        shard.put_zeros(TensorClass.EXP_AVG_SQ, unit.shard_numel, torch.float32, "cpu")
        unit.shard, unit.full_param = shard, full
    return units


class NoUpdate:
    """The three questions gathers ask the update, answered for a step with no overlapped update."""

    def check_gather(self, unit) -> None:
        pass

    def with_room(self, attempt):
        return attempt()

    def updating(self, unit) -> bool:
        return False
