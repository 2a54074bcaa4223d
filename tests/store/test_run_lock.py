"""Swap run directories carry their owner's lock: a later run removes those of dead owners, never a live one's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infinity.store.run_lock import LOCK_NAME, RunLock, remove_stale_runs

REPO = Path(__file__).resolve().parents[2]


def _run_dir_of_a_dead_process(swap: Path) -> Path:
    """A run directory whose owner took its lock, wrote a swap file and died without cleaning up."""
    code = ("import os, sys; from infinity.store.run_lock import RunLock; lock = RunLock(sys.argv[1]); "
            "(lock.path / 'extents.swap').write_bytes(b'x' * 4096); print(lock.path, flush=True); os._exit(9)")
    out = subprocess.run([sys.executable, "-c", code, str(swap)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert out.returncode == 9, out.stderr
    return Path(out.stdout.strip())


def test_run_dir_holds_the_owner_pid_and_goes_on_release(tmp_path):
    lock = RunLock(tmp_path)
    assert lock.path.parent == tmp_path and lock.path.name.startswith(f"run-{os.getpid()}-")
    assert (lock.path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    assert oct(lock.path.stat().st_mode & 0o777) == "0o700"
    lock.release()
    assert list(tmp_path.iterdir()) == []


def test_dead_owners_dirs_are_removed_live_ones_kept(tmp_path):
    dead = _run_dir_of_a_dead_process(tmp_path)
    assert (dead / "extents.swap").exists()
    live = RunLock(tmp_path)            # alive: this process holds its lock
    try:
        removed, alive = remove_stale_runs(tmp_path)
        assert removed == [dead] and alive == [live.path]
        assert not dead.exists() and (live.path / LOCK_NAME).exists()
    finally:
        live.release()


def test_lockless_dirs_are_judged_by_the_pid_in_their_name(tmp_path):
    """Run directories of versions before the lock file: the pid in the name decides."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"run-{gone}-123").mkdir()
    (tmp_path / f"run-{os.getpid()}-456").mkdir()
    (tmp_path / "not-a-run").mkdir()
    removed, alive = remove_stale_runs(tmp_path)
    assert [p.name for p in removed] == [f"run-{gone}-123"]
    assert [p.name for p in alive] == [f"run-{os.getpid()}-456"]
    assert (tmp_path / "not-a-run").is_dir()


def test_a_symlinked_run_dir_is_never_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    swap = tmp_path / "swap"
    swap.mkdir()
    os.symlink(target, swap / "run-1-1")
    assert remove_stale_runs(swap) == ([], [])
    assert (target / "keep").read_text() == "x"
