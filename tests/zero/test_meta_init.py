"""A model built on the meta device is materialized unit by unit into its home tiers (same seed -> same weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import infinity
import offload_cases
from zero_cases import VOCAB


@pytest.mark.parametrize("world_size", (1, 2))
def test_meta_gpt_matches_eager_init(worlds, tmp_path, world_size):
    spec = dict(stage=3, lr=1e-2, batch=4, tmp=str(tmp_path),
                offload=dict(optimizer="nvme", params="nvme", grads="host"))
    got = worlds(world_size).run(offload_cases.meta_init_case, spec)[0]
    want = offload_cases.meta_reference()
    assert got["tied"], "lm_head and wte must stay tied through materialization"
    assert got["params"].keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got["params"][name], w), f"{name} differs from GPT(cfg) with the same seed"


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_NoReset(), _NoReset()])

    def forward(self, x):
        return x @ self.blocks[0].w @ self.blocks[1].w


def test_meta_without_reset_parameters_names_the_module():
    with torch.device("meta"):
        model = _Holder()
    with pytest.raises(ValueError, match="_NoReset holds parameters but has no reset_parameters"):
        infinity.initialize(model, {"zero": {"stage": 3}})


def test_meta_reset_parameters_default_trains(tmp_path):
    """Without init_fn each module's reset_parameters() runs; the model then trains (world size 1)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.ModuleList([nn.Linear(16, 16) for _ in range(3)]))
    model, opt = infinity.initialize(model, {"zero": {"stage": 3}, "offload": {"optimizer": "host", "params": "host"}})
    engine = infinity.engine_of(model)
    try:
        with engine.gathered():
            assert all(not p.is_meta and torch.isfinite(p).all() for p in model.parameters())
            w = model[1][0].weight.detach().clone()
        bound = 1 / 16 ** 0.5   # nn.Linear's reset_parameters: U(-1/sqrt(in), 1/sqrt(in))
        assert w.abs().max() <= bound and w.std() > bound / 4
    finally:
        engine.close()
