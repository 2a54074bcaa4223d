"""A speculative update's spares of one unit's shard (:class:`SpareSet`), without a schedule: a spare key
beside each chunk key of a stored class, shared by aliases; a spare tensor for a class in memory; commit
swaps the keys (aliases together, no bytes moved) and copies the tensors; the current copies are untouched
until then."""

from __future__ import annotations

import pytest
import torch

from infinity.config import IOConfig, TiersConfig
from infinity.store import TensorStore, Tier
from infinity.zero.placement import Placement
from infinity.zero.spares import SpareSet
from infinity.zero.speculation import spare_classes
from infinity.zero.store_shard import LentCopies, StoreUnitShard
from infinity.zero.units import TensorClass

NUMEL = 4096 * 4


@pytest.fixture
def store(tmp_path):
    s = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=1 << 20, nvme_path=str(tmp_path)),
                    IOConfig(block_bytes=16384, queue_depth=4, threads=2))
    yield s
    s.close()


def _shard(store, chunks=None) -> StoreUnitShard:
    """Optimizer states on NVMe, the parameter in memory, the master an alias of the parameter (fp32)."""
    placement = Placement(params=None, grads=Tier.HOST, optimizer=Tier.NVME, chunk_bytes=1 << 20, spares=True)
    shard = StoreUnitShard(store, 0, placement, LentCopies(store), chunks)
    shard.put(TensorClass.PARAM, torch.arange(NUMEL, dtype=torch.float32))
    shard.alias(TensorClass.MASTER, TensorClass.PARAM)
    for cls in (TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ):
        shard.put(cls, torch.full((NUMEL,), float(cls is TensorClass.EXP_AVG_SQ) + 1))
    return shard


@pytest.mark.parametrize("chunks", (None, [(0, NUMEL // 2), (NUMEL // 2, NUMEL)]))
def test_spares_are_written_apart_and_commit_swaps_them_in(store, chunks):
    shard = _shard(store, chunks)
    spares = SpareSet(shard, spare_classes())
    n = len(shard.chunks())
    moment = shard.keys(TensorClass.EXP_AVG)
    assert [spares.field(TensorClass.EXP_AVG, c) for c in range(n)] == [f"{k}~" for k in moment]
    assert all(store.home(f"{k}~") is Tier.NVME for k in moment)   # beside the current key, same home
    param_spares = [spares.field(TensorClass.PARAM, c) for c in range(n)]   # in memory: a tensor per chunk
    assert all(isinstance(t, torch.Tensor) for t in param_spares)
    for c in range(n):   # a speculation writes its results into the spares only
        for cls, value in ((TensorClass.EXP_AVG, 7.0), (TensorClass.EXP_AVG_SQ, 5.0)):
            with store.use(spares.field(cls, c), Tier.HOST, dirty=True) as t:
                t.fill_(value)
        param_spares[c].fill_(-1.0)
    assert torch.equal(shard.read(TensorClass.EXP_AVG), torch.full((NUMEL,), 1.0))
    assert torch.equal(shard.read(TensorClass.PARAM), torch.arange(NUMEL, dtype=torch.float32))
    spares.commit(spare_classes())
    assert shard.keys(TensorClass.EXP_AVG) == tuple(f"{k}~" for k in moment)
    assert [spares.field(TensorClass.EXP_AVG, c) for c in range(n)] == list(moment)   # the old key, the next spare
    assert torch.equal(shard.read(TensorClass.EXP_AVG), torch.full((NUMEL,), 7.0))
    assert torch.equal(shard.read(TensorClass.PARAM), torch.full((NUMEL,), -1.0))
    assert torch.equal(shard.read(TensorClass.MASTER), torch.full((NUMEL,), -1.0))   # the alias is the param
    assert torch.equal(shard.read(TensorClass.EXP_AVG_SQ), torch.full((NUMEL,), 5.0))
    spares.release()
    shard.release()
    assert store.stats()["keys"] == 0


def test_aliased_stored_classes_share_one_spare_and_move_together(store):
    placement = Placement(params=None, grads=Tier.HOST, optimizer=Tier.HOST, chunk_bytes=1 << 20, spares=True)
    shard = StoreUnitShard(store, 0, placement, LentCopies(store))
    shard.put(TensorClass.MASTER, torch.zeros(NUMEL))
    shard.put(TensorClass.EXP_AVG, torch.zeros(NUMEL))
    shard._keys[TensorClass.EXP_AVG_SQ] = shard.keys(TensorClass.EXP_AVG)   # an alias, as the master of a param
    spares = SpareSet(shard, spare_classes())
    assert spares.field(TensorClass.EXP_AVG_SQ) == spares.field(TensorClass.EXP_AVG)
    old = shard.keys(TensorClass.EXP_AVG)
    spares.commit(spare_classes())
    assert shard.keys(TensorClass.EXP_AVG) is shard.keys(TensorClass.EXP_AVG_SQ) != old
    assert spares.field(TensorClass.EXP_AVG_SQ) == spares.field(TensorClass.EXP_AVG) == old[0]
    spares.release()
    shard.release()
