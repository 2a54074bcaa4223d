"""``precision.param_dtype: auto`` (:mod:`infinity.precision`): the rule on stubbed hardware, the bounded
probe, its cache, and the resolution ``initialize`` runs."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.nn as nn

import infinity
from infinity import precision
from infinity.config import Config
from infinity.precision import PrecisionChoice, choose, measure_rates, model_shapes, resolve_precision

SHAPES = ((64, 256), (256, 64))
FAST_BF16 = {"gflops": {"fp32": 100.0, "bf16": 300.0}, "stopped_early": []}
SLOW_BF16 = {"gflops": {"fp32": 100.0, "bf16": 1.2}, "stopped_early": ["bf16"]}


@pytest.mark.parametrize("offloaded", (False, True))
def test_cpu_with_fast_bf16_computes_and_stores_bf16(offloaded):
    c = choose(torch.device("cpu"), SHAPES, params_offloaded=offloaded, rates=FAST_BF16)
    assert (c.param_dtype, c.compute_dtype) == ("bf16", "bf16")
    assert "3.00x faster" in c.reason and "fp32 100.0, bf16 300.0" in c.reason


def test_cpu_without_fast_bf16_computes_fp32_and_stores_bf16_only_when_offloaded():
    kept = choose(torch.device("cpu"), SHAPES, params_offloaded=False, rates=SLOW_BF16)
    assert (kept.param_dtype, kept.compute_dtype) == ("fp32", "fp32")
    off = choose(torch.device("cpu"), SHAPES, params_offloaded=True, rates=SLOW_BF16)
    assert (off.param_dtype, off.compute_dtype) == ("bf16", "fp32")
    assert "83.3x slower" in off.reason and "stopped early" in off.reason and "offloaded" in off.reason
    remainder = choose(torch.device("cpu"), SHAPES, params_offloaded=False, needs_bf16_storage=True,
                       rates=SLOW_BF16)
    assert (remainder.param_dtype, remainder.compute_dtype) == ("bf16", "fp32")
    # the planner's candidates: a bf16 store only where the parameters are offloaded (or the master needs it)
    assert off.for_config(params_offloaded=False, needs_bf16_storage=False) == ("fp32", "fp32")
    assert off.for_config(params_offloaded=True, needs_bf16_storage=False) == ("bf16", "fp32")


@pytest.mark.parametrize("capability, expected", [
    ((7, 0), ("fp16", "fp16")),    # V100
    ((7, 5), ("fp16", "fp16")),    # T4
    ((8, 0), ("bf16", "bf16")),    # A100
    ((9, 0), ("bf16", "bf16")),    # H100
])
def test_cuda_by_compute_capability(capability, expected):
    c = choose(torch.device("cuda"), SHAPES, params_offloaded=True, capability=capability)
    assert (c.param_dtype, c.compute_dtype) == expected
    assert f"{capability[0]}.{capability[1]}" in c.reason
    with_remainder = choose(torch.device("cuda"), SHAPES, params_offloaded=True, needs_bf16_storage=True,
                            capability=capability)
    assert with_remainder.param_dtype == "bf16"


def test_slow_explicit_choice_warns_with_the_ratio():
    cpu = torch.device("cpu")
    warning = precision.slow_choice_warning(cpu, "bf16", SHAPES, rates=SLOW_BF16)
    assert "83.3x slower than fp32" in warning and "auto" in warning
    assert precision.slow_choice_warning(cpu, "bf16", SHAPES, rates=FAST_BF16) is None
    assert precision.slow_choice_warning(cpu, "fp32", SHAPES, rates=SLOW_BF16) is None
    assert "emulated" in precision.slow_choice_warning(torch.device("cuda"), "bf16", SHAPES, capability=(7, 5))
    assert precision.slow_choice_warning(torch.device("cuda"), "bf16", SHAPES, capability=(8, 6)) is None


def test_probe_stops_early_on_a_far_slower_dtype(monkeypatch):
    """A dtype 50x slower at the first look is never timed at full size: the probe stays bounded."""
    real = precision._time_step
    full_size_calls = {"fp32": 0, "bf16": 0}

    def slow_bf16(a, w):
        name = "bf16" if a.dtype == torch.bfloat16 else "fp32"
        if tuple(w.shape) != precision.SCREEN_SHAPE:
            full_size_calls[name] += 1
        return real(a, w) * (50.0 if name == "bf16" else 1.0)

    monkeypatch.setattr(precision, "_time_step", slow_bf16)
    t0 = time.perf_counter()
    rates = measure_rates(SHAPES, budget_s=0.05)
    assert time.perf_counter() - t0 < 30   # seconds whatever the CPU; the point is the counts below
    assert rates["stopped_early"] == ["bf16"]
    assert full_size_calls["bf16"] == 0 and full_size_calls["fp32"] >= 3 * len(SHAPES)
    assert rates["gflops"]["bf16"] == rates["screen"]["gflops"]["bf16"]
    assert rates["gflops"]["fp32"] > 0 and rates["gflops"]["bf16"] > 0


def test_probe_measures_both_when_close():
    rates = measure_rates(SHAPES, budget_s=0.05)
    assert set(rates["gflops"]) == {"fp32", "bf16"}
    assert all(r > 0 for r in rates["gflops"].values())
    assert rates["shapes"] == [list(s) for s in SHAPES] and rates["rows"] == precision.PROBE_ROWS


def test_rates_are_cached_per_machine_and_a_damaged_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(precision, "measure_rates", lambda shapes, dtypes: calls.append(1) or dict(FAST_BF16))
    assert precision.cpu_rates(SHAPES) == (FAST_BF16, False)
    assert precision.cpu_rates(SHAPES) == (FAST_BF16, True)
    assert len(calls) == 1
    (cached,) = (tmp_path / "precision").glob("rates-*.json")
    cached.write_text("{not json")
    assert precision.cpu_rates(SHAPES) == (FAST_BF16, False)
    assert len(calls) == 2
    other = "SSE41" if os.environ.get("ONEDNN_MAX_CPU_ISA") != "SSE41" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other)   # other kernels: other rates, another entry
    precision.cpu_rates(SHAPES)
    assert len(calls) == 3


def test_model_shapes_are_the_linear_weights_not_embeddings():
    model = nn.Sequential(nn.Embedding(1000, 32), nn.Linear(32, 128), nn.Linear(128, 32), nn.Linear(32, 128))
    assert model_shapes(model) == ((128, 32), (32, 128))
    assert model_shapes(nn.Sequential(nn.Embedding(10, 4))) == precision.DEFAULT_SHAPES


def _resolve(cfg: dict, rates: dict, monkeypatch, **kw):
    monkeypatch.setattr(precision, "cpu_rates", lambda shapes, dtypes=("fp32", "bf16"): (rates, False))
    return resolve_precision(Config.from_dict(cfg), nn.Linear(64, 256), torch.device("cpu"), **kw)


def test_resolve_logs_one_line_and_records_the_resolved_dtypes(monkeypatch, caplog):
    offloaded = {"zero": {"stage": 3}, "precision": {"param_dtype": "auto"},
                 "offload": {"params": "nvme"}, "tiers": {"nvme_path": "/nonexistent"}}
    with caplog.at_level(logging.WARNING, logger="infinity.precision"):
        cfg, choice = _resolve(offloaded, SLOW_BF16, monkeypatch)
    assert (cfg.precision.param_dtype, cfg.precision.compute_dtype) == ("bf16", "fp32")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("infinity: precision auto -> param_dtype bf16 stored, compute_dtype fp32: bf16 computes")
    assert line == choice.line()
    cfg, _ = _resolve({"precision": {"param_dtype": "auto"}}, FAST_BF16, monkeypatch)
    assert (cfg.precision.param_dtype, cfg.precision.compute_dtype) == ("bf16", "bf16")


def test_resolve_never_overrides_an_explicit_dtype_but_warns(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="infinity.precision"):
        cfg, choice = _resolve({"precision": {"param_dtype": "bf16"}}, SLOW_BF16, monkeypatch)
    assert choice is None and (cfg.precision.param_dtype, cfg.precision.compute_dtype) == ("bf16", "bf16")
    assert "83.3x slower than fp32" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infinity.precision"):
        _resolve({"precision": {"param_dtype": "bf16"}}, SLOW_BF16, monkeypatch, announce=False)
    assert caplog.text == ""   # other ranks say nothing


def test_resolve_takes_the_agreed_answer(monkeypatch):
    """Ranks could measure differently: every rank takes what ``agree`` returns (rank 0's)."""
    rank0 = PrecisionChoice("fp32", "fp32", "rank 0 said so")
    cfg, choice = _resolve({"precision": {"param_dtype": "auto"}}, FAST_BF16, monkeypatch, agree=lambda c: rank0)
    assert choice is rank0 and cfg.precision.param_dtype == "fp32"


def test_initialize_resolves_auto_and_the_engine_computes_in_it(monkeypatch):
    monkeypatch.setattr(precision, "cpu_rates", lambda shapes, dtypes=("fp32", "bf16"): (SLOW_BF16, False))
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    model, opt = infinity.initialize(model, {"zero": {"stage": 0}, "precision": {"param_dtype": "auto"}})
    engine = infinity.engine_of(model)
    try:
        assert engine.config.precision.param_dtype == "fp32" and engine.compute_dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in model.parameters())
    finally:
        engine.close()


def test_ranks_take_rank_0s_answer(worlds):
    """Two ranks whose probes disagree (noise, or another CPU) run in rank 0's dtypes: they gather together."""
    import precision_cases

    got = worlds(2).run(precision_cases.auto_on_rank, {"rates": [SLOW_BF16, FAST_BF16]})
    assert [(r["param_dtype"], r["compute_dtype"]) for r in got] == [("fp32", "fp32")] * 2
