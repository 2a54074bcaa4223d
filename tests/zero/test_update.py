"""The optimizer update on its own, at world size 1: every unit shard one job through the pipeline,
equal to torch.optim.AdamW on the same values, gradients read times the step's multiplier, step
counts advanced only by the caller."""

from __future__ import annotations

import pytest
import torch

from infinity.comm.collectives import LocalCollectives
from infinity.config import Config
from infinity.trace import Tracer
from infinity.zero.hyper import GroupHyper
from infinity.zero.stage import StagePolicy
from infinity.zero.units import TensorClass
from infinity.zero.schedules import make_schedule
from infinity.zero.update import UpdateSchedule
from unit_parts import Blocks, make_units

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _update(units, groups, overlap: bool = False) -> UpdateSchedule:
    # overlap is config-valid only with the optimizer offloaded; the update itself runs in-memory jobs too
    sections = {"optimizer": {"threads": 1, "update_at": "auto" if overlap else "step"}, "zero": {"stage": 2}}
    if overlap:
        sections["offload"] = {"optimizer": "host"}
    config = Config.from_dict(sections)
    return make_schedule(config.update_schedule().at, units, None, LocalCollectives(), StagePolicy.of(2), 0, 0,
                         GroupHyper(groups), Tracer(0), config.optimizer)


def _with_grads(units, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    grads = {}
    for u in units:
        flat = torch.zeros(u.padded_numel)
        for s in u.slots:
            grads[s.name] = torch.randn(s.shape, generator=g)
            flat[s.offset:s.offset + s.numel] = grads[s.name].reshape(-1)
        u.shard.put(TensorClass.GRAD, flat)
    return grads


@pytest.mark.parametrize("grad_scale", (1.0, 0.25))
def test_two_steps_equal_torch_adamw(grad_scale):
    model, ref = Blocks(), Blocks()
    ref.load_state_dict(model.state_dict())
    units = make_units(model)
    groups = [dict(params=list(model.parameters()), **HYPER)]
    update = _update(units, groups)
    torch_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    by_name = dict(ref.named_parameters())
    try:
        for step in range(2):
            grads = _with_grads(units, step)
            update.step(grad_scale)
            assert all(u.updated for u in units)
            update.hyper.count_step()
            for u in units:
                u.clear_update()
            for name, p in by_name.items():
                p.grad = grads[name] * grad_scale
            torch_opt.step()
        for name, p in model.named_parameters():
            assert torch.allclose(p, by_name[name], rtol=1e-6, atol=1e-7), name
        assert update.hyper.group_steps == [2]
    finally:
        update.close()


def test_a_rerun_after_every_unit_is_updated_updates_nothing_twice():
    model = Blocks()
    units = make_units(model)
    update = _update(units, [dict(params=list(model.parameters()), **HYPER)])
    try:
        _with_grads(units, 0)
        update.step(1.0)
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        update.step(1.0)   # the same step again (as after a failure): units marked updated are skipped
        assert all(torch.equal(p, after[n]) for n, p in model.named_parameters())
    finally:
        update.close()


def test_overlapped_units_are_submitted_as_they_become_final_and_the_root_after_backward():
    model = Blocks()
    units = make_units(model)
    update = _update(units, [dict(params=list(model.parameters()), **HYPER)], overlap=True)
    try:
        _with_grads(units, 0)
        blocks, root = units[:3], units[3]
        assert root.is_root
        update.begin_backward(sync=True)   # the step's only (so last) backward
        for u in reversed(blocks):   # backward finishes the last block first
            update.unit_final(u, 1.0)
            assert update.updating(u)
        update.unit_final(root, 1.0)
        assert not update.updating(root)   # deferred to the end of backward
        with pytest.raises(RuntimeError, match="while its update runs"):
            update.check_gather(blocks[0])
        update.end_backward(1.0)
        assert update.updating(root)
        with pytest.raises(RuntimeError, match="the step's last backward"):
            update.begin_backward(sync=True)
        update.step(1.0)
        assert all(u.updated for u in units)
    finally:
        update.close()
