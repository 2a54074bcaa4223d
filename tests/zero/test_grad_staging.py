"""Gradient folds into stored shards that do not wait for the device->host copy: the same bytes as
the blocking way, the step waiting for every copy before it reads, fp16's flag read once per step,
and the staging buffers within their bound. The store's copier is a stand-in whose copies land late."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from types import SimpleNamespace

import pytest
import torch

import infinity
import offload_cases
import zero_cases
from gated_copier import GatedCopier
from infinity.comm.collectives import LocalCollectives
from infinity.comm.unit_collectives import UnitCollectives
from infinity.config import IOConfig, TiersConfig
from infinity.store import TensorStore, Tier
from infinity.zero.grad_staging import FoldStaging
from infinity.zero.grads import GradReducer, make_grad_reducer
from infinity.zero.placement import Placement
from infinity.zero.stage import StagePolicy
from infinity.zero.store_shard import LentCopies, StoreUnitShard, fold_staging
from infinity.zero.units import TensorClass, UnitShard
from unit_parts import Blocks, make_units

NUMEL = 4096 * 4
HALVES = [(0, NUMEL // 2), (NUMEL // 2, NUMEL)]
QUARTERS = [(i * NUMEL // 4, (i + 1) * NUMEL // 4) for i in range(4)]


def _store(tmp_path, copier, host_bytes=1 << 20):
    return TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=host_bytes, nvme_path=str(tmp_path)),
                       IOConfig(block_bytes=16384, queue_depth=4, threads=2), copier=copier)


def _placement(grads: str, defer: bool = False) -> Placement:
    return Placement(params=None, grads=Tier.NVME if grads == "nvme" else Tier.HOST, optimizer=None,
                     chunk_bytes=1 << 20, defer_grad_writes=defer)


def _grads(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) * 10 ** k for k in range(n)]   # sums that round


@pytest.mark.parametrize("grads", ("nvme", "host"))
@pytest.mark.parametrize("chunks", (None, HALVES))
@pytest.mark.parametrize("defer", (False, True))
def test_folds_give_the_blocking_paths_bytes_and_return_before_the_copy_lands(tmp_path, grads, chunks, defer):
    """Each fold returns while its copy is still held back; once landed, the shard holds bitwise what the
    in-memory shard's blocking copy/add_ gives, for first gradients and accumulations alike."""
    copier = GatedCopier(open_gate=False)
    store = _store(tmp_path, copier)
    try:
        staging = FoldStaging(store, buffer_bytes=NUMEL * 4)   # a whole shard's accumulation fits a buffer
        shard = StoreUnitShard(store, 0, _placement(grads, defer), LentCopies(store), chunks, staging=staging)
        shard.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
        plain = UnitShard()
        plain.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
        parts = _grads(4)
        for i, part in enumerate(parts):
            first = i in (0, 2)   # a zero_grad between micro-batches 2 and 3
            write = shard.fold_grad(part.clone(), first)
            assert write is not None and not write.done(), "the fold waited for its copy"
            copier.gate.set()
            write.result()
            copier.gate.clear()
            plain.fold_grad(part, first)
        copier.gate.set()
        assert torch.equal(shard.read(TensorClass.GRAD), plain.get(TensorClass.GRAD))
        assert torch.equal(plain.get(TensorClass.GRAD), parts[2] + parts[3])
        assert shard.staging.held_buffers == 0 and store.stats()["scratch_bytes"] == staging.reserved_bytes
        shard.release()
        staging.close()
        assert store.stats()["scratch_bytes"] == 0
    finally:
        store.close()
        copier.close()


def _reducer(units, fp16=False) -> GradReducer:
    coll = LocalCollectives()
    return make_grad_reducer(units, StagePolicy.of(2), coll, UnitCollectives(coll), torch.float32,
                             torch.device("cpu"), bucket_bytes=1 << 20, shard_rank=0, fp16=fp16, norm_coll=coll)


def _stored_units(store, grads="nvme"):
    units = make_units(Blocks(width=64))
    # one queue of pending folds for the rank's shards, its bounds wide enough that no fold here waits for
    # another (the bounds have a test of their own)
    staging = FoldStaging(store, max_buffers=len(units), max_claims=len(units),
                          buffer_bytes=max(u.shard_numel for u in units) * 4)
    for unit in units:   # gradient shards in the store (the engine's store_shards does this)
        unit.shard = StoreUnitShard(store, unit.index, _placement(grads), LentCopies(store), staging=staging)
    return units


def _backward(reducer, units, grads):
    for unit in units:
        for slot, p in zip(unit.slots, unit.params):
            p.grad = grads[slot.name].clone()
            reducer.param_ready(unit, slot, p)
    reducer.flush()
    reducer.take_folded()


def _wait_until(cond, timeout_s=30.0):
    import time
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _random(units, seed):
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for u in units for s in u.slots}


def _flat(unit, grads):
    out = torch.zeros(unit.padded_numel)
    for s in unit.slots:
        out[s.offset:s.offset + s.numel] = grads[s.name].reshape(-1)
    return out


def test_the_step_waits_for_every_gradient_copy_before_it_reads(tmp_path):
    """Two micro-batches with every copy held back: backward finishes without them; finish() (what the
    step calls before the update reads) returns only after the last copy has landed and been folded."""
    copier = GatedCopier(open_gate=False)
    store = _store(tmp_path, copier)
    try:
        units = _stored_units(store)
        r = _reducer(units)
        r.build()
        r.zero()   # the next backward's folds are first gradients
        g1, g2 = _random(units, 1), _random(units, 2)
        _backward(r, units, g1)   # first gradients: claimed from the device tensor, copies held back
        assert copier.in_flight() == len(units) and all(r.staging.pending(u.index) for u in units), \
            "backward waited for its copies"
        copier.gate.set()
        _wait_until(lambda: copier.in_flight() == 0)
        copier.gate.clear()
        _backward(r, units, g2)   # accumulations: staged, summed once their copies land
        assert copier.in_flight() == len(units), "backward waited for its copies"
        returned = threading.Event()
        t = threading.Thread(target=lambda: (r.finish(None), copier.log.append(("finish returned",)),
                                             returned.set()))
        t.start()
        assert not returned.wait(0.3), "finish() returned while gradient copies were still held back"
        copier.gate.set()
        assert returned.wait(30)
        t.join()
        assert copier.log[-1] == ("finish returned",)
        assert sum(1 for e in copier.log if e[0] == "landed") == copier.submitted == 2 * len(units)
        for u in units:
            assert torch.equal(u.shard.read(TensorClass.GRAD), _flat(u, g1) + _flat(u, g2)), u.name
    finally:
        store.close()
        copier.close()


@pytest.mark.parametrize("stored", (False, True))
def test_fp16_overflow_flag_is_read_once_per_step_not_per_unit(tmp_path, stored, monkeypatch):
    """No ``.item()`` / ``.cpu()`` while backward folds the units (a device sync each, on CUDA); the flag
    summed on the gradients' device is read once, in finish(), and still sees an overflow; the clip
    norm is read once too."""
    copier = GatedCopier()
    store = _store(tmp_path, copier)
    try:
        units = _stored_units(store) if stored else make_units(Blocks(width=64))
        r = _reducer(units, fp16=True)
        r.build()
        reads = {"item": 0, "cpu": 0}
        item, cpu = torch.Tensor.item, torch.Tensor.cpu

        def counting(name, fn):
            def call(self, *a, **k):
                reads[name] += 1
                return fn(self, *a, **k)
            return call

        for finite in (True, False):
            grads = _random(units, 3)
            if not finite:
                grads[units[1].slots[0].name][0, 0] = float("inf")
            with monkeypatch.context() as m:
                m.setattr(torch.Tensor, "item", counting("item", item))
                m.setattr(torch.Tensor, "cpu", counting("cpu", cpu))
                _backward(r, units, grads)
            assert reads == {"item": 0, "cpu": 0}, f"backward read from the device: {reads}"
            before = r.flag_reads
            assert r.finish(1024.0) is (not finite)
            assert r.flag_reads == before + 1   # one read of the all-reduced flag per step
            if finite:
                r.clip(1e9)
                assert r.flag_reads == before + 2   # and one of the clip norm, whatever the unit count
            r.zero()
    finally:
        store.close()
        copier.close()


def test_staging_buffers_and_claims_in_flight_stay_within_their_bounds(tmp_path):
    """Accumulating a four-chunk shard with slow copies needs four staging buffers at once, the bound is
    two: folds finish older ones to stay within it, host scratch never exceeds two chunks, sums exact.
    Likewise first gradients: at most three claims (each holding its device source) in flight."""
    copier = GatedCopier(delay_s=0.02)
    store = _store(tmp_path, copier)
    try:
        chunk_bytes = NUMEL // 4 * 4
        staging = FoldStaging(store, max_buffers=2, max_claims=3, buffer_bytes=chunk_bytes)
        assert store.stats()["scratch_bytes"] == staging.reserved_bytes == 0   # nothing before the phase starts
        shards = [StoreUnitShard(store, i, _placement("nvme"), LentCopies(store), QUARTERS, staging=staging)
                  for i in range(2)]
        parts = _grads(3, seed=4)
        for shard in shards:
            shard.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
        writes = []
        for i, part in enumerate(parts):
            for shard in shards:
                writes.append(shard.fold_grad(part.clone(), first=i == 0))
        for w in writes:
            w.result()
        assert staging.peak_buffers == 2 and staging.peak_claims == 3 and staging.waits > 0, staging.stats()
        assert staging.peak_bytes <= 2 * chunk_bytes
        assert store.stats()["scratch_peak_bytes"] <= 2 * chunk_bytes
        assert store.stats()["scratch_bytes"] == staging.reserved_bytes == 2 * chunk_bytes   # the phase's two
        staging.finish_all()   # the step's wait ends the phase: its staging goes back
        want = (parts[0] + parts[1]) + parts[2]
        for shard in shards:
            assert torch.equal(shard.read(TensorClass.GRAD), want)
        assert staging.held_buffers == 0 and staging.claims_in_flight == 0
        assert store.stats()["scratch_bytes"] == staging.reserved_bytes == 0 and staging.short_phases == 0
        with pytest.raises(ValueError, match="must be >= 0 and max_claims >= 1"):
            FoldStaging(store, max_claims=0)
    finally:
        store.close()
        copier.close()


def test_an_accumulation_larger_than_a_staging_buffer_is_staged_in_slices(tmp_path):
    """A chunk four buffers long is staged in four slices, in order, the fold returning before any copy
    lands; waited for, the slices are summed in order: the sum is bitwise the blocking one, inspected
    once when it is whole, and the fold's pin on the brought sum is dropped once, after all four."""
    copier = GatedCopier(open_gate=False)
    store = _store(tmp_path, copier)
    staging = FoldStaging(store, max_buffers=4, buffer_bytes=NUMEL)   # a quarter of the fp32 shard each
    try:
        shard = StoreUnitShard(store, 0, _placement("nvme"), LentCopies(store), staging=staging)
        shard.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
        a, b = _grads(2, seed=7)
        copier.gate.set()
        shard.fold_grad(a.clone(), first=True).result()
        copier.gate.clear()
        assert staging.slices(b) == [(i * NUMEL // 4, (i + 1) * NUMEL // 4) for i in range(4)]
        seen = []
        fold = shard.fold_grad(b.clone(), first=False, inspect=lambda g, at: seen.append((g.clone(), at)))
        assert not fold.done() and staging.held_buffers == 4, "the fold waited for its copies"
        copier.gate.set()
        fold.result()
        assert len(seen) == 1 and seen[0][1] == 0 and torch.equal(seen[0][0], a + b)
        with pytest.raises(Exception, match="not pinned"):   # the four slices dropped the fold's one pin once
            store.unpin(shard.keys(TensorClass.GRAD)[0], Tier.HOST)
        staging.finish_all()
        assert staging.held_buffers == 0 and torch.equal(shard.read(TensorClass.GRAD), a + b)
        shard.release()
    finally:
        copier.gate.set()
        staging.close()
        store.close()
        copier.close()


@pytest.mark.parametrize("beyond_least, buffers", ((0, 0), (0.99, 0), (1, 1), (3, 2)))
def test_staging_is_reserved_from_what_the_host_budget_holds_beyond_its_minimum(tmp_path, beyond_least, buffers):
    """store_shards' staging is sized to up to two buffers, each the largest gradient chunk a fold stages,
    out of the host budget beyond the minimum initialize enforces; the first accumulation of a phase sets
    them aside (the store counts them) and the step's wait for every fold gives them back. At the minimum
    none: an accumulation is summed the blocking way (bitwise the same sum, counted); above it each
    accumulation is staged while its copy is in flight."""
    units = [SimpleNamespace(index=0, name="u0", shard_numel=NUMEL, is_root=False)]
    placement = _placement("host").of(units, StagePolicy.of(2), 4, 4)
    buffer = placement.fold_staging_bytes()
    assert buffer == NUMEL * 4   # one whole-shard chunk of fp32 gradient
    host = placement.min_budgets()[Tier.HOST][0] + int(beyond_least * buffer)
    copier = GatedCopier(open_gate=False)
    store = _store(tmp_path, copier, host_bytes=host)
    staging = fold_staging(store, placement, host)
    try:
        assert staging.max_buffers == buffers and store.stats()["scratch_bytes"] == 0
        shard = StoreUnitShard(store, 0, placement, LentCopies(store), staging=staging)
        shard.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
        a, b = _grads(2, seed=5)
        copier.gate.set()
        shard.fold_grad(a.clone(), first=True).result()
        copier.gate.clear()
        write = shard.fold_grad(b.clone(), first=False)
        assert (write is not None and not write.done()) == bool(buffers), "staged while its copy is in flight"
        assert store.stats()["scratch_bytes"] == staging.reserved_bytes == buffers * buffer   # the phase's
        copier.gate.set()
        staging.finish_all()
        assert store.stats()["scratch_bytes"] == staging.reserved_bytes == 0
        assert staging.blocking_folds == (0 if buffers else 1) and staging.peak_buffers == min(buffers, 1)
        assert staging.short_phases == 0
        assert torch.equal(shard.read(TensorClass.GRAD), a + b)
        shard.release()
    finally:
        copier.gate.set()
        staging.close()
        store.close()
        copier.close()


def test_a_phase_the_tier_cannot_give_every_buffer_stages_with_fewer(tmp_path):
    """Two buffers sized, but a host tier holding room for one when the phase starts: the phase takes one,
    without retrying, counts itself short, and stages its folds through it (each finishing the one before);
    the sums are exact and the one buffer goes back with the step's wait."""
    copier = GatedCopier(delay_s=0.01)
    store = _store(tmp_path, copier, host_bytes=NUMEL * 4 + NUMEL)   # the homed gradient and one quarter
    staging = FoldStaging(store, max_buffers=2, buffer_bytes=NUMEL)
    try:
        shard = StoreUnitShard(store, 0, _placement("host"), LentCopies(store), staging=staging)
        shard.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
        a, b = _grads(2, seed=8)
        shard.fold_grad(a.clone(), first=True).result()
        shard.fold_grad(b.clone(), first=False).result()
        assert staging.short_phases == 1 and staging.reserved_bytes == NUMEL and staging.peak_buffers == 1
        assert staging.blocking_folds == 0 and staging.waits > 0, staging.stats()
        staging.finish_all()
        assert store.stats()["scratch_bytes"] == staging.reserved_bytes == 0
        assert torch.equal(shard.read(TensorClass.GRAD), a + b)
        shard.release()
    finally:
        staging.close()
        store.close()
        copier.close()


def test_every_pending_fold_is_in_the_ranks_one_queue_by_unit(tmp_path):
    """The rank's shards queue what they leave pending in one FoldStaging, tagged by unit: a unit's folds
    are found and finished there alone (the unordered ones only, when asked), the landed ones at the head
    finish without waiting, a failure finished early is kept until the step's finish_all raises it once,
    and the step's wait leaves nothing queued. Shards with a queue each are refused by the reducer."""
    copier = GatedCopier(open_gate=False)
    store = _store(tmp_path, copier)
    try:
        staging = FoldStaging(store, max_buffers=4, max_claims=4, buffer_bytes=NUMEL * 4)
        shards = [StoreUnitShard(store, i, _placement("nvme"), LentCopies(store), staging=staging) for i in range(2)]
        for shard in shards:
            shard.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
        a, b, c, d = _grads(4, seed=6)
        for shard, part in zip(shards, (a, b)):
            assert _fold_alone(shard, part, first=True) is staging.pending(shard.unit_index)
        assert staging.pending(0).ordered and staging.pending(1).ordered   # claims: reads wait in the store
        copier.gate.set()
        _wait_until(lambda: staging.pending(0).done() and staging.pending(1).done())   # landed, written home
        staging.finish_landed()
        assert staging.pending(0) is None and staging.pending(1) is None
        copier.gate.clear()
        for shard, part in zip(shards, (c, d)):
            _fold_alone(shard, part, first=False)
        assert not staging.pending(0).ordered   # an accumulation's sum is made only when it is finished
        copier.gate.set()
        _wait_until(lambda: copier.in_flight() == 0)
        staging.finish_unit(1, unordered_only=True)
        assert staging.pending(1) is None and staging.pending(0) is not None
        failed = cf.Future()
        failed.set_exception(OSError("copy failed"))
        staging.track(2, failed)
        staging.finish_unit(0)
        staging.finish_landed()   # the failure at the head is finished and kept
        assert staging.pending(2) is None
        with pytest.raises(OSError, match="copy failed"):
            staging.finish_all()
        staging.finish_all()   # raised once
        assert torch.equal(shards[0].read(TensorClass.GRAD), a + c)
        assert torch.equal(shards[1].read(TensorClass.GRAD), b + d)
        assert staging.held_buffers == 0 and store.stats()["scratch_bytes"] == staging.reserved_bytes
        for shard in shards:
            shard.release()
        staging.close()
        assert store.stats()["scratch_bytes"] == 0
        units = _stored_units(store)
        units[0].shard = StoreUnitShard(store, 0, _placement("nvme"), LentCopies(store))   # a queue of its own
        with pytest.raises(ValueError, match="share one FoldStaging"):
            _reducer(units).build()
    finally:
        copier.gate.set()   # a copy held back by a failed assertion lands, so the store can close
        store.close()
        copier.close()


def _fold_alone(shard, part, first: bool):
    """``shard.fold_grad`` with the copier's gate shut: it must return without finishing another unit's
    fold (whose copy is held back); returns what it returned."""
    out = []
    t = threading.Thread(target=lambda: out.append(shard.fold_grad(part.clone(), first)), daemon=True)
    t.start()
    t.join(30)
    assert out, f"folding unit {shard.unit_index} waited for another unit's fold"
    return out[0]


def _accumulating_run(tmp_path, host_bytes: int) -> tuple:
    """Two steps of two micro-batches each (GPT test model, stage 3, every class on NVMe, the update at the
    step) at ``host_bytes``: the losses, the parameters, each step's fold staging stats, and the least host
    budget initialize takes."""
    spec = dict(stage=3, lr=1e-2, optimizer={"update_at": "step"}, host_bytes=host_bytes,
                offload=dict(optimizer="nvme", params="nvme", grads="nvme"), tmp=str(tmp_path / str(host_bytes)),
                schedule={"accum_steps": 2})
    model, opt = infinity.initialize(offload_cases.build("gpt"), offload_cases.offload_config(spec, rank=0))
    engine = infinity.engine_of(model)
    least = engine.placement.min_budgets()[Tier.HOST][0]
    losses, stats = [], []
    try:
        for step in range(2):
            losses.append(zero_cases.backward_on_share(model, zero_cases.global_batch(step, 8), 0, 1, accum=2))
            opt.step()
            opt.zero_grad()
            stats.append(engine.stats.last_step["offload"]["fold_staging"])
        with engine.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return losses, params, stats, least


def test_the_engine_stages_accumulations_within_the_budget_and_reports_it(tmp_path):
    """With room beyond the host minimum, the engine sizes two staging buffers of the largest gradient
    chunk, every accumulation is staged (none summed the blocking way), and the step gives them back; at
    the minimum budget initialize takes it sizes none, and every accumulation is summed the blocking way.
    Each step's offload stats say so, and the results are bitwise the same."""
    staged = _accumulating_run(tmp_path, host_bytes=4 << 20)
    least = _accumulating_run(tmp_path, host_bytes=staged[3])
    for s in staged[2]:
        assert s["max_buffers"] == 2 and s["buffer_bytes"] > 0 and s["short_phases"] == 0, s
        assert s["peak_buffers"] >= 1 and s["blocking_folds"] == 0, s
        assert s["held_buffers"] == 0 and s["reserved_bytes"] == 0, s   # given back by the step
    for s in least[2]:
        assert s["max_buffers"] == 0 and s["reserved_bytes"] == 0 and s["peak_buffers"] == 0, s
    folds = [s["blocking_folds"] for s in least[2]]   # counted since initialize: each step adds its own
    assert 0 < folds[0] < folds[1], folds
    assert staged[0] == least[0]
    for n, p in least[1].items():
        assert torch.equal(staged[1][n], p), n
