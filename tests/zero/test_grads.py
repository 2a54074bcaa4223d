"""The gradient path on its own, at world size 1: hooks' gradients into flat buffers, reduction,
lazy zeroing, accumulation, clipping's multiplier and the units it hands on as final."""

from __future__ import annotations

import pytest
import torch

from infinity.comm.collectives import LocalCollectives
from infinity.comm.unit_collectives import UnitCollectives
from infinity.zero.grads import GradReducer, make_grad_reducer
from infinity.zero.stage import StagePolicy
from infinity.zero.units import TensorClass
from unit_parts import Blocks, make_units


def _reducer(stage: int, units: list) -> GradReducer:
    coll = LocalCollectives()
    r = make_grad_reducer(units, StagePolicy.of(stage), coll, UnitCollectives(coll), torch.float32,
                          torch.device("cpu"), bucket_bytes=1 << 20, shard_rank=0, fp16=False,
                          norm_coll=coll if StagePolicy.of(stage).sharded else None)
    r.build()
    return r


def _backward(reducer: GradReducer, units: list, grads: dict, skip=()) -> list:
    """Feed every parameter's gradient (``grads[name]``) as the hooks would; returns the units whose
    reduction each call launched, in order."""
    launched = []
    for unit in units:
        for slot, p in zip(unit.slots, unit.params):
            if slot.name in skip:
                continue
            p.grad = grads[slot.name].clone()
            if reducer.param_ready(unit, slot, p):
                launched.append(unit.index)
            assert p.grad is None   # gradients live in the flat buffers only
    reducer.flush()
    return launched


def _flat(unit, grads: dict) -> torch.Tensor:
    out = torch.zeros(unit.padded_numel)
    for s in unit.slots:
        out[s.offset:s.offset + s.numel] = grads[s.name].reshape(-1)
    return out


def _random_grads(units, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for u in units for s in u.slots}


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_one_backward_lands_every_gradient_in_its_unit_shard(stage):
    units = make_units(Blocks(), shard_params=stage == 3)
    r = _reducer(stage, units)
    grads = _random_grads(units, 0)
    launched = _backward(r, units, grads)
    assert launched == [u.index for u in units]   # each unit's last parameter launches its reduction, once
    folded = [u.index for u in r.take_folded()]
    assert folded == ([u.index for u in units] if stage >= 2 else [])   # only stages 2-3 fold into shards
    assert r.take_folded() == []
    assert not r.finish(None)
    for u in units:
        assert torch.equal(u.shard.get(TensorClass.GRAD), _flat(u, grads)), u.name


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_backwards_accumulate_until_zero_then_the_next_one_replaces(stage):
    units = make_units(Blocks(), shard_params=stage == 3)
    r = _reducer(stage, units)
    a, b, c = (_random_grads(units, s) for s in (1, 2, 3))
    _backward(r, units, a)
    _backward(r, units, b)
    r.finish(None)
    for u in units:
        assert torch.allclose(u.shard.get(TensorClass.GRAD), _flat(u, a) + _flat(u, b)), u.name
    r.zero()
    first = units[0].slots[0].name
    _backward(r, units, c, skip={first})   # a parameter with no gradient after zero_grad reads zero
    r.finish(None)
    c[first] = torch.zeros_like(c[first])
    for u in units:
        assert torch.equal(u.shard.get(TensorClass.GRAD), _flat(u, c)), u.name


@pytest.mark.parametrize("stage", (0, 2))
def test_clip_folds_the_coefficient_into_the_multiplier_not_the_gradients(stage):
    units = make_units(Blocks(), shard_params=False)
    r = _reducer(stage, units)
    grads = _random_grads(units, 4)
    _backward(r, units, grads)
    r.finish(None)
    before = [u.shard.get(TensorClass.GRAD).clone() for u in units]
    expected = torch.cat([g.reshape(-1) for g in grads.values()]).norm()
    norm = r.clip(max_norm=0.5)
    assert torch.allclose(norm, expected, rtol=1e-6)
    assert r.multiplier == pytest.approx(0.5 / (float(expected) + 1e-6), rel=1e-6)
    assert all(torch.equal(u.shard.get(TensorClass.GRAD), g) for u, g in zip(units, before))
    r.zero()
    assert r.multiplier == 1.0
    _backward(r, units, {k: v * 1e-3 for k, v in grads.items()})
    r.finish(None)
    r.clip(max_norm=10.0)   # below the threshold: no clipping
    assert r.multiplier == 1.0


def test_an_aborted_backward_hands_on_nothing_and_the_next_one_starts_clean():
    units = make_units(Blocks())
    r = _reducer(2, units)
    grads = _random_grads(units, 5)
    unit = units[0]
    for slot, p in zip(unit.slots, unit.params):   # the first unit completes, then backward raises
        p.grad = grads[slot.name].clone()
        r.param_ready(unit, slot, p)
    r.abort()
    assert r.take_folded() == []
    assert all(u.grads_pending == len(u.slots) for u in units)
    r.zero()
    _backward(r, units, grads)
    r.finish(None)
    for u in units:
        assert torch.equal(u.shard.get(TensorClass.GRAD), _flat(u, grads)), u.name
