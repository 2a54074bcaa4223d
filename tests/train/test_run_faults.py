"""What a run does when the world fails it: a corrupt checkpoint or swap file, a full disk at a save, a save
directory that cannot take the run's checkpoints; each is one line on stderr (a traceback only with --debug),
and no trained state is lost to a failure that can be found before training or waited out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import infinity.train.loop as loop
from infinity.cli import main
from cli_output import error_lines

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--no-progress", "--eval-every", "0",
        "--lr", "3e-3"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def tmpfs(tmp_path):
    """A small file system of its own, to fill for real (ENOSPC from the kernel)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill ({r.stderr.decode().strip() or 'mount failed'})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Take every free byte of ``path``'s file system."""
    with open(path, "wb", buffering=0) as f:
        for piece in (b"\0" * 2**20, b"\0" * 4096, b"\0"):
            try:
                while f.write(piece):
                    pass
            except OSError:   # ENOSPC: this piece size no longer fits
                pass


def test_corrupt_checkpoint_on_resume_is_one_line(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "2", "--save-dir", "ck", "--no-progress"]) == 0
    shard = next((tmp_path / "ck").rglob("unit*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 40] ^= 0xFF  # a byte of the fp32 master weights
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    rc = main(["train", *TINY, "--steps", "3", "--resume", "ck"])
    _, err = capsys.readouterr()
    line = _one_line(err)
    assert rc == 1 and line.startswith("infinity train: ") and shard.name in line, line
    with pytest.raises(Exception, match=shard.name):   # --debug: the traceback, not the line
        main(["--debug", "train", *TINY, "--steps", "3", "--resume", "ck"])


def test_corrupt_swap_file_mid_run_is_one_line(tmp_path):
    metrics, swap = tmp_path / "m.jsonl", tmp_path / "swap"
    cmd = [sys.executable, "-m", "infinity.cli", "train", *TINY, "--steps", "100000", "--no-save",
           "--metrics", str(metrics), "--swap-dir", str(swap), "--host-bytes", "1MiB"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        # every stored byte flipped: the next read of any extent fails its CRC (os.walk: the store makes and
        # removes directories of its own meanwhile)
        files = [Path(d) / n for d, _, names in os.walk(swap) for n in names if n.endswith(".swap")]
        assert files
        for f in files:
            with open(f, "r+b") as fh:
                data = bytearray(fh.read())
                fh.seek(0)
                fh.write(bytes(b ^ 0xFF for b in data))
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    line = _one_line(err)
    assert proc.returncode == 1 and "checksum mismatch" in line and "the swap file is corrupt" in line, err
    assert list(swap.iterdir()) == []


def test_save_dir_without_room_for_a_checkpoint_is_refused_before_training(tmpfs, capsys):
    _fill(tmpfs / "filler")
    rc = main(["train", *TINY, "--steps", "2", "--save-dir", str(tmpfs / "ck")])
    _, err = capsys.readouterr()
    line = _one_line(err)
    assert rc == 2 and f"--save-dir {tmpfs / 'ck'}: " in line and "one checkpoint needs about" in line, line


def test_full_disk_at_the_last_save_waits_for_room_instead_of_losing_the_run(tmpfs, capsys, monkeypatch):
    """ENOSPC at the last save: the run says so and retries; once space is freed the checkpoint is saved."""
    monkeypatch.setattr(loop, "SAVE_RETRY_S", 0.1)
    real_save, calls = loop._save, []

    def save_on_a_disk_that_fills(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            _fill(tmpfs / "filler")          # someone else took the disk while we trained
        else:
            (tmpfs / "filler").unlink()      # ... and gave it back
        return real_save(*args, **kwargs)

    monkeypatch.setattr(loop, "_save", save_on_a_disk_that_fills)
    rc = main(["train", *TINY, "--steps", "3", "--save-dir", str(tmpfs / "ck")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "the checkpoint at step 3 failed" in err and "No space left on device" in err
    assert "the trained state is kept: free space under" in err and "retrying in 0.1 s (attempt 2 of" in err
    assert (tmpfs / "ck" / "latest").read_text().strip() == "step_00000003"
    assert f"saved checkpoint {tmpfs / 'ck' / 'step_00000003'}" in out


def test_full_disk_that_stays_full_ends_in_one_line(tmpfs, capsys, monkeypatch):
    monkeypatch.setattr(loop, "SAVE_RETRY_S", 0.05)
    monkeypatch.setattr(loop, "SAVE_ATTEMPTS", 2)
    real_save = loop._save

    def save_on_a_full_disk(*args, **kwargs):
        if not (tmpfs / "filler").exists():
            _fill(tmpfs / "filler")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(loop, "_save", save_on_a_full_disk)
    rc = main(["train", *TINY, "--steps", "2", "--save-dir", str(tmpfs / "ck")])
    _, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert rc == 1 and "Traceback" not in err
    assert last.startswith("infinity train: save_checkpoint: rank 0 failed (") and "No space left" in last
    assert last.endswith("gave up after 2 attempts: the 2 steps since the start are lost"), last


def test_a_failed_periodic_save_lets_training_go_on(tmpfs, capsys, monkeypatch):
    real_save, calls = loop._save, []

    def first_save_on_a_full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            _fill(tmpfs / "filler")
        elif (tmpfs / "filler").exists():
            (tmpfs / "filler").unlink()
        return real_save(*args, **kwargs)

    monkeypatch.setattr(loop, "_save", first_save_on_a_full_disk)
    rc = main(["train", *TINY, "--steps", "4", "--save-every", "2", "--save-dir", str(tmpfs / "ck")])
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert "the checkpoint at step 2 failed" in err and "training goes on" in err
    assert sorted(p.name for p in (tmpfs / "ck").iterdir()) == ["latest", "step_00000004"]


def test_resume_refuses_a_save_dir_with_later_checkpoints(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "4", "--save-every", "2", "--save-dir", "ck"]) == 0
    capsys.readouterr()
    rc = main(["train", *TINY, "--steps", "6", "--resume", "ck/step_00000002"])
    _, err = capsys.readouterr()
    line = _one_line(err)
    assert rc == 2 and "ck already holds step_00000004, saved after this checkpoint (step 2)" in line, line


def test_metrics_after_a_resume_hold_each_step_once(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["train", *TINY, "--steps", "2", "--save-dir", "ck", "--metrics", str(metrics)]) == 0
    # as if the run had done step 2 after its last checkpoint and been killed writing step 3's line
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 2, "loss": 9.0}) + "\n" + '{"step": 3, "lo')
    assert main(["train", *TINY, "--steps", "3", "--resume", "ck", "--metrics", str(metrics)]) == 0
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert json.loads(metrics.read_text().splitlines()[-1])["loss"] != 9.0


def test_consolidate_into_an_impossible_directory_is_one_line(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "1", "--save-dir", "ck"]) == 0
    capsys.readouterr()
    rc = main(["consolidate", "ck", "/proc/self/x"])
    _, err = capsys.readouterr()
    line = _one_line(err)
    assert rc == 2 and line.startswith("infinity consolidate: consolidate: cannot create the output directory "
                                       "/proc/self/x"), line


def test_sample_past_the_model_positions_says_so_and_shows_progress(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "1", "--save-dir", "ck"]) == 0
    capsys.readouterr()
    assert main(["sample", "ck", "--prompt", "def ", "--tokens", "300", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "infinity sample: 4 prompt + 300 new tokens run past the model's 64 positions: each new token sees " \
           "only the last 64" in err
    assert "sample: 100%" in err and "300/300" in err     # the progress bar, on stderr
    assert out.startswith("def ") and "sample:" not in out
