"""``offload.host_resident_bytes``: chunks homed on NVMe kept in host memory for good.

A training step walks every unit in the same order, so an LRU host cache smaller
than the state hits nothing: each chunk is evicted just before it is needed again,
and every chunk is read and written once a step whatever the budget. Homing some
chunks in host memory instead takes their transfers off the disk for good. Where
a chunk lives must never change the arithmetic, only the bytes the disk moves.
"""

from __future__ import annotations

import errno
import time

import pytest
import torch

import infinity
from failure_cases import wait_store_idle
from infinity.config import ConfigError
from infinity.models import GPT, GPTConfig
from infinity.optim.pipeline import AdamPipeline
from infinity.store import Tier, rooms
from infinity.store.budget import plan_spill
from infinity.store.residency import Residency
from infinity.zero.placement import UnitPlacement
from infinity.zero.units import TensorClass

GPT_SHAPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=2048, block_size=32)
CHUNK = 96 * 1024    # bytes of one chunk's stored classes (18 B/element here): 4096 elements
WRITTEN = (TensorClass.PARAM, TensorClass.MASTER, TensorClass.EXP_AVG, TensorClass.EXP_AVG_SQ)
PER_ELEMENT_WRITTEN = 2 + 4 + 4 + 4   # bf16 parameter, fp32 master and moments: each written once a step


def _config(path, resident, host="2MiB", overlap=True):
    return {"zero": {"stage": 3}, "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "offload": {"params": "nvme", "grads": "nvme", "optimizer": "nvme", "chunk_bytes": CHUNK,
                        "host_resident_bytes": resident},
            "tiers": {"host_bytes": host, "device_bytes": "1MiB", "nvme_path": str(path)},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "threads": 1, "update_at": "auto" if overlap else "step"},
            "prefetch": {"bytes": 0}}


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**GPT_SHAPE))


def _train(model, opt, steps, first=0):
    engine = infinity.engine_of(model)
    losses, writes = [], []
    for step in range(first, first + steps):
        ids = torch.randint(0, GPT_SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        writes.append(engine.stats.last_step["offload"]["moved_bytes"].get("host->nvme", 0))
    return losses, writes


def _params(model):
    with infinity.engine_of(model).gathered():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _homes(engine) -> dict:
    """{(unit index, class, chunk): home tier} of every stored chunk."""
    return {(u.index, cls, c): engine.store.home(key)
            for u in engine.units for cls in TensorClass for c, key in enumerate(u.shard.keys(cls))}


def _run(path, resident, steps=3, host="2MiB"):
    model, opt = infinity.initialize(_model(), _config(path, resident, host))
    engine = infinity.engine_of(model)
    try:
        losses, writes = _train(model, opt, steps)
        homes = _homes(engine)
        nbytes = _nbytes(engine)
        reported = engine.stats.last_step["offload"]["host_resident_bytes"]   # what the step reports
        assert reported == sum(n for k, n in nbytes.items() if homes[k] is Tier.HOST), reported
        return losses, writes, _params(model), homes, nbytes, sum(u.shard_numel for u in engine.units)
    finally:
        engine.close()


def _nbytes(engine) -> dict:
    """{(unit index, class, chunk): bytes} of every stored chunk."""
    itemsize = {TensorClass.PARAM: 2, TensorClass.GRAD: 4}   # the rest are fp32 optimizer states
    return {(u.index, cls, c): itemsize.get(cls, 4) * (hi - lo)
            for u in engine.units for cls in TensorClass if u.shard.keys(cls)
            for c, (lo, hi) in enumerate(u.shard.bounds)}


def test_resident_chunks_change_the_disk_bytes_not_the_numbers(tmp_path):
    """512 KiB resident: every parameter chunk first (3 transfers a step per byte), then whole chunks of
    optimizer states, the root unit's first (its update is the step's tail), then the other units in
    forward order, until the room is full. The run equals the all-on-disk one bitwise, and each step
    writes exactly the resident chunks' bytes less."""
    room = 512 * 1024
    ref_losses, ref_writes, ref_params, ref_homes, _, numel = _run(tmp_path / "disk", 0)
    losses, writes, params, homes, nbytes, _ = _run(tmp_path / "resident", room)

    assert set(ref_homes.values()) == {Tier.NVME}
    assert losses == ref_losses
    assert all(torch.equal(params[n], p) for n, p in ref_params.items())

    resident = {k for k, tier in homes.items() if tier is Tier.HOST}
    assert {k for k in homes if k[1] is TensorClass.PARAM} <= resident          # parameters first, all of them
    assert not any(k[1] is TensorClass.GRAD for k in resident)                 # gradients never reach the disk here
    optimizer = sorted((u, c) for u, cls, c in resident if cls is TensorClass.MASTER)
    for u, c in optimizer:   # a chunk's master and moments together
        assert {(u, TensorClass.EXP_AVG, c), (u, TensorClass.EXP_AVG_SQ, c)} <= resident
    root = max(u for u, _, _ in homes)   # the root unit is the last one
    all_chunks = sorted((u != root, u, c) for u, cls, c in homes if cls is TensorClass.MASTER)
    all_chunks = [(u, c) for _, u, c in all_chunks]
    optimizer = [(u, c) for _, u, c in sorted((u != root, u, c) for u, c in optimizer)]
    assert optimizer and optimizer == all_chunks[:len(optimizer)] and len(optimizer) < len(all_chunks)
    used = sum(nbytes[k] for k in resident)
    nxt = all_chunks[len(optimizer)]
    next_bytes = sum(nbytes[(nxt[0], cls, nxt[1])] for cls in (TensorClass.MASTER, TensorClass.EXP_AVG,
                                                                TensorClass.EXP_AVG_SQ))
    assert used <= room < used + next_bytes                                    # filled greedily, never past it

    assert ref_writes[1:] == [PER_ELEMENT_WRITTEN * numel] * 2, (ref_writes, numel)
    saved = sum(nbytes[k] for k in resident if k[1] in WRITTEN)
    assert writes[1:] == [PER_ELEMENT_WRITTEN * numel - saved] * 2, (writes, saved)


def test_auto_keeps_what_the_budget_holds_beyond_the_working_room(tmp_path):
    """auto: nothing on a budget the step needs whole; everything (no disk write at all) when the state
    fits beside the working room; the numbers stay the all-on-disk run's."""
    ref_losses, _, ref_params, _, _, _ = _run(tmp_path / "disk", 0, steps=2)
    # the minimum is the root's whole gradient shard (512 KiB) + one 72 KiB job; with 3 more jobs: 800 KiB
    _, writes, _, homes, _, _ = _run(tmp_path / "tight", "auto", steps=2, host="800KiB")
    assert set(homes.values()) == {Tier.NVME} and writes[1] > 0
    losses, writes, params, homes, _, _ = _run(tmp_path / "roomy", "auto", steps=2, host="16MiB")
    assert {tier for (_, cls, _), tier in homes.items() if cls is not TensorClass.GRAD} == {Tier.HOST}
    assert writes == [0, 0]
    assert losses == ref_losses and all(torch.equal(params[n], p) for n, p in ref_params.items())


def _lagging(monkeypatch, where: str) -> None:
    """Make the overlapped update fall behind backward: each Adam call, or each swap-in, starts 20 ms late."""
    if where == "adam":
        update = AdamPipeline._update
        monkeypatch.setattr(AdamPipeline, "_update", lambda self, *a: (time.sleep(0.02), update(self, *a))[1])
    else:
        swap_in = AdamPipeline._swap_in

        class _LateQueue:
            def __init__(self, jobs):
                self.jobs = jobs

            def get(self):
                time.sleep(0.02)
                return self.jobs.get()

        monkeypatch.setattr(AdamPipeline, "_swap_in", lambda self, jobs, ready: swap_in(self, _LateQueue(jobs), ready))


@pytest.mark.parametrize("where", ["adam", "swap-in"])
def test_an_update_behind_backward_spills_gradients_and_folds_each_once(tmp_path, monkeypatch, where):
    """At the smallest budget (the root's whole gradient + a few jobs), an update that lags backward
    leaves block gradients unwritten in host memory while the root's is folded: the folds run out of the
    host room the update's look-ahead leaves them. Then deferred gradients are written home (spilled)
    rather than refused, each fold runs once, and every number equals the run without the lag."""
    ref_losses, _, ref_params, _, _, _ = _run(tmp_path / "ref", 0, steps=2, host="800KiB")
    _lagging(monkeypatch, where)
    model, opt = infinity.initialize(_model(), _config(tmp_path / "lag", 0, "800KiB"))
    engine = infinity.engine_of(model)
    try:
        losses, spills = [], []
        for step in range(2):
            loss, _ = _train(model, opt, 1, first=step)
            losses += loss
            spills.append(engine.stats.last_step["offload"]["spills"])
        assert sum(spills) == engine.store.stats()["spills"]["host"]   # each step reports its own
        assert sum(spills) > 0   # the squeeze happened: only a spill frees room beside the update
        assert losses == ref_losses
        params = _params(model)
        assert all(torch.equal(params[n], p) for n, p in ref_params.items())
    finally:
        engine.close()


def test_a_full_disk_during_a_spill_names_the_cause(tmp_path, monkeypatch):
    """ENOSPC while deferred gradients are spilled for room: backward fails with the disk's error (not
    a BudgetError), the copies that could not be written stay in host memory, dirty, and the engine
    refuses to apply the partial gradients."""
    _lagging(monkeypatch, "swap-in")
    chosen, held = [], {}

    def failing(records, tier, nbytes, room=None):
        keys = plan_spill(records, tier, nbytes, room)
        if keys and not chosen:   # the first spill's writes (and every later one) fail: the disk is full
            held["store"]._engine.syscalls.inject("pwritev", errno.ENOSPC, count=10 ** 6)
        chosen.extend(keys)
        return keys

    monkeypatch.setattr(rooms, "plan_spill", failing)
    model, opt = infinity.initialize(_model(), _config(tmp_path, 0, "800KiB"))
    engine = infinity.engine_of(model)
    held["store"] = engine.store
    try:
        with pytest.raises(OSError, match="No space left on device") as err:
            _train(model, opt, 2)
        assert err.value.errno == errno.ENOSPC
        assert any("to make room failed" in n for n in getattr(err.value, "__notes__", [])), err.value
        engine.store._engine.syscalls.clear()
        wait_store_idle(engine.store)
        assert chosen
        assert all(engine.store.is_dirty(k) and engine.store.residency(k)[Tier.HOST] is Residency.RESIDENT
                   for k in chosen if engine.store.residency(k)[Tier.HOST] is not Residency.ABSENT)
        assert any(engine.store.is_dirty(k) for k in chosen)
        with pytest.raises(RuntimeError, match="raised part-way"):   # the partial gradients are not applied
            opt.step()
    finally:
        engine.store._engine.syscalls.clear()
        engine.close()


def test_a_room_that_starves_the_step_is_refused_at_initialize(tmp_path):
    """An explicit size must leave the step its minimum host budget; the error names the key and sizes."""
    with pytest.raises(ConfigError, match=r"offload\.host_resident_bytes = 1\.5 ?MiB leaves 512\.0 ?KiB of "
                                          r"tiers\.host_bytes \(2\.0 ?MiB\) for the step, below the 584\.0 ?KiB"):
        infinity.initialize(_model(), _config(tmp_path / "swap", "1536KiB"))
    assert not any(p.is_file() for p in (tmp_path / "swap").rglob("*"))


def test_a_checkpoint_moves_between_resident_and_disk_homes(tmp_path):
    """Saved from an engine with resident chunks, loaded into one with none (and back): training goes on
    exactly as an uninterrupted run."""
    ref_losses, _, ref_params, _, _, _ = _run(tmp_path / "ref", 0, steps=4)
    for first, second, tag in ((512 * 1024, 0, "r2d"), (0, 512 * 1024, "d2r")):
        model, opt = infinity.initialize(_model(), _config(tmp_path / f"{tag}-a", first))
        losses, _ = _train(model, opt, 2)
        infinity.save_checkpoint(tmp_path / f"{tag}-ckpt", model, opt)
        infinity.engine_of(model).close()
        model, opt = infinity.initialize(_model(), _config(tmp_path / f"{tag}-b", second))
        try:
            infinity.load_checkpoint(tmp_path / f"{tag}-ckpt", model, opt)
            losses += _train(model, opt, 2, first=2)[0]
            params = _params(model)
        finally:
            infinity.engine_of(model).close()
        assert losses == ref_losses, tag
        assert all(torch.equal(params[n], p) for n, p in ref_params.items()), tag


def _stream_run(path, host, steps=3):
    """Losses, parameters, per-step disk reads and the engine's host state after ``steps`` (resident 0)."""
    model, opt = infinity.initialize(_model(), _config(path, 0, host))
    engine = infinity.engine_of(model)
    try:
        losses, reads = [], []
        for step in range(steps):
            losses += _train(model, opt, 1, first=step)[0]
            reads.append(engine.stats.last_step["offload"]["moved_bytes"].get("nvme->host", 0))
        states = [key for u in engine.units for cls in (TensorClass.MASTER, TensorClass.EXP_AVG,
                                                        TensorClass.EXP_AVG_SQ) for key in u.shard.keys(cls)]
        cached = [key for key in states if engine.store.residency(key)[Tier.HOST] is not Residency.ABSENT]
        pool = engine.store.pool.stats()
        return losses, _params(model), reads, len(states), cached, pool
    finally:
        engine.close()


def test_streamed_states_keep_no_host_copy_and_read_no_more(tmp_path, monkeypatch):
    """Optimizer states larger than the host budget are read and written once a step whatever is cached,
    so their host copies are freed once written home: none is left after a step, the pool holds no idle
    buffer, and the step reads no more than with the copies kept (here less: kept copies pushed out
    parameter copies the next pass would have found), with the same numbers. On a
    budget that holds them all they stay cached, and a step reads none of them again."""
    losses, params, reads, n_states, cached, pool = _stream_run(tmp_path / "stream", "2MiB")
    assert n_states > 0 and cached == [] and pool["cached_bytes"] == 0
    with monkeypatch.context() as m:
        m.setattr(UnitPlacement, "streams_optimizer", lambda *a, **k: False)
        ref_losses, ref_params, ref_reads, _, ref_cached, ref_pool = _stream_run(tmp_path / "kept", "2MiB")
    assert ref_cached and ref_pool["cached_bytes"] + ref_pool["in_use_bytes"] > pool["in_use_bytes"]
    assert losses == ref_losses and all(torch.equal(params[n], p) for n, p in ref_params.items())
    assert all(r <= k for r, k in zip(reads, ref_reads)) and reads[-1] > 0, (reads, ref_reads)

    roomy_losses, _, roomy_reads, _, roomy_cached, _ = _stream_run(tmp_path / "roomy", "16MiB")
    assert len(roomy_cached) == n_states and roomy_losses == losses
    assert roomy_reads[-1] < reads[-1]


def test_a_full_disk_while_streaming_loses_nothing(tmp_path):
    """ENOSPC on a streamed state's write-back (evict: written home, then dropped): the step fails naming
    the cause, the copy that could not be written stays in host memory, and the retry writes it; training
    then goes on bitwise as a run that never failed."""
    def run(path, fail_at):
        model, opt = infinity.initialize(_model(), _config(path, 0, overlap=False))
        engine = infinity.engine_of(model)
        assert any(u.shard.dropped_after_update(0) for u in engine.units)   # states are streamed here
        losses = []
        try:
            for step in range(3):
                ids = torch.randint(0, GPT_SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(step))
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.item())
                if step == fail_at:
                    wait_store_idle(engine.store, engine.grads)
                    engine.store._engine.syscalls.inject("pwritev", errno.ENOSPC, count=1)
                    try:
                        with pytest.raises(OSError, match="No space left on device") as err:
                            opt.step()
                        assert err.value.errno == errno.ENOSPC
                    finally:
                        engine.store._engine.syscalls.clear()
                    streamed = [k for u in engine.units for c in range(len(u.shard.chunks()))
                                for k in u.shard.dropped_after_update(c)]
                    assert any(engine.store.is_dirty(k) for k in streamed)   # kept unwritten, not dropped
                opt.step()   # the retry (a plain step when nothing failed)
                opt.zero_grad()
            return losses, _params(model)
        finally:
            engine.close()

    ref_losses, ref_params = run(tmp_path / "ref", None)
    losses, params = run(tmp_path / "full", 1)
    assert losses == ref_losses
    assert all(torch.equal(params[n], p) for n, p in ref_params.items())
