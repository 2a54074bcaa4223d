"""``initialize`` on a GPU never moves the whole model there before sharding it: the engine is built
(and measures the device budget) while every parameter is still where the user built it; the rest of
the module (buffers, frozen parameters) follows tensor by tensor. CUDA and the engine are stubbed, so
this runs without a GPU."""

from __future__ import annotations

import torch
import torch.nn as nn

from infinity import initialization
from infinity.zero.materialize import move_unsharded
from infinity.zero.units import group_index, plan_units
from unit_parts import Blocks


def test_initialize_hands_the_engine_a_model_still_on_the_host(monkeypatch):
    seen = {}
    moves = []

    class SpyEngine:
        def __init__(self, model, cfg, groups, **kw):
            seen["device"] = kw["device"]
            seen["param_devices"] = {p.device.type for p in model.parameters()}
            seen["moves_before"] = list(moves)

        def close(self):
            pass

    class StubOptimizer:
        def __init__(self, groups, engine, **kw):
            pass

    original_to = nn.Module.to
    monkeypatch.setattr(nn.Module, "to", lambda self, *a, **k: (moves.append(("to", a, k)), original_to(self))[1])
    monkeypatch.setattr(nn.Module, "cuda", lambda self, *a, **k: moves.append(("cuda", a, k)) or self)
    monkeypatch.setattr(initialization, "_init_distributed", lambda cfg: torch.device("cuda", 0))
    monkeypatch.setattr(initialization, "ZeroEngine", SpyEngine)
    monkeypatch.setattr(initialization, "ZeroAdamW", StubOptimizer)
    model = Blocks()
    initialization.initialize(model, {"zero": {"stage": 3}})
    assert seen["device"] == torch.device("cuda", 0)
    assert seen["param_devices"] == {"cpu"} and seen["moves_before"] == [], seen   # sharded from the host
    assert moves == []


class WithRest(nn.Module):
    """Blocks, plus what no unit holds: a buffer and a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.net = Blocks()
        self.register_buffer("mask", torch.ones(4))
        self.frozen = nn.Parameter(torch.zeros(3), requires_grad=False)

    def forward(self, x):
        return self.net(x)


def test_what_no_unit_holds_follows_the_shards_to_the_device():
    """Buffers and frozen parameters move (the meta device stands in for a GPU); unit parameters,
    which the engine has already placed, are not touched."""
    model = WithRest()
    groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    units = plan_units(model, group_index(model, groups), (), 1, 1)
    unit_ptrs = {id(p): p.data_ptr() for u in units for p in u.params}
    move_unsharded(model, units, torch.device("meta"))
    assert model.mask.is_meta and model.frozen.is_meta and not model.frozen.requires_grad
    for u in units:
        for p in u.params:
            assert p.data_ptr() == unit_ptrs[id(p)] and p.device.type == "cpu"


def test_the_device_budget_is_measured_before_any_unit_is_placed(monkeypatch, tmp_path):
    """The engine resolves its budgets (``auto``: ``torch.cuda.mem_get_info`` on a GPU) while every
    parameter still has the storage it was built with: no unit's flat buffer exists yet."""
    import infinity
    from infinity.zero import engine as engine_module

    model = Blocks()
    built = {n: p.data_ptr() for n, p in model.named_parameters()}
    seen = []
    real = engine_module.resolve_budgets

    def spy(tiers, device, headroom=None):
        seen.append({n: p.data_ptr() for n, p in model.named_parameters()} == built)
        return real(tiers, device, headroom)

    monkeypatch.setattr(engine_module, "resolve_budgets", spy)
    config = {"zero": {"stage": 3}, "offload": {"params": "host", "optimizer": "host"},
              "tiers": {"nvme_path": str(tmp_path), "host_bytes": "16MiB", "device_bytes": "16MiB"}}
    model, _ = infinity.initialize(model, config)
    infinity.engine_of(model).close()
    assert seen == [True]
    assert {n: p.data_ptr() for n, p in model.named_parameters()} != built   # and then it was sharded
