"""A memory grant for real: a cgroup with a memory limit, and commands started inside it.

:class:`MemoryCgroup` makes a cgroup named after this process (``infinity-grant-<pid>-<n>``) at the top
of the memory hierarchy this process sees (cgroup v1's ``memory`` controller, else cgroup v2 with its
memory controller; the mount points come from ``/proc/self/mountinfo``), sets its limit
(``memory.limit_in_bytes`` / ``memory.max``), and starts commands in it (:meth:`popen`: a shell writes
its own pid into ``cgroup.procs`` and then execs the command, so the command and everything it starts
are charged to the grant from their first byte).

Cleanup always runs, on ``close()`` / leaving the ``with`` block, and at interpreter exit (``atexit``)
if neither happened: each process this object started that is still in the cgroup is killed (only
those: the cgroup holds nothing else), reaped, and the cgroup removed, retrying for at most
:data:`REMOVE_TIMEOUT_S` (the kernel refuses to remove it while a task is still exiting).

Needs root and a writable memory hierarchy; :func:`unavailable_reason` says why not in one line, for a
test to skip with. ``tools/bench_trainer_offload.py`` runs its jobs in one.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import subprocess
import time

from infinity.store.memory_grant import memory_cgroup

REMOVE_TIMEOUT_S = 30.0   # a killed task leaves its cgroup within milliseconds; this much is a stuck one
_names = itertools.count()


def unavailable_reason() -> str | None:
    """Why a memory cgroup cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root to make a cgroup"
    if memory_cgroup() is None:
        return "no cgroup memory controller is mounted (v1 memory or v2 with memory enabled)"
    try:
        with MemoryCgroup(64 * 2**20):
            pass
    except OSError as e:
        return f"cannot make a memory cgroup: {e}"
    return None


class MemoryCgroup:
    """A cgroup with ``limit_bytes`` of memory at the top of this process's memory hierarchy."""

    def __init__(self, limit_bytes: int):
        found = memory_cgroup()
        if found is None:
            raise OSError("no cgroup memory controller is mounted")
        self.version, _, top = found
        self.limit_bytes = limit_bytes
        self.path = os.path.join(top, f"infinity-grant-{os.getpid()}-{next(_names)}")
        self._procs: list = []
        os.mkdir(self.path)
        atexit.register(self.close)
        try:
            limit_file = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
            with open(os.path.join(self.path, limit_file), "w") as f:
                f.write(str(limit_bytes))
        except OSError:
            self.close()
            raise

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def popen(self, cmd: list, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(cmd)`` inside the grant (a shell joins it, then execs ``cmd``)."""
        join = 'echo $$ > "$0" && exec "$@"'
        proc = subprocess.Popen(["/bin/sh", "-c", join, os.path.join(self.path, "cgroup.procs"), *cmd], **kwargs)
        self._procs.append(proc)
        return proc

    def read(self, name: str) -> str:
        """One of the cgroup's files (``memory.max_usage_in_bytes``, ``memory.peak``, ...)."""
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def peak_bytes(self) -> int | None:
        """The most the cgroup was ever charged (v1 ``memory.max_usage_in_bytes``; v2 ``memory.peak``,
        kernels from 5.19); None where the kernel does not keep it."""
        try:
            return int(self.read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int | None:
        """Tasks the kernel killed for going over the limit (v1 ``memory.oom_control``, v2 ``memory.events``)."""
        try:
            text = self.read("memory.oom_control" if self.version == 1 else "memory.events")
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def close(self) -> None:
        """Kill what this object started that is still running, and remove the cgroup (idempotent)."""
        if self.path is None:
            return
        members = self._members()
        for proc in self._procs:
            if proc.poll() is None:
                _kill_tree(proc.pid, members)
        for proc in self._procs:
            try:
                proc.wait(timeout=REMOVE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        while True:
            # what our processes started (torchrun's ranks) are members too; each was started by us
            for pid in self._members():
                _signal(pid, signal.SIGKILL)
            try:
                os.rmdir(self.path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.path = None
        atexit.unregister(self.close)

    def _members(self) -> list:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except OSError:
            return []


def _kill_tree(pid: int, members: list) -> None:
    """SIGKILL ``pid`` and the cgroup's other members (its descendants: nothing else runs in the grant)."""
    for member in [pid, *members]:
        _signal(member, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
