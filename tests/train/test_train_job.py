"""``infinity train`` as a job: defaults that agree, checkpoints and bitwise resume, evaluation, sampling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infinity.cli import main
from infinity.models import GPT_SIZES
from infinity.train import TrainOptions
from infinity.train.resolve import resolve

REPO = Path(__file__).resolve().parents[2]
# tiny GPT, 8 x 64 byte tokens, no evaluation: ~0.1 s a step on one core
TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--no-progress", "--eval-every", "0"]
SCHEDULE = ["--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "3", "--min-lr", "3e-4",
            "--clip-grad-norm", "1.0"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _records(path: Path) -> dict:
    """step -> the last metrics record of that step (a resumed run appends)."""
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


# ---------------------------------------------------------------- defaults that agree

@pytest.mark.parametrize("name", list(GPT_SIZES))
def test_every_builtin_model_resolves_with_no_other_flag(name, tmp_path):
    run = resolve(TrainOptions(model=name), 1)
    assert run.seq_len == min(256, GPT_SIZES[name].block_size)
    assert run.save_dir.startswith("checkpoints/run-") and run.eval_every > 0


@pytest.mark.parametrize("name", list(GPT_SIZES))
def test_every_builtin_model_trains_two_steps(name, capsys):
    # tiny as it is; the others one layer deep (1b and 3b also 256 wide) and one sequence a step to fit a test
    # (a 3b step takes minutes here), their block sizes kept: the seq-len, schedule, evaluation and save
    # defaults are left to agree by themselves
    shape = "n_layer=1" if name in ("125m", "350m") else "n_layer=1,n_embd=256,n_head=4"
    argv = ["--model", name] if name == "tiny" else ["--model", f"{name}:{shape}", "--batch-size", "1",
                                                     "--eval-batches", "1"]
    rc = main(["train", *argv, "--steps", "2", "--no-progress", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    s = json.loads(out)
    assert s["steps"] == 2 and s["seq_len"] == min(256, GPT_SIZES[name].block_size)
    assert s["val_loss"] is not None and Path(s["checkpoint"]).name == "step_00000002"


# ---------------------------------------------------------------- checkpoints

def _start(args, metrics: Path, nproc: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "infinity.cli", "train", *TINY, *SCHEDULE, "--nproc", str(nproc),
           "--metrics", str(metrics), *args]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)   # its own process group: SIGKILL reaches spawned ranks too


@pytest.mark.slow
@pytest.mark.parametrize("nproc", (1, 2))
def test_sigkill_after_a_save_resumes_bitwise(nproc, tmp_path):
    steps = "16"
    ref = _start(["--steps", steps, "--no-save"], tmp_path / "ref.jsonl", nproc)
    killed = _start(["--steps", steps, "--save-dir", "ck", "--save-every", "3"], tmp_path / "run.jsonl", nproc)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ck" / "latest").exists():
            assert killed.poll() is None, killed.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint in 120 s"
            time.sleep(0.01)
        assert killed.poll() is None, "the run finished before it could be killed"
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert ref.wait(timeout=240) == 0, ref.communicate()[1]
    finally:
        for p in (ref, killed):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    saved_at = int((tmp_path / "ck" / "latest").read_text().strip().split("_")[1])
    assert 3 <= saved_at < int(steps)
    resumed = _start(["--resume", "--save-dir", "ck"], tmp_path / "run.jsonl", nproc)
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert f"resumed at step {saved_at}" in out and "saved checkpoint ck/step_00000016" in out
    want, got = _records(tmp_path / "ref.jsonl"), _records(tmp_path / "run.jsonl")
    assert sorted(got) == sorted(want) == list(range(int(steps)))
    for step in range(saved_at, int(steps)):   # the steps the resumed run did: same losses, lr and clip norms
        assert (got[step]["loss"], got[step]["lr"], got[step]["grad_norm"]) == \
               (want[step]["loss"], want[step]["lr"], want[step]["grad_norm"]), step
    assert want[0]["lr"] == pytest.approx(1e-3) and want[15]["lr"] < want[5]["lr"]   # warmup, then decay


def test_keep_last_and_save_dir_rules(tmp_path, capsys):
    rc = main(["train", *TINY, "--steps", "6", "--save-dir", "ck", "--save-every", "2", "--keep-last", "2"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "saved checkpoint ck/step_00000006" in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step_00000004", "step_00000006"]
    rc = main(["train", *TINY, "--steps", "6", "--save-dir", "ck"])   # a fresh run must not mix with them
    _, err = capsys.readouterr()
    assert rc == 2 and "--save-dir ck: already holds checkpoints of another run; continue it with --resume" in err
    rc = main(["train", "--resume", "ck"])
    _, err = capsys.readouterr()
    assert rc == 2 and "the run already did 6 of 6 steps; raise --steps" in err
    rc = main(["train", "--resume", "nowhere"])
    _, err = capsys.readouterr()
    assert rc == 2 and "--resume: checkpoint nowhere: no such directory" in err


def test_ctrl_c_saves_after_the_step(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _start(["--steps", "100000", "--save-dir", "ck"], metrics, 1)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    done = metrics.read_text().count("\n")
    assert f"interrupted after step {done} of 100000; saved" in err
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step_{done:08d}"
    assert f"saved checkpoint ck/step_{done:08d}" in out


# ---------------------------------------------------------------- evaluation and sampling

def test_validation_loss_falls_and_does_not_disturb_training(tmp_path, capsys):
    args = [*TINY[:-2], *SCHEDULE, "--steps", "30", "--no-save"]
    assert main(["train", *args, "--eval-every", "10", "--metrics", "e.jsonl", "--sample-every", "30"]) == 0
    _, err = capsys.readouterr()
    assert main(["train", *args, "--eval-every", "0", "--metrics", "n.jsonl"]) == 0
    with_eval, without = _records(tmp_path / "e.jsonl"), _records(tmp_path / "n.jsonl")
    val = [with_eval[s]["val_loss"] for s in (9, 19, 29)]
    assert val[2] < val[1] < val[0] < 5.6, val            # held-out bytes of Python source: learnt, not memorised
    assert with_eval[29]["val_perplexity"] == pytest.approx(2.718281828 ** val[2])
    assert "step 10: val loss " in err and "step 30 sample: " in err
    assert [with_eval[s]["loss"] for s in range(30)] == [without[s]["loss"] for s in range(30)]   # bitwise


def test_sample_command(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "4", "--save-dir", "ck"]) == 0
    capsys.readouterr()
    assert main(["sample", "ck", "--prompt", "def ", "--tokens", "24", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["text"].startswith("def ") and first["tokens"] == 24 and first["step"] == 4
    assert main(["sample", "ck/step_00000004", "--prompt", "def ", "--tokens", "24", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == first["text"]     # same seed, same text
    assert main(["sample", "ck", "--prompt", ""]) == 2
    assert "--prompt is empty" in capsys.readouterr().err


def test_the_save_room_check_counts_the_moments_as_they_are_saved():
    """A checkpoint holds the fp32 master and each moment in its stored format (bf16 moments: 2 B each, int8
    65/64), so the free-space check before training asks for 8 B/param with bf16 moments, 12 with fp32."""
    from infinity.train.job_state import checkpoint_bytes
    n = 10**8
    assert checkpoint_bytes(n) == int(12 * n * 1.01) + 2**20
    assert checkpoint_bytes(n, "bf16") == int(8 * n * 1.01) + 2**20
    assert checkpoint_bytes(n, "int8") == int((4 + 2 * 65 / 64) * n * 1.01) + 2**20   # codes + a scale per 256
