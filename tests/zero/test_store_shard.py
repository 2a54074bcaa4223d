"""A unit shard with classes in the tiered store, on its own at world size 1: the in-memory shard's
verbs, done through the store (put / get / fold / job fields / chunks), with NVMe files under tmp_path."""

from __future__ import annotations

import pytest
import torch

from infinity.config import IOConfig, TiersConfig
from infinity.store import TensorStore, Tier
from infinity.zero.placement import Placement
from infinity.zero.store_shard import LentCopies, StoreUnitShard
from infinity.zero.units import TensorClass

NUMEL = 4096 * 4   # a multiple of 4096 bytes in every dtype


@pytest.fixture
def store(tmp_path):
    s = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=1 << 20, nvme_path=str(tmp_path)),
                    IOConfig(block_bytes=16384, queue_depth=4, threads=2))
    yield s
    s.close()


def _shard(store, grads="nvme", chunks=None) -> StoreUnitShard:
    placement = Placement(params=None, grads=Tier.NVME if grads == "nvme" else Tier.HOST, optimizer=Tier.NVME,
                          chunk_bytes=1 << 20)
    return StoreUnitShard(store, 0, placement, LentCopies(store), chunks)


@pytest.mark.parametrize("chunks", (None, [(0, NUMEL // 2), (NUMEL // 2, NUMEL)]))
def test_stored_classes_round_trip_and_folds_sum_through_the_store(store, chunks):
    shard = _shard(store, chunks=chunks)
    g = torch.Generator().manual_seed(0)
    master = torch.randn(NUMEL, generator=g)
    shard.put(TensorClass.MASTER, master.clone())
    shard.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
    n_chunks = 1 if chunks is None else 2
    assert len(shard.keys(TensorClass.MASTER)) == n_chunks and shard.chunks() == (chunks or [None])
    assert all(isinstance(shard.job_field(TensorClass.MASTER, c), str) for c in range(n_chunks))   # store keys
    a, b = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    for first, part in ((True, a), (False, b)):
        write = shard.fold_grad(part, first)
        if write is not None:
            store.wait(write)
    assert torch.equal(shard.read(TensorClass.GRAD), a + b)
    assert torch.equal(shard.read(TensorClass.MASTER), master)
    seen = []
    shard.fold_grad(torch.ones(NUMEL), True, inspect=lambda t: seen.append(t.sum().item()))
    assert sum(seen) == NUMEL   # fp16's overflow check sees every folded chunk while it is in memory
    assert torch.equal(shard.read(TensorClass.GRAD), torch.ones(NUMEL))
    shard.release()
    assert store.stats()["keys"] == 0   # a released shard leaves nothing in the store


def test_a_lent_copy_written_by_the_caller_reaches_the_disk_at_the_next_store_use(store):
    shard = _shard(store)
    shard.put(TensorClass.EXP_AVG, torch.zeros(NUMEL))
    shard.get(TensorClass.EXP_AVG).fill_(3.0)   # lent: written back before the next operation on the store
    shard.write_back_lent()
    key = shard.keys(TensorClass.EXP_AVG)[0]
    store.wait(store.evict(key, Tier.HOST))   # only the disk's copy is left: it must hold the new bytes
    assert torch.equal(shard.read(TensorClass.EXP_AVG), torch.full((NUMEL,), 3.0))
    assert store.home(key) is Tier.NVME


def test_a_host_homed_first_gradient_replaces_the_shard_without_reading_it(store):
    shard = _shard(store, grads="host")
    shard.put_zeros(TensorClass.GRAD, NUMEL, torch.float32, "cpu")
    reduced = torch.arange(NUMEL, dtype=torch.float32)
    write = shard.fold_grad(reduced, True)   # the replacement's registration, in flight
    if write is not None:
        store.wait(write)
    assert torch.equal(shard.read(TensorClass.GRAD), reduced)
    assert store.home(shard.keys(TensorClass.GRAD)[0]) is Tier.HOST


def test_stage3_device_cache_evicts_under_its_budget_and_trains_the_same(tmp_path):
    """Stage-3 parameter shards homed on the host are cached on the (CPU stand-in) device tier after each
    gather; with a budget of two shards the cache evicts (counted per step), never holds more than the
    budget, and training is bitwise the run whose cache holds every shard."""
    import infinity
    from infinity.models import GPT, GPTConfig

    def run(path, device_bytes):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=256, block_size=16))
        config = {"zero": {"stage": 3}, "offload": {"params": "host", "grads": "host", "optimizer": "host"},
                  "tiers": {"host_bytes": "64MiB", "device_bytes": device_bytes, "nvme_path": str(path)},
                  "optimizer": {"lr": 1e-2, "threads": 1}, "prefetch": {"bytes": 0}}
        model, opt = infinity.initialize(model, config)
        engine = infinity.engine_of(model)
        try:
            losses, evictions = [], []
            for step in range(3):
                ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                evictions.append(engine.stats.last_step["offload"]["evictions"]["device"])
            shard_bytes = max(u.shard_numel for u in engine.units) * 4
            stats = engine.store.stats()
            with engine.gathered():
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
            return losses, params, evictions, stats, shard_bytes
        finally:
            engine.close()

    ref_losses, ref_params, ref_evictions, ref_stats, shard_bytes = run(tmp_path / "roomy", "64MiB")
    assert sum(ref_evictions) == 0
    budget = 2 * shard_bytes
    losses, params, evictions, stats, _ = run(tmp_path / "tight", budget)
    assert stats["budget_bytes"]["device"] == budget and stats["peak_bytes"]["device"] <= budget
    assert all(n > 0 for n in evictions), evictions   # every step's walk evicts
    assert stats["evictions"]["device"] >= sum(evictions)   # (initialize's placing may evict too)
    assert losses == ref_losses
    assert all(torch.equal(params[n], p) for n, p in ref_params.items())
