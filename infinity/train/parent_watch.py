"""Spawned ranks die with their launcher.

A rank whose launcher is gone has nobody to report to and nobody who will
clean up after it; left running it keeps writing metrics and checkpoints
into a save directory a ``--resume`` may already share. Two mechanisms, so
either alone is enough:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, the kernel's own: the rank is
  killed the moment its parent exits, even by SIGKILL. (It fires when the
  *thread* that started the rank exits; the launcher starts ranks from its
  main thread, which outlives them.)
- everywhere: a daemon thread that checks the parent pid twice a second and
  kills the rank once it changed (re-parented to init or a subreaper).

SIGKILL, not a graceful stop: a launcher killed with SIGKILL was meant to
stop at once (a graceful SIGTERM to the launcher is forwarded as a stop
request instead). The swap files the killed ranks leave are removed by the
next run that uses the swap directory (:mod:`infinity.store.run_lock`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

__all__ = ["die_with_parent", "PARENT_POLL_S"]

PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):   # no libc symbol: the poll below still holds
        return False


def _watch(parent_pid: int) -> None:
    event = threading.Event()
    while not event.wait(PARENT_POLL_S):
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent_pid: int) -> None:
    """From now on this process is killed (SIGKILL) when ``parent_pid``, its parent, exits."""
    _set_pdeathsig()
    if os.getppid() != parent_pid:   # the parent died before the kernel was told: nobody will signal us
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch, args=(parent_pid,), daemon=True, name="infinity-parent-watch").start()
