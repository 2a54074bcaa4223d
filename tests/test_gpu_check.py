"""The GPU check (``tools/gpu_check.sh`` and its stages in ``tools/gpu_check.py``): the parts that run
without a GPU. The shell runs its stages and writes one JSON per stage and a summary; the smoke stage
runs on CPU end to end; the profile's overlap figures and the loss comparison are pure functions."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def _x(cat, name, tid, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur}


def test_copy_overlap_counts_copy_time_under_kernels_of_other_streams_only():
    trace = {"traceEvents": [
        _x("kernel", "gemm", 7, 0, 100), _x("kernel", "gemm", 7, 150, 50), _x("kernel", "adam", 9, 180, 40),
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 80, 100),    # under 80-100, 150-180
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 300, 10),    # under nothing
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 7, 0, 60),       # its own stream's kernels
        {"ph": "i", "cat": "kernel", "name": "marker", "tid": 7, "ts": 5},  # not a duration event
    ]}
    got = gpu_check.copy_overlap(trace)
    assert got["kernel_us"] == 190 and got["kernel_streams"] == 2
    assert (got["h2d_copies"], got["h2d_us"], got["h2d_overlapped_us"]) == (2, 110, 20 + 30)
    assert got["h2d_overlap_fraction"] == pytest.approx(50 / 110) and got["h2d_copy_streams"] == 1
    assert (got["d2h_copies"], got["d2h_us"], got["d2h_overlapped_us"]) == (1, 60, 0)
    assert gpu_check.copy_overlap({"traceEvents": []})["h2d_overlap_fraction"] is None


def test_compare_losses_needs_every_step_within_tolerance_and_finite():
    assert gpu_check.compare_losses([2.0, 1.0001], [2.0, 1.0], 1e-3)["ok"]
    assert not gpu_check.compare_losses([2.0, 1.01], [2.0, 1.0], 1e-3)["ok"]
    assert not gpu_check.compare_losses([2.0, math.nan], [2.0, 1.0], 1e-3)["ok"]
    assert not gpu_check.compare_losses([2.0], [2.0, 1.0], 1e-3)["ok"]
    assert not gpu_check.compare_losses([], [], 1e-3)["ok"]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_check.sh")], check=True, timeout=30)


def test_the_script_runs_its_stages_into_json_and_summarises_them(tmp_path):
    """On CPU: the smoke stage passes (gloo collective, offloaded step equal to the in-memory one, the
    pinned round trip skipped with its reason), the race stage says why it cannot run, an unknown stage
    fails the run, and summary.json lists what ran."""
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    out = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(tmp_path), "smoke", "race", "nosuch"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr             # "nosuch" fails the run
    assert "unknown stage nosuch" in out.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["smoke", "race"] and not summary["ok"]
    assert all(s["ok"] and s["rc"] == 0 for s in summary["stages"]), summary
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert smoke["ok"] and smoke["collective"] == {"ok": True, "backend": "gloo"}
    assert "no CUDA" in smoke["pinned"]["skipped"]
    step = smoke["offloaded_step"]
    assert step["ok"] and step["max_rel_diff"] <= 1e-4 and len(step["losses"]) == 2
    assert step["store"]["peak_bytes"]["nvme"] > 0, "the offloaded step did not use the disk"
    race = json.loads((tmp_path / "race.json").read_text())
    assert race["ok"] and "torch.cuda._sleep" in race["skipped"]


def test_a_failing_stage_writes_its_error_into_its_json(tmp_path):
    result = gpu_check.run_stage("loss", tmp_path, model="no-such-size", steps=1)
    assert not result["ok"] and "unknown GPT size" in result["error"]
    assert json.loads((tmp_path / "loss.json").read_text())["error"] == result["error"]


def test_the_loss_stage_compares_an_offloaded_run_streaming_through_the_disk_with_auto_budgets(tmp_path):
    result = gpu_check.run_stage("loss", tmp_path, model="tiny", steps=2, seq_len=32)
    assert result["ok"] and result["steps"] == 2 and result["max_rel_diff"] <= result["rel_tol"]
    assert result["host_budget_bytes"] > 0 and result["device_budget_bytes"] > 0   # auto, resolved
    assert result["store_peak_bytes"]["nvme"] > 0 and result["pinned_within_host_budget"]
    assert json.loads((tmp_path / "loss.json").read_text())["losses"] == result["losses"]


def test_the_stage_limits_fit_a_device_session_with_room_to_rerun():
    """The stages' timeouts add to under 8 minutes, leaving a 15-minute device session room to rerun."""
    import re

    text = (ROOT / "tools" / "gpu_check.sh").read_text()
    limits = dict(re.findall(r"(\w+)\) echo (\d+) ;;", text))
    assert set(limits) == {"smoke", "cuda_tests", "loss", "race", "profile"}
    assert int(limits["smoke"]) <= 60 and sum(int(v) for v in limits.values()) < 8 * 60
