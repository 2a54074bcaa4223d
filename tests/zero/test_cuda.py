"""The CUDA path of offloading: pinned host buffers, device-tier gathers, device gradients to CPU Adam.

Marked ``cuda`` (``pytest -m cuda``); skipped cleanly without a CUDA device.
Each trains the test GPT (world size 1, no process group) with offload and
compares it with the same model trained by the in-memory engine on the same
GPU: fp32, so only kernel/reduction order differs (loss within 1e-4 relative).
"""

from __future__ import annotations

import pytest
import torch

import infinity
import offload_cases
from zero_cases import build_model, global_batch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BASE = dict(model="gpt", steps=3, batch=8, lr=1e-2, groups=True)


def _steps(model, opt, spec: dict) -> list:
    """``spec["steps"]`` training steps on the test batches, moved to the GPU; their losses."""
    losses = []
    for step in range(spec["steps"]):
        ids = global_batch(step, spec["batch"]).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(spec: dict) -> dict:
    model = build_model("gpt")
    conf = offload_cases.offload_config(spec, 0) if spec.get("offload") else offload_cases.zero_cases.config_for(spec)
    model, opt = infinity.initialize(model, conf, params=offload_cases.param_groups(model, spec))
    engine = infinity.engine_of(model)
    assert engine.device.type == "cuda"
    try:
        losses = _steps(model, opt, spec)
        pinned = None
        if engine.store is not None:
            key = next(k for k in engine.store.keys() if k.endswith(".exp_avg"))
            pinned = engine.store.wait(engine.store.bring(key, "host")).is_pinned()
        with engine.gathered():
            params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return {"losses": losses, "params": params, "pinned": pinned}


@pytest.fixture(scope="module")
def in_memory():
    return _train(dict(BASE, stage=3))


@pytest.mark.parametrize("stage,offload", [
    (3, dict(optimizer="nvme", params="nvme", grads="host")),
    (3, dict(optimizer="host", params="host", grads="none")),   # device gradients -> host Adam
    (2, dict(optimizer="nvme", params="none", grads="none")),   # device params written back from host
    (3, dict(optimizer="none", params="nvme", grads="host")),   # states in device memory, params on NVMe
])
def test_offloaded_matches_in_memory_on_cuda(tmp_path, in_memory, stage, offload):
    got = _train(dict(BASE, stage=stage, offload=offload, tmp=str(tmp_path), host_bytes=1 << 20,
                      device_bytes=1 << 20))
    for step, (a, b) in enumerate(zip(got["losses"], in_memory["losses"])):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: loss {a} vs in-memory {b}"
    for name, ref in in_memory["params"].items():
        diff = (got["params"][name] - ref).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs diff {diff}"
    if offload["optimizer"] != "none":
        assert got["pinned"], "host copies of offloaded states must be page-locked on CUDA"


@pytest.mark.parametrize("grads", ("nvme", "host"))
def test_gradient_folds_leave_a_delayed_stream_with_its_bytes(tmp_path, grads):
    """A gradient produced behind a sleep on the compute stream is folded into a stored shard without
    waiting: the device->host copy (claimed or staged, on the copier's side stream) must follow the
    producer, so every first gradient and every accumulated sum equals what the device holds."""
    from infinity.config import IOConfig, TiersConfig
    from infinity.store import TensorStore, Tier
    from infinity.zero.placement import Placement
    from infinity.zero.store_shard import LentCopies, StoreUnitShard
    from infinity.zero.units import TensorClass

    numel = 1 << 20
    device = torch.device("cuda", torch.cuda.current_device())
    store = TensorStore(TiersConfig(device_bytes=64 << 20, host_bytes=64 << 20, nvme_path=str(tmp_path)),
                        IOConfig(), device=device)
    try:
        placement = Placement(params=None, grads=Tier.NVME if grads == "nvme" else Tier.HOST, optimizer=None,
                              chunk_bytes=1 << 30)
        shard = StoreUnitShard(store, 0, placement, LentCopies(store), [(0, numel // 2), (numel // 2, numel)])
        shard.put_zeros(TensorClass.GRAD, numel, torch.float32, device)
        stale = 0
        for k in range(8):
            first = k % 4 == 0
            reduced = torch.empty(numel, device=device)
            torch.cuda._sleep(2_000_000)
            reduced.fill_(float(k + 1))                   # queued behind the sleep on the compute stream
            write = shard.fold_grad(reduced, first)       # returns before the bytes have left
            write.result()
            want = sum(float(j + 1) for j in range(k - k % 4, k + 1))
            stale += int(not torch.equal(shard.read(TensorClass.GRAD), torch.full((numel,), want)))
        assert stale == 0, f"{stale} folds read the gradient before its producer had written it"
        shard.release()
    finally:
        store.close()


@pytest.mark.parametrize("tier", ("host", "nvme"))
def test_offloaded_activations_are_bitwise_on_cuda(tmp_path, tier):
    """zero.activation_offload on a CUDA device: each checkpointed unit's input leaves the device on the
    copier's stream after the kernels that made it, and comes back for its recompute; the same GPU, the
    same kernels: bitwise the run that keeps them (the size floor lifted: this model's inputs are small)."""
    from infinity.zero import activations

    spec = dict(BASE, stage=3, steps=2)

    def run(offload):
        conf = offload_cases.zero_cases.config_for(spec)
        conf["zero"].update(activation_checkpointing=True, activation_offload=offload)
        conf.setdefault("tiers", {})["nvme_path"] = str(tmp_path)
        model, opt = infinity.initialize(build_model("gpt"), conf)
        engine = infinity.engine_of(model)
        try:
            losses = _steps(model, opt, spec)
            moved = engine.activations.stats["saved_bytes"] if engine.activations is not None else 0
            with engine.gathered():
                params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        finally:
            engine.close()
        return losses, params, moved

    before, activations.MIN_BYTES = activations.MIN_BYTES, 0
    try:
        keep, got = run("none"), run(tier)
    finally:
        activations.MIN_BYTES = before
    assert got[2] > 0 and got[0] == keep[0]
    assert all(torch.equal(got[1][n], p) for n, p in keep[1].items())
