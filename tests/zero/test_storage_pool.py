"""StoragePool: the memory of stage 3's full buffers reused between gathers on a CPU device, never
more of it kept than the gathers held at their peak, and the results those of fresh buffers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.zero.storage_pool import StoragePool


def _filled(pool: StoragePool, nbytes: int) -> torch.UntypedStorage:
    s = torch.UntypedStorage(0)
    pool.fill(s, nbytes)
    return s


def test_an_emptied_buffer_is_handed_to_the_next_fill_of_its_size_and_views_follow_the_storage():
    pool = StoragePool(reuse=True)
    full = torch.empty(1024, dtype=torch.float32)
    full.untyped_storage().resize_(0)   # a full buffer of 1024 elements, released
    pool.fill(full.untyped_storage(), 4096)
    view = full[10:20]   # a parameter's view, as a unit's parameters are of its full buffer
    first = full.untyped_storage().data_ptr()
    full.fill_(3.0)
    assert torch.equal(view, torch.full((10,), 3.0)) and view.data_ptr() == first + 40
    pool.empty(full.untyped_storage())
    assert full.untyped_storage().nbytes() == 0 and pool.stats()["idle_bytes"] == 4096
    pool.fill(full.untyped_storage(), 4096)   # the same memory again: no new pages
    assert full.untyped_storage().data_ptr() == first and view.data_ptr() == first + 40
    assert pool.stats() == {"reuse": True, "lent_bytes": 4096, "idle_bytes": 0, "peak_lent_bytes": 4096,
                            "hits": 1, "misses": 1}


def test_kept_memory_never_takes_the_pool_past_the_most_lent_at_once():
    pool = StoragePool(reuse=True)
    a, b = _filled(pool, 8192), _filled(pool, 8192)     # peak: 16 KiB lent
    pool.empty(a)
    pool.empty(b)
    assert pool.stats()["idle_bytes"] == 16384
    c = _filled(pool, 4096)   # another size: no hit; kept memory goes where it would pass the peak
    s = pool.stats()
    assert s["misses"] == 3 and s["lent_bytes"] + s["idle_bytes"] <= s["peak_lent_bytes"] == 16384
    assert s["idle_bytes"] == 8192
    d = _filled(pool, 8192)
    assert pool.stats()["hits"] == 1 and pool.stats()["idle_bytes"] == 0
    for st in (c, d):
        pool.empty(st)
    s = pool.stats()
    assert s["lent_bytes"] == 0 and s["idle_bytes"] <= s["peak_lent_bytes"]
    assert pool.trim() == s["idle_bytes"] and pool.stats()["idle_bytes"] == 0


def test_memory_the_pool_did_not_lend_is_freed_and_without_reuse_it_is_resize():
    pool = StoragePool(reuse=True)
    other = torch.empty(100, dtype=torch.float32).untyped_storage()
    pool.empty(other)
    assert other.nbytes() == 0 and pool.stats()["idle_bytes"] == 0
    plain = StoragePool(reuse=False)
    s = _filled(plain, 4096)
    assert s.nbytes() == 4096
    plain.empty(s)
    assert s.nbytes() == 0 and plain.stats()["idle_bytes"] == 0 and plain.stats()["hits"] == 0
    with pytest.raises(ValueError, match="must be empty"):
        pool.fill(torch.empty(4).untyped_storage(), 16)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _train(reuse: bool, monkeypatch) -> tuple:
    import infinity.zero.engine as engine_mod
    monkeypatch.setattr(engine_mod, "StoragePool", lambda **kw: StoragePool(reuse=reuse))
    torch.manual_seed(0)
    model = _Net()
    model, opt = infinity.initialize(model, {"zero": {"stage": 3}, "optimizer": {"lr": 1e-2}})
    engine = infinity.engine_of(model)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(8, 32, generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = engine.gathers.buffers.stats()
    with engine.gathered():
        params = [p.detach().clone() for p in model.parameters()]
    engine.close()
    assert engine.gathers.buffers.stats()["idle_bytes"] == 0   # close gives the kept memory back
    return losses, params, stats


def test_stage_3_training_reuses_the_full_buffers_and_gives_the_fresh_buffers_results(monkeypatch):
    losses, params, stats = _train(True, monkeypatch)
    fresh_losses, fresh_params, fresh_stats = _train(False, monkeypatch)
    assert losses == fresh_losses
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_params))
    # 4 units gathered twice a step for 3 steps: after the first of each size, every gather is a hit
    assert stats["hits"] >= 12 and stats["misses"] <= 4 and stats["reuse"]
    assert stats["lent_bytes"] + stats["idle_bytes"] <= stats["peak_lent_bytes"]
    assert fresh_stats["hits"] == 0 and not fresh_stats["reuse"]


def test_the_memory_report_counts_what_the_pool_keeps_as_gathered_parameters():
    """After ``gathered()`` (every unit's full buffer at once) the pool keeps that memory for the next
    gathers; a training step then gathers only a few units at once, yet the report's gathered term is
    the memory the full buffers hold, kept ones included, not the step's live peak alone."""
    torch.manual_seed(0)
    # the cap holds the root and two blocks: a step never has all four units at once
    model, opt = infinity.initialize(_Net(), {"zero": {"stage": 3}, "optimizer": {"lr": 1e-2},
                                              "prefetch": {"max_live_bytes": 4096 + 2 * 8192}})
    engine = infinity.engine_of(model)
    try:
        engine.memory.enable()
        with engine.gathered():
            pass
        every_unit = engine.gathers.buffers.stats()["peak_lent_bytes"]
        assert every_unit == sum(u.padded_numel * 4 for u in engine.units)
        for _ in range(2):   # the second step's window starts after gathered()
            model(torch.randn(8, 32)).backward()
            opt.step()
            opt.zero_grad()
        report = engine.memory_report()
        live_peak = engine.stats.last_step["live_peak_bytes"]
        assert live_peak < every_unit   # the step alone held fewer units at once
        assert report["gathered_params_bytes"] == every_unit
    finally:
        engine.close()
