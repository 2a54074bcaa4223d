"""Swap run directories that say who owns them, so later runs can clean up after dead ones.

Each run keeps its swap files in ``<swap_dir>/run-<pid>-<n>/``. A run killed
with SIGKILL (or by the OOM killer, or a power cut) cannot remove its
directory, and its swap files can be as large as the model's whole training
state. So each run directory holds ``owner.lock``: the owner's pid (for
people) and an ``flock`` the owner holds for as long as it lives (for
programs: the kernel drops it when the process dies, however it dies, and a
recycled pid cannot fake it). A new run in the same swap directory removes
every run directory whose lock it can take (its owner is gone) and never
touches one whose lock is held (its owner is alive, maybe another job
sharing the disk).

The directory is made under a temporary name and renamed to ``run-*`` only
once its lock is held, so no ``run-*`` directory is ever without a held or
abandoned lock. Directories of older versions, which have no lock file, are
judged by the pid in their name.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import time
from pathlib import Path

from infinity.io.new_files import create_new, make_private_dir

__all__ = ["RunLock", "remove_stale_runs", "LOCK_NAME", "RUN_PREFIX"]

LOCK_NAME = "owner.lock"
RUN_PREFIX = "run-"
_RUN_RE = re.compile(r"^(?:run|\.pending-run)-(\d+)-[0-9a-f]+$")


class RunLock:
    """A run directory of this process under ``swap_dir``, locked until :meth:`release`."""

    def __init__(self, swap_dir: str | os.PathLike):
        swap_dir = Path(swap_dir)
        pending = swap_dir / f".pending-run-{os.getpid()}-{secrets.token_hex(4)}"
        make_private_dir(pending)
        fd = create_new(pending / LOCK_NAME, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # a new file: nobody else can hold it
            os.write(fd, f"{os.getpid()}\n".encode())
            self.path = swap_dir / f"{RUN_PREFIX}{os.getpid()}-{time.time_ns() % 10**9}"
            os.rename(pending, self.path)
        except BaseException:
            os.close(fd)
            shutil.rmtree(pending, ignore_errors=True)
            raise
        self._fd: int | None = fd

    def release(self, remove: bool = True) -> None:
        """Remove the directory (the engine closed its own files; this covers ranks killed mid-write),
        then drop the lock."""
        if self._fd is None:
            return
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


def _owner_gone(run_dir: Path) -> bool:
    """True when nobody holds ``run_dir``'s lock (or, without a lock file, its named pid is not alive)."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        m = _RUN_RE.match(run_dir.name)
        if m is None:
            return False
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            return True
        except PermissionError:   # alive, another user's
            return False
        return False
    except OSError:   # a symlink or something else unreadable in its place: not ours to judge
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remove_stale_runs(swap_dir: str | os.PathLike) -> tuple[list, list]:
    """Remove the run directories of dead owners under ``swap_dir``; (removed, left because alive)."""
    removed, alive = [], []
    try:
        entries = list(Path(swap_dir).iterdir())
    except OSError:
        return removed, alive
    for d in entries:
        # a .pending- directory is a run killed between making its directory and naming it
        if not d.name.startswith((RUN_PREFIX, ".pending-run-")) or d.is_symlink() or not d.is_dir():
            continue
        if _owner_gone(d):
            shutil.rmtree(d, ignore_errors=True)   # rmtree never follows a symlink inside it
            removed.append(d)
        else:
            alive.append(d)
    return removed, alive
