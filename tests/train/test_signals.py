"""How ``infinity train`` meets the signals a real job gets: SIGTERM stops it like Ctrl-C (finish the
step, save, remove the swap files, exit 143), and ranks never outlive a launcher killed with SIGKILL."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cli_output import error_lines

pytestmark = pytest.mark.slow   # every case runs real ranks and signals them

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3", "--no-progress",
        "--eval-every", "0", "--host-bytes", "1MiB"]   # below the model's 1.8 MiB of state: swap files exist


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


def _start(tmp_path: Path, nproc: int, *extra) -> tuple:
    metrics, swap, save = tmp_path / "m.jsonl", tmp_path / "swap", tmp_path / "save"
    where = [] if "--no-save" in extra else ["--save-dir", str(save)]
    cmd = [sys.executable, "-m", "infinity.cli", "train", *TINY, "--steps", "100000", "--nproc", str(nproc),
           "--metrics", str(metrics), "--swap-dir", str(swap), *where, *extra]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)   # its own process group, to signal launcher and ranks at once
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):   # a step is done: ranks train
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read())
        assert time.monotonic() < deadline, "no step finished in 180 s"
        time.sleep(0.05)
    return proc, metrics, swap, save


def _alive(pids) -> list:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _files_under(path: Path) -> list:
    return [p for p in path.rglob("*") if p.is_file()]


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL to the launcher of 2 ranks: 5 s later no rank (no process it started) is alive; the swap
    files they could not remove are removed by the next run in that swap directory."""
    proc, metrics, swap, _ = _start(tmp_path, 2)
    try:
        ranks = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(ranks) >= 2, ranks
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5.0   # a rank dead stays dead: no need to sleep out the 5 s
        while _alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(ranks) == [], f"ranks {_alive(ranks)} outlived their launcher"
        written = metrics.read_text()
        time.sleep(1.0)
        assert metrics.read_text() == written     # nobody is still training into the metrics file
        assert _files_under(swap)                 # SIGKILL: nobody could clean up
        after = subprocess.run([sys.executable, "-m", "infinity.cli", "train", *TINY, "--steps", "1", "--no-save",
                                "--swap-dir", str(swap)], env=_env(), capture_output=True, text=True, timeout=180)
        assert after.returncode == 0, after.stderr
        assert f"removed 1 swap run directory of dead runs under {swap}" in after.stderr
        assert list(swap.iterdir()) == []
    finally:
        for pid in _alive([c.pid for c in psutil.Process().children(recursive=True)]):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("nproc, to", [(1, "launcher"), (2, "launcher"), (2, "process group")])
def test_sigterm_saves_removes_swap_and_exits_143(nproc, to, tmp_path):
    """SIGTERM to the launcher (or to it and its ranks at once, as a container stop may): the step ends, a
    checkpoint of every step done is saved and resumes, no swap file is left, exit code 143."""
    proc, metrics, swap, save = _start(tmp_path, nproc)
    try:
        if to == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and error_lines(err)[0].startswith("infinity train: interrupted after step "), err
    assert _files_under(swap) == [] and list(swap.iterdir()) == []
    steps_done = metrics.read_text().count("\n")
    latest = save / (save / "latest").read_text().strip()
    manifest = json.loads((latest / "manifest.json").read_text())
    assert manifest["client_state"]["infinity_train"]["next_step"] == steps_done   # no step lost
    resumed = subprocess.run([sys.executable, "-m", "infinity.cli", "train", *TINY, "--resume", str(save),
                              "--steps", str(steps_done + 1), "--swap-dir", str(swap), "--json"],
                             env=_env(), capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert (summary["start_step"], summary["steps"]) == (steps_done, steps_done + 1)


def test_a_stopped_rank_fails_every_rank_within_the_timeout_naming_the_collective(tmp_path):
    """SIGSTOP one of two ranks: within dist.timeout_s (5 s here) the other names the collective it waits in
    and the rank that did not arrive, and the whole job exits with that one line; no rank is left."""
    from infinity.train import default_config

    config = tmp_path / "timeout.json"
    config.write_text(json.dumps(default_config(tmp_path / "swap").replace(
        dist={"timeout_s": 5, "warn_after_s": 2}).to_dict()))
    proc, metrics, swap, _ = _start(tmp_path, 2, "--config", str(config), "--no-save")
    try:
        ranks = sorted((c for c in psutil.Process(proc.pid).children() if c.name().startswith("infinity-rank")),
                       key=lambda c: c.name())
        assert [r.name() for r in ranks] == ["infinity-rank0", "infinity-rank1"]
        ranks[1].suspend()           # SIGSTOP rank 1
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in _alive([c.pid for c in psutil.Process().children(recursive=True)]):
            os.kill(r, signal.SIGKILL)
    assert proc.returncode == 1, err
    assert exit_s < 5 + 15, f"exited {exit_s:.1f} s after the stop; dist.timeout_s is 5"
    assert _alive([r.pid for r in ranks]) == []
    last = err.strip().splitlines()[-1]
    assert last.startswith("infinity train: rank 0 failed: CollectiveTimeout: "), err
    assert "waited 5 s for the other ranks (dist.timeout_s 5); not arrived: ranks 1" in last, err
    # whichever collective rank 1 was stopped before (a gather, a reduction, the trace's all_agree, ...)
    assert re.search(r"(all_gather|reduce_scatter|all_reduce|all_agree|all_to_all|broadcast)\S* .*\(collective #\d+\)",
                     last), err
    assert re.search(r"infinity: rank 0 has waited \d s in .* not arrived: ranks 1", err), err   # the warning
    assert list(swap.iterdir()) == []
