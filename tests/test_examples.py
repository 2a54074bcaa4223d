"""examples/torchrun_loop.py: an own training loop that saves, stops and resumes where it left off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(cwd: Path, steps: int) -> str:
    done = subprocess.run([sys.executable, str(REPO / "examples" / "torchrun_loop.py"), "--steps", str(steps),
                           "--save-every", "2", "--batch-size", "4", "--seq-len", "32"],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_loop_resumes_from_its_newest_checkpoint(tmp_path):
    first = _run(tmp_path, 2)
    assert "step 2 loss" in first and "resumed" not in first
    second = _run(tmp_path, 3)
    assert second.splitlines()[0] == "resumed at step 2" and "step 3 loss" in second and "step 1 loss" not in second
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_00000002", "step_00000003"]
    swap = tmp_path / "infinity_swap"
    assert not swap.exists() or list(swap.iterdir()) == []   # the engine's close() removed its swap files
