"""Every second of a measured step is attributed: compute, I/O waited on, Adam, communication, unattributed.

The engine times its own verbs; the rest of a phase is the model's compute. Waits are read from
per-thread clocks, so a wait on another thread (the Adam pipeline's) is never counted twice.
"""

from __future__ import annotations

import time

import pytest
import torch

import infinity
from infinity.comm.collectives import CommCounters
from infinity.io.engine import IOEngine
from infinity.models import GPT, GPTConfig
from infinity.zero.stats import PHASES, TERMS, EngineStats

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=32)


def _config(path, offload: bool, overlap: bool = False) -> dict:
    cfg = {"zero": {"stage": 3}, "precision": {"param_dtype": "fp32", "reduce_dtype": "fp32"},
           "optimizer": {"threads": 1, "update_at": "auto" if overlap else "step"}}
    if offload:
        cfg["offload"] = {"params": "nvme", "grads": "host", "optimizer": "nvme", "host_resident_bytes": 0}
        cfg["tiers"] = {"host_bytes": "1280KiB", "device_bytes": "1MiB", "nvme_path": str(path)}
    return cfg


def _steps(cfg, steps=2) -> list:
    torch.manual_seed(0)
    model, opt = infinity.initialize(GPT(GPTConfig(**SHAPE)), cfg)
    engine = infinity.engine_of(model)
    out = []
    try:
        for step in range(steps):
            ids = torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(dict(engine.stats.last_step))
    finally:
        engine.close()
    return out


def _check_sums(last: dict) -> None:
    att = last["attribution"]
    for phase in PHASES:
        row = att[phase]
        assert set(row) == {"wall_s", *TERMS}
        assert all(row[t] >= 0 for t in TERMS), row
        assert sum(row[t] for t in TERMS) == pytest.approx(row["wall_s"], rel=1e-9, abs=1e-9)
        assert row["wall_s"] == pytest.approx(last[f"{phase}_s"])
    assert att["total"]["wall_s"] == pytest.approx(last["forward_s"] + last["backward_s"] + last["step_s"])
    assert att["forward"]["adam_s"] == att["backward"]["adam_s"] == 0.0   # no overlap: Adam runs in step
    assert att["step"]["compute_s"] == pytest.approx(0.0, abs=1e-9)        # step() is all engine time


@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "nvme"])
def test_the_terms_are_present_non_negative_and_sum_to_each_phase(tmp_path, offload):
    for last in _steps(_config(tmp_path, offload)):
        _check_sums(last)
        att = last["attribution"]
        assert att["forward"]["compute_s"] > 0 and att["backward"]["compute_s"] > 0
        assert att["step"]["adam_s"] > 0


def test_an_injected_io_delay_shows_up_in_the_io_term(tmp_path, monkeypatch):
    """Each disk request made 20 ms slower: the step's I/O term grows by about the delay the caller
    could not hide, while compute does not take it."""
    quick = _steps(_config(tmp_path / "a", True))[-1]["attribution"]
    original = IOEngine._move_piece

    def slow(self, req, index):
        time.sleep(0.02)
        return original(self, req, index)
    monkeypatch.setattr(IOEngine, "_move_piece", slow)
    last = _steps(_config(tmp_path / "b", True))[-1]
    _check_sums(last)
    slow_att = last["attribution"]
    grew = slow_att["total"]["io_wait_s"] - quick["total"]["io_wait_s"]
    assert grew > 0.1, (quick["total"], slow_att["total"])
    # the wall time the delay added went to the I/O term, not to compute
    added = slow_att["total"]["wall_s"] - quick["total"]["wall_s"]
    assert grew > 0.5 * added


def test_a_wait_on_another_thread_is_not_charged_to_the_phase():
    """Per-thread clocks: a collective waited on by another thread while a verb runs is not the verb's."""
    import threading

    counters = CommCounters()
    stats = EngineStats(counters)
    stats.start("forward")
    with stats.engine_time():
        t = threading.Thread(target=counters.add_wait, args=(5.0,))
        t.start()
        t.join()
        counters.add_wait(0.0)
    stats.stop("forward")
    stats.end_step()
    row = stats.last_step["attribution"]["forward"]
    assert row["comm_s"] == 0.0 and row["wall_s"] < 1.0
    assert stats.last_step["comm_wait_s"] == pytest.approx(5.0)   # the process-wide total keeps it


def test_verb_time_before_a_phase_starts_is_not_the_phases():
    stats = EngineStats(CommCounters())
    with stats.engine_time():
        time.sleep(0.05)   # outside any phase
        stats.start("step")
        stats.counters.add_wait(0.0)
    stats.stop("step")
    stats.end_step()
    row = stats.last_step["attribution"]["step"]
    assert row["wall_s"] < 0.04 and sum(row[t] for t in TERMS) == pytest.approx(row["wall_s"])
