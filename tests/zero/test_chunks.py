"""Stored unit shards split into chunks (``offload.chunk_bytes``): one optimizer job per chunk.

A chunk is the unit of the optimizer's host working set, so a unit larger than
the host budget still trains. The model here has a root unit (embeddings) 2.7x
a block, as GPT-2 2.7B's 128M-element embedding is 1.6x its 80M-element blocks.
Chunking changes where bytes wait, never the arithmetic: every run must equal
the unchunked one bitwise, across placements, a failed step's retry, and a
checkpoint written with one chunk size and loaded with another.
"""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.config import ConfigError
from infinity.models import GPT, GPTConfig
from infinity.store import Tier
from infinity.zero.store_shard import StoreUnitShard

GPT_SHAPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=2048, block_size=32)
SMALL_CHUNK = 96 * 1024   # bytes of all stored classes of one chunk: a few thousand elements


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**GPT_SHAPE))


def _config(path, stage=3, dtype="fp32", offload=None, chunk_bytes=None, host="64MiB", device="64MiB",
            overlap=False):
    off = dict(offload or {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, host_resident_bytes=0)
    if chunk_bytes is not None:
        off["chunk_bytes"] = chunk_bytes
    return {"zero": {"stage": stage}, "precision": {"param_dtype": dtype}, "offload": off,
            "tiers": {"host_bytes": host, "device_bytes": device, "nvme_path": str(path)},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "threads": 1, "update_at": "auto" if overlap else "step"},
            "prefetch": {"bytes": 0}}


def _batch(step):
    return torch.randint(0, GPT_SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(step))


def _train(model, opt, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _params(model):
    with infinity.engine_of(model).gathered():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _run(path, steps=3, **kw):
    model, opt = infinity.initialize(_model(), _config(path, **kw))
    engine = infinity.engine_of(model)
    try:
        losses = _train(model, opt, steps)
        return losses, _params(model), engine.store.keys(), engine.store.stats()
    finally:
        engine.close()


PLACEMENTS = [
    dict(stage=3, dtype="fp32"),
    dict(stage=3, dtype="bf16"),
    dict(stage=3, dtype="bf16", offload={"params": "host", "grads": "nvme", "optimizer": "nvme"}),
    dict(stage=3, dtype="bf16", overlap=False, offload={"params": "nvme", "grads": "host", "optimizer": "host"}),
    dict(stage=2, dtype="bf16", offload={"params": "none", "grads": "nvme", "optimizer": "nvme"}),
    dict(stage=2, dtype="fp32", overlap=True, offload={"params": "none", "grads": "nvme", "optimizer": "nvme"}),
    dict(stage=1, dtype="fp32", offload={"params": "none", "grads": "none", "optimizer": "nvme"}),
]


@pytest.mark.parametrize("kw", PLACEMENTS, ids=lambda kw: f"z{kw['stage']}-{kw['dtype']}-" + "-".join(
    f"{k[0]}{v}" for k, v in (kw.get("offload") or {}).items()) + ("-overlap" if kw.get("overlap") else ""))
def test_chunked_training_equals_unchunked(tmp_path, kw):
    ref_losses, ref_params, ref_keys, _ = _run(tmp_path / "whole", **kw)
    losses, params, keys, _ = _run(tmp_path / "chunks", chunk_bytes=SMALL_CHUNK, **kw)
    assert "u0.exp_avg" in ref_keys and not any(k.count(".") > 1 for k in ref_keys)
    # the root unit (embeddings, 133K elements) is cut into many chunks, each its own key
    assert "u0.exp_avg.3" in keys and "u0.exp_avg" not in keys, sorted(keys)[:8]
    assert losses == ref_losses
    for name, want in ref_params.items():
        assert torch.equal(params[name], want), f"{name}: chunked run differs from the unchunked one"


def test_chunks_bound_the_tier_minimums_and_it_trains_there(tmp_path):
    """Unchunked, one optimizer job holds the whole root unit's states and a gather its whole parameter
    shard: the host and device minimums are unit-sized. Chunked, both are chunk-sized, initialize
    accepts those budgets, training stays inside them, and the losses equal the unchunked run's."""
    def minimum(path, chunk_bytes):
        model, _ = infinity.initialize(_model(), _config(path, chunk_bytes=chunk_bytes))
        engine = infinity.engine_of(model)
        try:
            root = max(engine.units, key=lambda u: u.shard_numel)
            need = engine.placement.min_budgets()
            return need[Tier.HOST][0], root.shard_numel, need[Tier.DEVICE][0]
        finally:
            engine.close()

    whole, root_numel, whole_device = minimum(tmp_path / "p1", None)
    chunked, _, chunked_device = minimum(tmp_path / "p2", SMALL_CHUNK)
    # a stage-3 gather pins one chunk of the parameter shard at a time on the device tier
    assert whole_device == 4 * root_numel and chunked_device * 8 < whole_device, (chunked_device, whole_device)
    assert whole == 16 * root_numel           # fp32: param (= master), m, v, grad of the whole root unit
    assert chunked <= SMALL_CHUNK < whole / 4, (chunked, whole)

    with pytest.raises(ConfigError, match=rf"tiers.host_bytes = {chunked} bytes .* below the {whole} bytes"):
        infinity.initialize(_model(), _config(tmp_path / "refused", host=chunked))
    ref_losses, ref_params, _, _ = _run(tmp_path / "ref")
    losses, params, _, stats = _run(tmp_path / "tight", chunk_bytes=SMALL_CHUNK, host=chunked,
                                    device=max(chunked_device, 4096))
    assert stats["peak_bytes"]["host"] <= chunked and stats["peak_bytes"]["device"] <= chunked_device
    assert losses == ref_losses
    assert all(torch.equal(params[n], p) for n, p in ref_params.items())


def test_a_step_failing_between_chunks_of_a_unit_is_retried_from_the_next_chunk(tmp_path):
    """Adam raises on the 4th chunk of the step (inside the root unit): step() raises, the first 3
    chunks stay updated, zero_grad refuses, and the retry updates only the rest: the run then equals
    an uninterrupted one bitwise (a chunk updated twice would not)."""
    ref_losses, ref_params, _, _ = _run(tmp_path / "ref", chunk_bytes=SMALL_CHUNK)
    model, opt = infinity.initialize(_model(), _config(tmp_path / "run", chunk_bytes=SMALL_CHUNK))
    engine = infinity.engine_of(model)
    try:
        losses = _train(model, opt, 1)
        ids = _batch(1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        adam, calls = engine.update.adam, []
        real = adam.step_

        def failing(*a, **k):
            calls.append(1)
            if len(calls) == 4:
                raise OSError("injected: Adam failed on a chunk")
            return real(*a, **k)

        adam.step_ = failing
        with pytest.raises(OSError, match="injected"):
            opt.step()
        adam.step_ = real
        root = engine.units[0]
        assert root.chunks_updated == 3 and not root.updated, (root.chunks_updated, len(root.shard.chunks()))
        with pytest.raises(RuntimeError, match="step"):
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
        losses += _train(model, opt, 1, first=2)
        assert losses == ref_losses
        params = _params(model)
        assert all(torch.equal(params[n], p) for n, p in ref_params.items())
    finally:
        engine.close()


def test_a_checkpoint_moves_between_chunk_sizes(tmp_path):
    """Saved with chunked shards, loaded into an unchunked engine (and the other way), training goes on
    exactly as an uninterrupted run: a checkpoint holds whole unit shards, whatever their chunks."""
    ref_losses, ref_params, _, _ = _run(tmp_path / "ref", steps=4)
    for first, second, tag in ((SMALL_CHUNK, None, "c2w"), (None, SMALL_CHUNK, "w2c")):
        model, opt = infinity.initialize(_model(), _config(tmp_path / f"{tag}-a", chunk_bytes=first))
        losses = _train(model, opt, 2)
        infinity.save_checkpoint(tmp_path / f"{tag}-ckpt", model, opt)
        infinity.engine_of(model).close()
        model, opt = infinity.initialize(_model(), _config(tmp_path / f"{tag}-b", chunk_bytes=second))
        try:
            infinity.load_checkpoint(tmp_path / f"{tag}-ckpt", model, opt)
            losses += _train(model, opt, 2, first=2)
            params = _params(model)
        finally:
            infinity.engine_of(model).close()
        assert losses == ref_losses, tag
        assert all(torch.equal(params[n], p) for n, p in ref_params.items()), tag


def test_one_rank_assembles_a_chunked_parameter_shard_in_the_full_buffer(tmp_path, monkeypatch):
    """At one rank a unit's full buffer is its shard: a stage-3 gather copies each stored chunk straight
    into it, with no shard-sized buffer between and nothing left for the all-gather to copy; training
    is bitwise the unchunked run's (a chunk copied to the wrong place, or a version bump autograd
    catches, would show)."""
    gathers = []
    original = StoreUnitShard.param_for_gather

    def spy(self, into=None):
        src, done = original(self, into)
        if self.chunked:
            gathers.append((self.unit_index, into is not None and src.data_ptr() == into.data_ptr()))
        return src, done

    monkeypatch.setattr(StoreUnitShard, "param_for_gather", spy)
    ref_losses, ref_params, _, _ = _run(tmp_path / "whole", dtype="bf16")
    assert gathers == []
    losses, params, _, _ = _run(tmp_path / "chunks", dtype="bf16", chunk_bytes=SMALL_CHUNK)
    assert gathers and all(in_place for _, in_place in gathers), gathers
    assert {index for index, _ in gathers} == {0, 1, 2}   # the root and both blocks, forward and backward
    assert losses == ref_losses
    assert all(torch.equal(params[n], p) for n, p in ref_params.items())
