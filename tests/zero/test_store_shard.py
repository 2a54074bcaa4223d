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
