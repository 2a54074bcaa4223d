"""Stage 3's gathers on their own, at world size 1: a released unit holds no storage and its
parameters are empty; a gather restores exactly its shard; the live-bytes cap decides who is released."""

from __future__ import annotations

import pytest
import torch

from infinity.comm.collectives import LocalCollectives
from infinity.comm.unit_collectives import UnitCollectives
from infinity.schedule.prefetch import TracePrefetcher
from infinity.trace import Tracer
from infinity.zero.gathers import UnitGathers
from infinity.zero.live_units import LiveUnits
from infinity.zero.units import TensorClass, UnitState, UnitUse
from unit_parts import Blocks, NoUpdate, make_units


def _gathers(units: list, max_live_bytes: int, reshard_after_forward: bool = True) -> UnitGathers:
    full = {u.index: u.padded_numel * 4 for u in units}
    live = LiveUnits(units, full, max_live_bytes)
    prefetcher = TracePrefetcher({u.index: u.shard_numel * 4 for u in units}, prefetch_bytes=0)
    g = UnitGathers(units, UnitCollectives(LocalCollectives()), live, prefetcher, NoUpdate(), Tracer(0),
                    reshard_after_forward, rank=0)
    for u in units:
        g.release(u)
    live.reset_step()
    return g


def test_release_frees_the_full_buffer_and_a_gather_brings_back_the_shard():
    model = Blocks()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    units = make_units(model, shard_params=True)
    g = _gathers(units, max_live_bytes=1 << 30)
    for u in units:
        assert u.state is UnitState.SHARDED
        assert u.full_param.untyped_storage().nbytes() == 0
        assert all(p.numel() == 0 for p in u.params)   # no view of freed storage survives
    assert g.live.live_bytes == 0
    unit = units[0]
    g.acquire(unit)
    assert unit.state is UnitState.GATHERED and unit.use is UnitUse.IN_USE
    assert torch.equal(unit.full_param, unit.shard.get(TensorClass.PARAM))
    for slot, p in zip(unit.slots, unit.params):
        assert torch.equal(p, expected[slot.name])
    assert g.live.live_bytes == unit.padded_numel * 4
    g.after_forward(unit)   # reshard after forward: released again
    assert unit.state is UnitState.SHARDED and g.live.live_bytes == 0


def test_kept_units_wait_for_backward_and_are_released_for_room_oldest_first():
    units = make_units(Blocks(), shard_params=True)
    one = units[0].padded_numel * 4
    assert all(u.padded_numel * 4 == one for u in units[:3])
    g = _gathers(units, max_live_bytes=2 * one + units[3].padded_numel * 4, reshard_after_forward=False)
    root = units[3]
    g.acquire(root)                     # the root: in use through backward
    for u in units[:2]:
        g.acquire(u)
        g.after_forward(u)              # kept for backward
        assert u.use is UnitUse.KEPT
    g.acquire(units[2])                 # no room: the oldest kept unit goes
    assert units[0].state is UnitState.SHARDED and units[1].state is UnitState.GATHERED
    assert g.live.take_step_stats()["live_cap_releases"] == 1


def test_a_unit_needed_beside_units_in_use_that_do_not_fit_is_refused_naming_the_cap():
    units = make_units(Blocks(), shard_params=True)
    g = _gathers(units, max_live_bytes=units[3].padded_numel * 4 + units[0].padded_numel * 4)
    g.acquire(units[3])
    g.acquire(units[0])
    with pytest.raises(RuntimeError, match="prefetch.max_live_bytes .* cannot be honoured"):
        g.acquire(units[1])
    g.gather_ahead(units[1])            # a gather ahead never forces room: not started
    assert units[1].state is UnitState.SHARDED
