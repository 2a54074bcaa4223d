"""Each ``optimizer.update_at`` schedule on its own at world size 1, driven by the events the engine sends
(no engine): the result is bitwise the plain step's in every schedule, and each one's own rules hold —
backward's submission order and refusals, next_forward's per-unit waits, speculative's commit, redo,
skip and fallback, with the state untouched until a commit — and the update mark each sets on a unit
and clears at its reset points."""

from __future__ import annotations

import pytest
import torch

from infinity.comm.collectives import LocalCollectives
from infinity.config import Config, IOConfig, TiersConfig
from infinity.store import TensorStore, Tier
from infinity.trace import Tracer
from infinity.zero.hyper import GroupHyper
from infinity.zero.placement import Placement
from infinity.zero.schedules import SCHEDULES, make_schedule
from infinity.zero.speculation import SpeculativeUpdate
from infinity.zero.stage import StagePolicy
from infinity.zero.store_shard import store_shards
from infinity.zero.units import TensorClass, UpdateMark
from infinity.zero.update_backward import BackwardPhase
from unit_parts import Blocks, make_units

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
HOST = 16 << 20


@pytest.fixture
def store(tmp_path):
    s = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=HOST, nvme_path=str(tmp_path)),
                    IOConfig(block_bytes=16384, queue_depth=4, threads=2))
    yield s
    s.close()


def _stored_units(model, store, spares: bool) -> list:
    """The model's units with their optimizer states and gradients in the store's host tier (stage 2, as the
    engine places them: the fp32 master a copy of the parameter shard), with spares for a speculation."""
    units = make_units(model)
    placement = Placement(params=None, grads=Tier.HOST, optimizer=Tier.HOST, chunk_bytes=1 << 20,
                          defer_grad_writes=True, spares=spares)
    new_shard = store_shards(store, placement.of(units, StagePolicy.of(2), 4, 4),
                             {Tier.HOST: HOST, Tier.DEVICE: 1 << 20})
    for unit in units:
        shard = new_shard(unit)
        shard.put(TensorClass.PARAM, unit.full_param)
        shard.put(TensorClass.MASTER, unit.full_param.clone())
        for cls in (TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ, TensorClass.GRAD):
            shard.put_zeros(cls, unit.shard_numel, torch.float32, "cpu")
        unit.shard = shard
    return units


def _schedule(at: str, units, store, model):
    cfg = Config.from_dict({"optimizer": {"threads": 1}}).optimizer
    update = make_schedule(at, units, store, LocalCollectives(), StagePolicy.of(2), 0, 0,
                           GroupHyper([dict(params=list(model.parameters()), **HYPER)]), Tracer(0), cfg)
    update.mark_store()   # as the engine does once built: the first step's stats count from here
    return update


def _built(store, at: str) -> tuple:
    """A freshly seeded model, its stored units and the ``at`` schedule over them."""
    torch.manual_seed(0)
    model = Blocks()
    units = _stored_units(model, store, spares=at == "speculative")
    update = _schedule(at, units, store, model)
    for unit in units:
        update.prepare_unit(unit)   # the speculative schedule's spares, as the engine makes them
    return model, units, update


def _grads(units, seed: int) -> None:
    """Each unit's gradient shard, as a backward's first fold writes it."""
    g = torch.Generator().manual_seed(seed)
    for u in units:
        write = u.shard.fold_grad(torch.randn(u.padded_numel, generator=g), True)
        if write is not None:
            u.shard.store.wait(write)


def _backward(update, units, grad_scale: float = 1.0) -> None:
    """The events of one backward: blocks final last-first, the root at the end (as the engine sends them)."""
    update.begin_backward(sync=True)
    for u in reversed([u for u in units if not u.is_root]):
        update.unit_final(u, grad_scale)
    with update.flushing():
        update.unit_final(next(u for u in units if u.is_root), grad_scale)
    update.end_backward(grad_scale)


def _end_step(update, units) -> None:
    """What the engine does after a step: count it, clear the marks, take the step's stats."""
    update.hyper.count_step()
    for u in units:
        u.clear_update()
    last = {"live_peak_bytes": 0}
    update.end_step(last, "none")
    return last["offload"]


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(store, grad_scales: list) -> list:
    """The plain step (update_at step) for each multiplier in turn: the parameters after each step."""
    model, units, update = _built(store, "step")
    out = []
    try:
        for i, scale in enumerate(grad_scales):
            _grads(units, i)
            _backward(update, units, 1.0)
            update.step(scale)
            _end_step(update, units)
            out.append(_params(model))
    finally:
        update.close()
        for u in units:
            u.shard.release()
    return out


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("at", sorted(SCHEDULES))
def test_every_schedule_is_the_plain_step_bitwise(store, at):
    """Two steps through each schedule's events give the step schedule's parameters exactly; the schedule's
    stats name it."""
    want = _reference(store, [1.0, 1.0])
    model, units, update = _built(store, at)
    try:
        for i in range(2):
            _grads(units, i)
            _backward(update, units)
            update.step(1.0)
            update.drain()   # next_forward: what the next forward would wait for, unit by unit
            stats = _end_step(update, units)
            assert _equal(_params(model), want[i]), (at, i)
            assert stats["overlapped"] is (at != "step") and stats.get("update_at", "step") == at
    finally:
        update.close()


def test_backward_submits_final_units_at_once_and_defers_the_root_and_the_flush(store):
    model, units, update = _built(store, "backward")
    blocks, root = [u for u in units if not u.is_root], next(u for u in units if u.is_root)
    try:
        _grads(units, 0)
        update.begin_backward(sync=True)
        for unit in (blocks[-1], blocks[1]):
            update.unit_final(unit, 1.0)
            assert update.updating(unit)
        with update.flushing():
            update.unit_final(blocks[0], 1.0)   # final only in the flush: after backward
        update.unit_final(root, 1.0)
        assert not update.updating(blocks[0]) and not update.updating(root)
        with pytest.raises(RuntimeError, match="while its update runs"):
            update.check_gather(blocks[-1])
        with pytest.raises(RuntimeError, match="clipping needs every gradient"):
            update.check_clip()
        update.end_backward(1.0)
        assert update.updating(root) and update.updating(blocks[0])
        update.step(1.0)
        assert all(u.updated for u in units)
    finally:
        update.close()


def test_backward_with_accumulation_updates_only_in_the_last_backward(store):
    torch.manual_seed(0)
    model = Blocks()
    units = _stored_units(model, store, spares=False)
    cfg = Config.from_dict({"optimizer": {"threads": 1}}).optimizer
    update = SCHEDULES["backward"](units, store, LocalCollectives(), StagePolicy.of(2), 0, 0,
                                   GroupHyper([dict(params=list(model.parameters()), **HYPER)]), Tracer(0), cfg,
                                   accum_steps=2)
    update.mark_store()
    try:
        _grads(units, 0)
        _backward(update, units)
        assert not any(update.updating(u) for u in units)   # the first of two: folds only
        _backward(update, units)
        assert all(update.updating(u) for u in units)
        update.step(1.0)
    finally:
        update.close()


def test_a_backward_that_raises_after_updates_began_marks_the_step_partial(store):
    model, units, update = _built(store, "backward")
    try:
        _grads(units, 0)
        update.begin_backward(sync=True)
        update.unit_final(units[0], 1.0)
        update.abort_backward()
        assert update.partial_update and not update.updating(units[0])
        update.abort()   # a checkpoint load: whole again
        assert not update.partial_update
    finally:
        update.close()


def test_next_forward_launches_at_step_and_waits_per_unit_before_use(store):
    """step() returns with every unit launched; before_use waits for that unit only (the others stay
    launched); the last wait drains the rest; the result is the plain step's."""
    want = _reference(store, [1.0])
    model, units, update = _built(store, "next_forward")
    order = sorted(units, key=lambda u: (not u.is_root, u.index))   # forward order: the root first
    try:
        _grads(units, 0)
        _backward(update, units)
        update.step(1.0)
        assert update.pending and all(update.updating(u) for u in units)
        stats = _end_step(update, units)
        assert stats["update_deferred"] and "update_wait_s" not in stats
        for i, unit in enumerate(order):
            update.before_use(unit)
            assert not update.updating(unit)
            assert all(update.updating(u) for u in order[i + 1:]) or i == len(order) - 1
        assert not update.pending and stats["update_wait_s"] >= 0   # the launched step's stats, completed
        assert _equal(_params(model), want[0])
    finally:
        update.close()


def _speculative(store) -> tuple:
    model, units, update = _built(store, "speculative")
    assert isinstance(update, SpeculativeUpdate)
    return model, units, update


def test_speculation_commits_when_the_multiplier_is_the_one_it_used(store):
    want = _reference(store, [1.0])
    model, units, update = _speculative(store)
    before = _params(model)
    try:
        _grads(units, 0)
        _backward(update, units)
        assert update.speculating and all(update.updating(u) for u in units)
        update.check_clip()   # a speculation allows clipping
        assert _equal(_params(model), before)   # only spares are written before the commit
        update.step(1.0)
        stats = _end_step(update, units)
        assert stats["speculation"]["committed"] and not stats["speculation"]["redone"]
        assert _equal(_params(model), want[0])
    finally:
        update.close()


def test_speculation_is_redone_from_the_untouched_state_when_the_step_clipped(store):
    """A clipped multiplier (0.5): the update runs again with it from the state the speculation left
    untouched, bitwise the plain step with 0.5; the next step falls back to next_forward."""
    want = _reference(store, [0.5, 1.0])
    model, units, update = _speculative(store)
    try:
        _grads(units, 0)
        _backward(update, units)
        update.step(0.5)
        stats = _end_step(update, units)
        assert stats["speculation"]["redone"] and stats["speculation"]["calm_needed"] == 1
        assert _equal(_params(model), want[0])
        _grads(units, 1)
        _backward(update, units)   # the fallback: nothing updated in backward, launched at step
        assert not update.speculating and not any(update.updating(u) for u in units)
        update.step(1.0)
        assert update.pending
        update.drain()
        _end_step(update, units)
        assert _equal(_params(model), want[1])
    finally:
        update.close()


def test_a_skipped_or_dropped_speculation_leaves_the_state_of_the_last_step(store):
    model, units, update = _speculative(store)
    before = _params(model)
    try:
        _grads(units, 0)
        _backward(update, units)
        update.skip_step()   # fp16 overflow
        stats = _end_step(update, units)
        assert stats["speculation"]["skipped"] and _equal(_params(model), before)
        update.new_step()
        _backward(update, units)
        update.new_step()   # zero_grad() after a step that failed: the speculation is dropped
        assert not any(update.updating(u) for u in units) and _equal(_params(model), before)
    finally:
        update.close()


# ---------------------------------------------------------------- the units' update marks


def _marks(units) -> list:
    return [u.update_mark for u in units]


def _recorded_waits(update, monkeypatch) -> list:
    """The job names the schedule waits for through its pipeline, one tuple a call, in order."""
    waited, wait_for = [], update.pipeline.wait_for

    def record(names):
        waited.append(tuple(names))
        wait_for(names)
    monkeypatch.setattr(update.pipeline, "wait_for", record)
    return waited


def test_backward_marks_a_begun_unit_updating_and_refuses_its_gather_until_the_step_ends(store):
    """A unit submitted in the step's last backward is marked begun (the others not): it is reported as
    updating and its gather is refused, through optimizer.step(), until the step's end clears the mark."""
    model, units, update = _built(store, "backward")
    blocks = [u for u in units if not u.is_root]
    try:
        _grads(units, 0)
        update.begin_backward(sync=True)
        update.unit_final(blocks[-1], 1.0)
        assert _marks(units) == [UpdateMark.BEGUN if u is blocks[-1] else UpdateMark.NONE for u in units]
        assert update.updating(blocks[-1]) and not update.updating(blocks[0])
        with pytest.raises(RuntimeError, match=f"gathers unit {blocks[-1].name!r} before optimizer.step"):
            update.check_gather(blocks[-1])
        update.check_gather(blocks[0])   # not begun: may be gathered
        for unit in reversed(blocks[:-1]):
            update.unit_final(unit, 1.0)
        with update.flushing():
            update.unit_final(next(u for u in units if u.is_root), 1.0)
        update.end_backward(1.0)
        assert _marks(units) == [UpdateMark.BEGUN] * len(units)
        update.step(1.0)
        assert all(u.updated for u in units) and _marks(units) == [UpdateMark.BEGUN] * len(units)
        _end_step(update, units)
        assert _marks(units) == [UpdateMark.NONE] * len(units) and not any(update.updating(u) for u in units)
        update.check_gather(blocks[-1])
    finally:
        update.close()


def test_next_forward_before_use_waits_only_for_a_launched_unit_and_clears_its_mark(store, monkeypatch):
    """step() marks every unit launched with its own jobs; before_use waits for exactly that unit's jobs
    and clears its mark (the others stay launched, through the step's end); a unit no longer launched is
    not waited for again; the last wait drains the launch."""
    model, units, update = _built(store, "next_forward")
    order = sorted(units, key=lambda u: (not u.is_root, u.index))   # forward order: the root first
    waited = _recorded_waits(update, monkeypatch)
    try:
        _grads(units, 0)
        _backward(update, units)
        update.step(1.0)
        assert _marks(units) == [UpdateMark.LAUNCHED] * len(units)
        for unit in units:
            assert unit.launched_jobs and all(n == unit.name or n.startswith(f"{unit.name}#")
                                              for n in unit.launched_jobs)
        _end_step(update, units)
        assert _marks(units) == [UpdateMark.LAUNCHED] * len(units)   # the next forward waits for them
        first, jobs = order[0], order[0].launched_jobs
        update.before_use(first)
        assert waited == [jobs] and first.update_mark is UpdateMark.NONE and first.launched_jobs == ()
        assert all(u.update_mark is UpdateMark.LAUNCHED for u in order[1:]) and update.pending
        update.before_use(first)   # waited for already: no second wait
        assert waited == [jobs]
        for unit in order[1:]:
            jobs = unit.launched_jobs
            update.before_use(unit)
            assert waited[-1] == jobs and unit.update_mark is UpdateMark.NONE
        assert len(waited) == len(units) and not update.pending   # the last wait drained the launch
    finally:
        update.close()


def test_backward_resets_clear_the_begun_marks(store):
    """A backward that raised, a checkpoint load (abort) and the step's end each clear every begun mark;
    the backward that raised after an update began leaves the step partial."""
    model, units, update = _built(store, "backward")
    try:
        _grads(units, 0)
        update.begin_backward(sync=True)
        update.unit_final(units[0], 1.0)
        update.abort_backward()
        assert _marks(units) == [UpdateMark.NONE] * len(units) and update.partial_update
        update.abort()
        _backward(update, units)
        assert _marks(units) == [UpdateMark.BEGUN] * len(units)
        update.abort()
        assert _marks(units) == [UpdateMark.NONE] * len(units) and update.phase is BackwardPhase.IDLE
        _backward(update, units)
        update.step(1.0)
        _end_step(update, units)
        assert _marks(units) == [UpdateMark.NONE] * len(units)
    finally:
        update.close()


def test_next_forward_resets_clear_the_launched_marks(store):
    """A checkpoint load (abort) and a drain (a backward, a save) each clear every launched mark."""
    model, units, update = _built(store, "next_forward")
    try:
        _grads(units, 0)
        _backward(update, units)
        update.step(1.0)
        assert _marks(units) == [UpdateMark.LAUNCHED] * len(units)
        update.abort()
        assert _marks(units) == [UpdateMark.NONE] * len(units) and not update.pending
        assert all(u.launched_jobs == () for u in units)
        update.step(1.0)   # nothing was marked updated: the whole update is launched again
        assert _marks(units) == [UpdateMark.LAUNCHED] * len(units)
        update.drain()
        assert _marks(units) == [UpdateMark.NONE] * len(units) and not update.pending
    finally:
        update.close()


def test_speculative_marks_a_speculation_begun_and_a_fallback_launched(store, monkeypatch):
    """A speculating step marks its units begun: a gather is refused without waiting, and zero_grad after
    it clears the marks. A fallback step marks them launched: the step's end (which clears begun marks)
    leaves them, a gather waits for the unit's jobs, and the next backward's drain clears the rest."""
    model, units, update = _speculative(store)
    waited = _recorded_waits(update, monkeypatch)
    try:
        _grads(units, 0)
        _backward(update, units)
        assert update.speculating and _marks(units) == [UpdateMark.BEGUN] * len(units)
        with pytest.raises(RuntimeError, match="while its update runs"):
            update.check_gather(units[0])
        assert waited == []
        update.new_step()   # zero_grad(): the speculation is dropped
        assert _marks(units) == [UpdateMark.NONE] * len(units)
        _backward(update, units)
        update.step(0.5)   # clipped: redone, and the next step falls back
        _end_step(update, units)
        assert _marks(units) == [UpdateMark.NONE] * len(units)
        _grads(units, 1)
        _backward(update, units)
        assert not update.speculating
        update.step(1.0)
        _end_step(update, units)
        assert _marks(units) == [UpdateMark.LAUNCHED] * len(units)
        jobs = units[0].launched_jobs
        update.check_gather(units[0])
        assert waited == [jobs] and units[0].update_mark is UpdateMark.NONE
        update.begin_backward(sync=True)
        assert _marks(units) == [UpdateMark.NONE] * len(units) and not update.pending
    finally:
        update.close()
