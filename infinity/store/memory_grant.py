"""The host memory this process may use: the machine's RAM, or less where a cgroup grants less.

A container (Docker's ``--memory``, a Kubernetes pod's ``limits.memory``, Slurm's ``--mem`` with its cgroup
plugin) grants a job memory through a cgroup. The kernel kills the job when the cgroup's charge passes the
limit, however much RAM the machine has free, so ``auto`` budgets sized from ``/proc/meminfo`` alone would
plan for memory the job cannot have. :func:`host_memory` takes the smaller of the two:

- total: ``min(physical RAM, limit)``;
- available: ``min(psutil's available, limit - (usage - inactive_file))``. The cgroup's usage counts page
  cache it has read or written (swap files, checkpoints), and the kernel reclaims its inactive part before
  it would kill anything, so that part is still available, as ``MemAvailable`` counts it machine-wide.

The cgroup is this process's own (``/proc/self/cgroup``), found under its hierarchy's mount point read
from ``/proc/self/mountinfo``. Every ancestor up to the mount point limits it too; the tightest wins. cgroup
v1: the ``memory`` controller's ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``memory.stat``'s
``total_inactive_file``. cgroup v2: ``memory.max``, ``memory.current`` and ``memory.stat``'s
``inactive_file`` (the ``0::`` line). A limit of ``max`` or at least 2**60 bytes (v1 writes "unlimited" as
a page-rounded ``LONG_MAX``) is none. Files that are missing or unreadable mean no limit known at that
level: a budget is then sized from the machine, as without a cgroup.

Every function takes ``proc`` (the ``/proc/<pid>`` whose cgroup is asked about) and ``root`` (prefixed to
the mount points, for a tree laid out under a test's directory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

__all__ = ["MemoryGrant", "HostMemory", "find_grant", "host_memory", "memory_cgroup", "UNLIMITED_BYTES"]

UNLIMITED_BYTES = 2**60   # a limit at least this large is no limit (v1's "unlimited" is ~2**63)


@dataclass(frozen=True)
class MemoryGrant:
    """A cgroup memory limit on this process: the tightest of its cgroup's and its ancestors'.

    ``limit_bytes``: the smallest limit on the way up; ``available_bytes``: the least any limited level
    has left, ``limit - (usage - inactive_file)``, never negative; ``path``: the directory whose limit is
    ``limit_bytes``; ``version``: 1 or 2.
    """

    version: int
    path: str
    limit_bytes: int
    available_bytes: int

    def describe(self) -> str:
        gib = 2**30
        return (f"cgroup v{self.version} memory grant {self.limit_bytes / gib:.2f} GiB "
                f"({self.available_bytes / gib:.2f} GiB available) at {self.path}")


@dataclass(frozen=True)
class HostMemory:
    """What this process may use of the host's RAM: the machine's figures, capped by ``grant`` if any."""

    total_bytes: int
    available_bytes: int
    physical_total_bytes: int
    physical_available_bytes: int
    grant: MemoryGrant | None

    def to_dict(self) -> dict:
        out = {"total_bytes": self.total_bytes, "available_bytes": self.available_bytes,
               "physical_total_bytes": self.physical_total_bytes,
               "physical_available_bytes": self.physical_available_bytes, "grant": None}
        if self.grant is not None:
            g = self.grant
            out["grant"] = {"version": g.version, "path": g.path, "limit_bytes": g.limit_bytes,
                            "available_bytes": g.available_bytes}
        return out


def host_memory(proc: str = "/proc/self", root: str = "/") -> HostMemory:
    """The machine's total and available RAM (``psutil.virtual_memory``), each capped by the process's
    memory grant (module doc)."""
    vm = psutil.virtual_memory()
    grant = find_grant(proc, root)
    if grant is None:
        return HostMemory(vm.total, vm.available, vm.total, vm.available, None)
    return HostMemory(min(vm.total, grant.limit_bytes), min(vm.available, grant.available_bytes),
                      vm.total, vm.available, grant)


def find_grant(proc: str = "/proc/self", root: str = "/") -> MemoryGrant | None:
    """The memory limit the cgroup of ``proc`` (and its ancestors) puts on it; None when unlimited or
    when no memory controller can be read."""
    found = memory_cgroup(proc, root)
    if found is None:
        return None
    version, directory, top = found
    return _tightest(version, directory, top, _v1_level if version == 1 else _v2_level)


def memory_cgroup(proc: str = "/proc/self", root: str = "/") -> tuple | None:
    """``(version, the directory of the memory cgroup of proc, its hierarchy's mount point)``, both under
    ``root``; None when no memory controller is mounted. The v1 ``memory`` controller is asked first: on a
    hybrid host the v2 hierarchy is mounted too but controls no memory (its root's ``cgroup.controllers``
    does not name it)."""
    memberships = _read_memberships(os.path.join(proc, "cgroup"))
    mounts = _read_mounts(os.path.join(proc, "mountinfo"))
    if "memory" in memberships:
        directory, top = _locate(mounts, memberships["memory"], root,
                                 lambda fstype, opts: fstype == "cgroup" and "memory" in opts)
        if directory is not None:
            return 1, directory, top
    if "" in memberships:
        directory, top = _locate(mounts, memberships[""], root, lambda fstype, opts: fstype == "cgroup2")
        if directory is not None and "memory" in " ".join(_lines(os.path.join(top, "cgroup.controllers"))).split():
            return 2, directory, top
    return None


def _lines(path: str) -> list:
    """A small proc file's lines; none if it cannot be read (no such process, no such file system)."""
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _read_memberships(path: str) -> dict:
    """``/proc/<pid>/cgroup`` as {controller: cgroup path}; the v2 line ("0::/path") under ""."""
    out: dict = {}
    for line in _lines(path):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, cgroup = parts
        if hierarchy == "0" and controllers == "":
            out[""] = cgroup
        for name in controllers.split(","):
            if name:
                out.setdefault(name, cgroup)
    return out


def _read_mounts(path: str) -> list:
    """``/proc/<pid>/mountinfo`` as ``(fstype, super options, root within the hierarchy, mount point)``."""
    out = []
    for line in _lines(path):
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")   # optional fields before it vary in number
        if dash < 6 or len(fields) < dash + 4:
            continue
        fstype, super_opts = fields[dash + 1], set(fields[dash + 3].split(","))
        out.append((fstype, super_opts, _unescape(fields[3]), _unescape(fields[4])))
    return out


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _locate(mounts: list, cgroup: str, root: str, matches) -> tuple:
    """``(directory of the cgroup, its hierarchy's mount point)``, both under ``root``; (None, None) when no
    mount of that hierarchy is found. A cgroup outside the mount's root (a namespace's view) is the mount
    point itself: the nearest level this process can see."""
    for fstype, opts, mount_root, mount_point in mounts:
        if not matches(fstype, opts):
            continue
        top = os.path.join(root, mount_point.lstrip("/"))
        base = mount_root.rstrip("/")
        if cgroup == mount_root or cgroup.startswith(base + "/"):
            relative = cgroup[len(base):].strip("/")
        else:
            relative = ""
        return os.path.normpath(os.path.join(top, relative)), os.path.normpath(top)
    return None, None


def _read_int(path: str) -> int | None:
    """A cgroup file's number; "max" is :data:`UNLIMITED_BYTES`; None when missing or unreadable."""
    text = " ".join(_lines(path)).strip()
    if not text:
        return None   # missing or unreadable
    if text == "max":
        return UNLIMITED_BYTES
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: str, key: str) -> int:
    """One key of a ``memory.stat`` file (0 when absent)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _v1_level(directory: str) -> tuple | None:
    limit = _read_int(os.path.join(directory, "memory.limit_in_bytes"))
    usage = _read_int(os.path.join(directory, "memory.usage_in_bytes"))
    if limit is None or usage is None:
        return None
    return limit, usage, _read_stat(os.path.join(directory, "memory.stat"), "total_inactive_file")


def _v2_level(directory: str) -> tuple | None:
    limit = _read_int(os.path.join(directory, "memory.max"))   # the v2 root has none
    usage = _read_int(os.path.join(directory, "memory.current"))
    if limit is None or usage is None:
        return None
    return limit, usage, _read_stat(os.path.join(directory, "memory.stat"), "inactive_file")


def _tightest(version: int, directory: str, top: str, read_level) -> MemoryGrant | None:
    """The grant of ``directory`` and each ancestor up to ``top``: the smallest limit and the least left."""
    limit_bytes, limit_path, available_bytes = None, None, None
    level = directory
    while True:
        figures = read_level(level)
        if figures is not None and figures[0] < UNLIMITED_BYTES:
            limit, usage, inactive_file = figures
            left = max(0, limit - max(0, usage - inactive_file))
            if limit_bytes is None or limit < limit_bytes:
                limit_bytes, limit_path = limit, level
            available_bytes = left if available_bytes is None else min(available_bytes, left)
        if level == top or not level.startswith(top + os.sep):
            break
        level = os.path.dirname(level)
    if limit_bytes is None:
        return None
    return MemoryGrant(version, limit_path, limit_bytes, available_bytes)
