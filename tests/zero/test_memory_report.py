"""The engine's per-step memory report (``infinity.zero.memory_report``): what it counts, in process.

The whole-process claims (peak RSS within the predicted bound) are in test_rss_bound.py, in a child.
"""

from __future__ import annotations

import re

import pytest
import torch

import infinity
import infinity.zero.memory_report as memory_report
from infinity.models import GPT, GPTConfig
from infinity.zero.memory_report import SavedTensorMeter

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=32)


def _engine(tmp_path, offload: bool, stage: int = 3):
    torch.manual_seed(0)
    conf = {"zero": {"stage": stage}, "prefetch": {"bytes": 0}}
    if offload:
        conf["offload"] = {"optimizer": "nvme", "params": "nvme", "grads": "nvme"}
        conf["tiers"] = {"host_bytes": "4MiB", "device_bytes": "1MiB", "nvme_path": str(tmp_path)}
    model, opt = infinity.initialize(GPT(CFG), conf)
    return model, opt, infinity.engine_of(model)


def _step(model, opt, batch: int = 2, seq: int = 32):
    ids = torch.randint(0, CFG.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_meter_counts_each_storage_once_skips_parameters_and_drains():
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(16, 64, requires_grad=True)
    meter = SavedTensorMeter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        h = x @ w            # saves x (a leaf that requires grad: skipped, like a parameter) and w
        y = h.exp()          # saves its result: 16 x 64 fp32
        z = (y * y).sum()    # saves y twice: one storage
    assert meter.live_bytes == 16 * 64 * 4 == meter.peak_bytes
    z.backward()
    assert meter.live_bytes == 0 and meter.take_peak() == 16 * 64 * 4 and meter.peak_bytes == 0


def test_warm_torch_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    memory_report.warm_torch()
    assert torch.equal(torch.rand(4), expected)


def test_report_keys_are_the_documented_ones(tmp_path):
    model, opt, engine = _engine(tmp_path, offload=True)
    try:
        assert engine.memory_report() is None            # not enabled
        _step(model, opt)
        assert engine.memory_report() is None
        engine.memory.enable()
        _step(model, opt)
        report = engine.memory_report()
    finally:
        engine.close()
    table = memory_report.__doc__.split("======================  ==")[2]
    documented = set(re.findall(r"^([a-z_]+)\s", table, re.MULTILINE))
    assert set(report) == documented
    assert report["peak_rss_source"] in ("VmHWM", "ru_maxrss")
    parts = ("store_host_bytes", "store_device_bytes", "gathered_params_bytes", "grad_buffers_bytes",
             "resident_bytes", "activation_bytes")
    assert report["accounted_bytes"] == report["baseline_rss_bytes"] + sum(report[k] for k in parts)
    if report["peak_rss_bytes"] is not None:
        assert report["other_bytes"] == report["peak_rss_bytes"] - report["accounted_bytes"]
        assert report["peak_rss_bytes"] >= report["rss_bytes"] > 0


def test_parts_on_an_offloaded_stage3_step(tmp_path):
    model, opt, engine = _engine(tmp_path, offload=True)
    try:
        engine.memory.enable()
        _step(model, opt)
        r = engine.memory_report()
        units = engine.units
        largest_full = max(u.padded_numel for u in units) * 4
        assert 0 < r["store_host_bytes"] <= 4 * 2**20 and 0 < r["store_device_bytes"] <= 2**20
        assert r["gathered_params_bytes"] == engine.stats.last_step["live_peak_bytes"] > 0
        # full fp32 gradients of at least one unit waited for their reduction
        assert r["grad_buffers_bytes"] >= largest_full
        assert r["resident_bytes"] == 0                 # everything is in the store
        # a (2, 32) batch saves at least the logits' log-softmax (2 x 32 x 512 fp32) for backward
        assert r["activation_bytes"] >= 2 * 32 * 512 * 4
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None   # popped after forward
        _step(model, opt, batch=4)
        assert engine.memory_report()["activation_bytes"] > r["activation_bytes"]  # per step, not cumulative
    finally:
        engine.close()


def test_one_rank_holds_the_roots_gradient_and_one_blocks_at_once(tmp_path):
    """At one rank the reduction is the full gradient itself, done when launched: each block's gradient
    is folded into its shard as soon as it is complete, so backward holds the root unit's (its tied
    embedding collects gradients from the first backward op to the last) and the one block being
    filled; not the blocks whose reductions used to wait two more units to be folded. And the report
    counts them exactly (a reduction in place used to be subtracted as an output it never added)."""
    torch.manual_seed(0)
    conf = {"zero": {"stage": 3}, "prefetch": {"bytes": 0},
            "offload": {"optimizer": "nvme", "params": "nvme", "grads": "nvme"},
            "tiers": {"host_bytes": "8MiB", "device_bytes": "2MiB", "nvme_path": str(tmp_path)}}
    model, opt = infinity.initialize(GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=512, block_size=32)),
                                     conf)
    engine = infinity.engine_of(model)
    try:
        engine.memory.enable()
        for _ in range(2):
            _step(model, opt)
            root = next(u for u in engine.units if u.is_root)
            block = max(u.padded_numel for u in engine.units if not u.is_root)
            assert len(engine.units) == 5
            assert engine.memory_report()["grad_buffers_bytes"] == (root.padded_numel + block) * 4
    finally:
        engine.close()


def test_in_memory_engine_has_no_store_parts_and_activations_can_be_off(tmp_path):
    model, opt, engine = _engine(tmp_path, offload=False, stage=2)
    try:
        engine.memory.enable(activations=False)
        _step(model, opt)
        r = engine.memory_report()
    finally:
        engine.close()
    assert r["store_host_bytes"] is None and r["store_device_bytes"] is None
    assert r["activation_bytes"] is None
    assert r["gathered_params_bytes"] == 0                  # stages 0-2: full parameters are resident
    params = sum(u.padded_numel for u in engine.units)
    # full fp32 parameters + fp32 gradient shards + fp32 m and v (the master is the parameter)
    assert r["resident_bytes"] == params * 4 * 4


def test_a_forward_that_raises_leaves_no_hooks_behind(tmp_path):
    model, opt, engine = _engine(tmp_path, offload=False)
    try:
        engine.memory.enable()
        with pytest.raises(IndexError):
            model(input_ids=torch.full((1, 8), CFG.vocab_size + 5), labels=None)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None   # ours, stale
        _step(model, opt)                               # the next forward pops them before pushing again
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert engine.memory_report()["activation_bytes"] > 0
    finally:
        engine.close()


def test_without_clear_refs_the_peak_comes_from_ru_maxrss(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_report, "reset_peak_rss", lambda: False)
    model, opt, engine = _engine(tmp_path, offload=False)
    try:
        engine.memory.enable()
        _step(model, opt)
        r = engine.memory_report()
    finally:
        engine.close()
    assert r["peak_rss_source"] == "ru_maxrss"
    # exact only if the process's all-time peak rose in this step; never a made-up figure
    assert r["peak_rss_bytes"] is None or r["peak_rss_bytes"] >= r["rss_bytes"]
    assert (r["other_bytes"] is None) == (r["peak_rss_bytes"] is None)


def test_device_peak_is_the_allocators_high_water_mark_per_step(monkeypatch):
    """On CUDA the report's device peak is torch's allocator high-water mark over the step, reset after each
    read so the next step starts its own; on CPU there is none. (CUDA's counters are stubbed here.)"""
    assert memory_report.take_device_peak(torch.device("cpu")) == (None, None)
    marks = {"allocated": 5 * 2**30, "reserved": 6 * 2**30}
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: marks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: marks["reserved"])

    def reset(d):
        resets.append(d)
        marks.update(allocated=2**30, reserved=2 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    dev = torch.device("cuda", 1)
    assert memory_report.take_device_peak(dev) == (5 * 2**30, 6 * 2**30) and resets == [dev]
    assert memory_report.take_device_peak(dev) == (2**30, 2 * 2**30) and resets == [dev, dev]


def test_cpu_report_has_no_device_peak(tmp_path):
    model, opt, engine = _engine(tmp_path, offload=False, stage=1)
    try:
        engine.memory.enable(activations=False)
        _step(model, opt)
        r = engine.memory_report()
    finally:
        engine.close()
    assert r["device_is_host"] and r["device_peak_bytes"] is None and r["device_reserved_bytes"] is None
