"""Flat-unit layout, the unit state machine, the world-size-1 engine path and the AdamW math."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import infinity
from infinity.optim.cpu_adam import adamw_
from infinity.comm.collectives import LocalCollectives
from infinity.zero.units import (FlatUnit, TensorClass, UnitState, UpdateMark, choose_unit_modules, plan_units,
                                  shard_align_numel)
from zero_cases import CrossTied, build_model, global_batch


def _group_of(model, groups=None):
    out = {}
    for gi, ps in enumerate(groups or [list(model.parameters())]):
        for p in ps:
            out[id(p)] = gi
    return out


def test_shard_align_numel():
    assert shard_align_numel({torch.float32}) == 1024
    assert shard_align_numel({torch.float32, torch.bfloat16}) == 2048
    assert shard_align_numel({torch.float16, torch.float32}) == 2048


@pytest.mark.parametrize("world", (1, 2, 3, 4))
def test_gpt_layout(world):
    model = build_model("gpt")
    units = plan_units(model, _group_of(model), (), world, 2048)
    assert [u.name for u in units] == ["transformer.h.0", "transformer.h.1", "<root>"]
    seen = [id(p) for u in units for p in u.params]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each parameter once, tied ones too
    root = units[-1]
    assert any(s.name == "transformer.wte.weight" for s in root.slots)
    assert not any(s.name == "lm_head.weight" for s in root.slots)  # the tie is one parameter
    for u in units:
        assert u.padded_numel % world == 0 and u.padded_numel >= u.numel
        for itemsize in (2, 4):
            assert (u.shard_numel * itemsize) % 4096 == 0
        ends = [s.offset + s.numel for s in u.slots]
        assert [s.offset for s in u.slots] == [0] + ends[:-1]  # packed, in order
        assert ends[-1] == u.numel


def test_tie_across_units_goes_to_root():
    model = CrossTied()
    units = plan_units(model, _group_of(model), (), 2, 1024)
    names = {u.name: [s.name for s in u.slots] for u in units}
    assert "blocks.0.fc.weight" in names["<root>"]
    assert "blocks.0.fc.weight" not in names["blocks.0"] and "blocks.2.fc.weight" not in names["blocks.2"]
    assert "blocks.2.fc.bias" in names["blocks.2"]


def test_groups_are_contiguous_ranges():
    model = build_model("gpt")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    units = plan_units(model, _group_of(model, [decay, no_decay]), (), 2, 1024)
    for u in units:
        groups = [g for g, _, _ in u.group_ranges]
        assert groups == sorted(set(groups))  # one range per group
        for g, a, b in u.group_ranges:
            inside = [s for s in u.slots if a <= s.offset < b]
            assert all(s.group_index == g for s in inside)
            assert sum(s.numel for s in inside) == b - a


def test_largest_module_list_wins():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
            self.big = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    assert [n for n, _ in choose_unit_modules(Two())] == ["big.0", "big.1"]


class _Params(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in sizes)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=8), data=st.data(),
       world=st.integers(1, 8), align=st.sampled_from((1, 1024, 2048)))
def test_shard_ranges_cover_every_element_once(sizes, data, world, align):
    model = _Params(sizes)
    groups = data.draw(st.lists(st.integers(0, 2), min_size=len(sizes), max_size=len(sizes)))
    group_of = {id(p): g for p, g in zip(model.parameters(), groups)}
    unit = FlatUnit(0, "<root>", model, list(model.parameters()), [str(i) for i in range(len(sizes))],
                    group_of, world, align)
    assert unit.padded_numel % (world * align) == 0 and unit.padded_numel - unit.numel < world * align
    covered = torch.zeros(unit.padded_numel, dtype=torch.int64)
    for r in range(world):
        for g, lo, hi in unit.shard_group_ranges(r):
            base = r * unit.shard_numel
            covered[base + lo:base + hi] += 1
            assert all(s.group_index == g for s in unit.slots
                       if s.offset < base + hi and s.offset + s.numel > base + lo)
    assert covered[:unit.numel].eq(1).all() and covered[unit.numel:].eq(0).all()


def test_unit_state_transitions_are_checked():
    model = _Params([3])
    unit = FlatUnit(0, "u", model, list(model.parameters()), ["p"], {id(model.ps[0]): 0}, 1, 1)
    assert unit.state is UnitState.GATHERED
    unit.full_param = torch.zeros(4)
    with pytest.raises(RuntimeError, match="unit u: illegal transition gathered -> gathering"):
        unit.transition(UnitState.GATHERING)
    unit.transition(UnitState.SHARDED)
    assert model.ps[0].numel() == 0
    with pytest.raises(RuntimeError, match="sharded -> gathered"):
        unit.transition(UnitState.GATHERED)
    unit.transition(UnitState.GATHERING)
    unit.transition(UnitState.GATHERED)
    assert model.ps[0].shape == (3,) and model.ps[0].data_ptr() == unit.full_param.data_ptr()


def test_unit_update_mark_transitions_are_checked():
    """A unit's update is begun (in backward) or launched (by the step) only from unmarked, and goes back
    to unmarked before the other; a launched mark carries its jobs, which unmarking forgets."""
    model = _Params([3])
    unit = FlatUnit(0, "u", model, list(model.parameters()), ["p"], {id(model.ps[0]): 0}, 1, 1)
    assert unit.update_mark is UpdateMark.NONE and unit.launched_jobs == ()
    unit.set_update_mark(UpdateMark.BEGUN)
    unit.set_update_mark(UpdateMark.BEGUN)   # begun again (submitted twice) changes nothing
    with pytest.raises(RuntimeError, match="unit u: illegal update mark transition begun -> launched"):
        unit.set_update_mark(UpdateMark.LAUNCHED, ["u"])
    assert unit.update_mark is UpdateMark.BEGUN
    unit.set_update_mark(UpdateMark.NONE)
    unit.set_update_mark(UpdateMark.LAUNCHED, ["u#0", "u#1"])
    assert unit.update_mark is UpdateMark.LAUNCHED and unit.launched_jobs == ("u#0", "u#1")
    with pytest.raises(RuntimeError, match="launched -> begun"):
        unit.set_update_mark(UpdateMark.BEGUN)
    unit.set_update_mark(UpdateMark.NONE)
    assert unit.update_mark is UpdateMark.NONE and unit.launched_jobs == ()
    unit.clear_update()   # a new step's reset leaves the mark to the schedule
    unit.set_update_mark(UpdateMark.LAUNCHED, ["u"])
    unit.clear_update()
    assert unit.update_mark is UpdateMark.LAUNCHED and unit.launched_jobs == ("u",)


def test_stage3_world1_params_are_views_released_between_uses():
    model, opt = infinity.initialize(build_model("gpt"), {"zero": {"stage": 3}})
    engine = infinity.engine_of(model)
    assert isinstance(engine.coll, LocalCollectives)
    assert all(u.state is UnitState.SHARDED for u in engine.units)
    assert all(u.full_param.untyped_storage().nbytes() == 0 for u in engine.units)
    assert all(p.numel() == 0 for p in model.parameters())  # released: empty, safe to print
    repr(list(model.parameters()))
    with engine.gathered():
        unit = engine.units[0]
        for slot, p in zip(unit.slots, unit.params):
            assert p.untyped_storage().data_ptr() == unit.full_param.untyped_storage().data_ptr()
            assert p.data_ptr() == unit.full_param.data_ptr() + slot.offset * p.element_size()
        before = [p.detach().clone() for p in model.parameters()]
    ids = global_batch(0, 2)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is None for p in model.parameters())  # gradients live in the shards
    opt.step()
    opt.zero_grad()
    assert all(u.state is UnitState.SHARDED for u in engine.units)
    with engine.gathered():
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    last = engine.stats.last_step
    assert set(last) >= {"forward_s", "backward_s", "step_s", "comm_wait_s", "collectives", "steps"}
    assert last["steps"] == 1 and last["collectives"]["calls"]["reduce_scatter"] == len(engine.units)


def test_eval_forward_under_no_grad_releases_units():
    model, _ = infinity.initialize(build_model("gpt"), {"zero": {"stage": 3, "reshard_after_forward": False}})
    engine = infinity.engine_of(model)
    with torch.no_grad():
        model(global_batch(0, 2))
    assert all(u.state is UnitState.SHARDED for u in engine.units)


def test_adamw_matches_torch_bitwise():
    torch.manual_seed(0)
    p0, grads = torch.randn(1000), [torch.randn(1000) for _ in range(4)]
    ref = nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mine, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
    for step, g in enumerate(grads, 1):
        ref.grad = g.clone()
        opt.step()
        adamw_(mine, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    assert torch.equal(mine, ref.detach())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_cuda_world1_trains_like_cpu_reference(stage):
    """On CUDA (world 1, no process group): bf16 compute tracks the fp32 CPU reference loosely."""
    import zero_cases
    spec = dict(model="gpt", steps=3, batch=8, lr=1e-2, stage=stage, dtype="bf16")
    ref = zero_cases.reference_run(spec)
    model, opt = infinity.initialize(build_model("gpt"), zero_cases.config_for(spec))
    assert next(model.parameters()).is_cuda
    losses = []
    for step in range(3):
        ids = global_batch(step, 8).cuda()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    engine = infinity.engine_of(model)
    with engine.gathered():
        got = {"losses": losses, "norms": [], "params": {n: p.detach().float().cpu() for n, p in model.named_parameters()}}
    zero_cases.compare(got, ref, loss_rtol=5e-3, max_update_error=0.25)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_reduce_scatter_runs_during_backward_from_stage_2(stage):
    """Stages 2-3 reduce a unit as soon as its backward is done (block 1 before block 0's grads
    arrive); stage 1 defers the whole reduction to the step."""
    model, opt = infinity.initialize(build_model("gpt"), {"zero": {"stage": stage}})
    engine = infinity.engine_of(model)
    seen = []
    w = model.transformer.h[0].mlp.c_fc.weight
    w.register_post_accumulate_grad_hook(lambda p: seen.append(engine.coll.counters.calls["reduce_scatter"]))
    ids = global_batch(0, 2)
    model(ids, labels=ids).loss.backward()
    assert len(seen) == 1
    assert seen[0] == (0 if stage == 1 else 1)  # block 1's unit, and only it, is reduced by then
    opt.step()
    assert engine.stats.last_step["collectives"]["calls"]["reduce_scatter"] == len(engine.units)


class _Skippy(nn.Module):
    """Two blocks; ``skip_last`` leaves block 1's parameters without a gradient."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.skip_last = False

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if not (self.skip_last and i == 1):
                x = b(x)
        return x.square().mean()


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_parameter_without_gradient_reads_zero_after_zero_grad(stage):
    """zero_grad clears lazily (first write copies); a slot nobody writes must still read as zero."""
    torch.manual_seed(0)
    model, opt = infinity.initialize(_Skippy(), {"zero": {"stage": stage}})
    engine = infinity.engine_of(model)
    x = torch.randn(4, 8)
    model(x).backward()
    opt.step()
    opt.zero_grad()
    model.skip_last = True
    model(x).backward()
    engine._finish_grads()

    def grad_of(param):
        unit = next(u for u in engine.units if any(p is param for p in u.params))
        slot = next(s for s, p in zip(unit.slots, unit.params) if p is param)
        return unit.shard.get(TensorClass.GRAD)[slot.offset:slot.offset + slot.numel]

    assert grad_of(model.blocks[1].weight).eq(0).all()
    assert grad_of(model.blocks[0].weight).ne(0).any()
