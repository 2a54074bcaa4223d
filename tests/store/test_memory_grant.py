"""The memory a process may use is capped by its cgroup's grant: v1 and v2 read from a fake cgroup tree
(``/proc/<pid>/cgroup``, ``mountinfo`` and the controller's files under ``tmp_path``), and for real, a
child started inside a memory cgroup sizes its ``auto`` budgets from the grant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from infinity.config import TiersConfig
from infinity.store import Tier, memory_grant
from infinity.store.budget import CPU_DEVICE_FRACTION, auto_host_bytes, resolve_budgets
from infinity.store.memory_grant import UNLIMITED_BYTES, find_grant, host_memory, memory_cgroup

from memory_cgroup import MemoryCgroup, unavailable_reason

GiB = 2**30
V1_UNLIMITED = "9223372036854771712"   # what v1 writes for "no limit": LONG_MAX rounded down to a page

V1_MOUNTS = """\
24 30 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw
31 24 0:28 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,nosuid shared:16 - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:17 - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw
"""
V2_MOUNTS = """\
24 30 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw
31 24 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v1_level(directory: Path, limit: str, usage: int, inactive_file: int) -> None:
    _write(directory / "memory.limit_in_bytes", limit + "\n")
    _write(directory / "memory.usage_in_bytes", f"{usage}\n")
    # inactive_file is the cgroup's own; total_inactive_file counts its children too (what usage counts)
    _write(directory / "memory.stat", f"cache 0\ninactive_file 1\nactive_file 0\ntotal_inactive_file {inactive_file}\n")


def _v2_level(directory: Path, limit: str, usage: int, inactive_file: int) -> None:
    _write(directory / "memory.max", limit + "\n")
    _write(directory / "memory.current", f"{usage}\n")
    _write(directory / "memory.stat", f"anon 0\nfile 0\ninactive_anon 0\ninactive_file {inactive_file}\n")


def _v1_tree(tmp_path: Path, mounts: str = V1_MOUNTS, member: str = "/docker/abc") -> tuple:
    proc = tmp_path / "proc"
    _write(proc / "cgroup", f"11:pids:/docker/abc\n4:memory:{member}\n1:name=systemd:/docker/abc\n0::/\n")
    _write(proc / "mountinfo", mounts)
    _write(tmp_path / "sys/fs/cgroup/unified/cgroup.controllers", "\n")   # hybrid: v2 controls no memory
    top = tmp_path / "sys/fs/cgroup/memory"
    _v1_level(top, V1_UNLIMITED, 9 * GiB, 2 * GiB)   # the root: the whole machine's charge
    return str(proc), top


def _v2_tree(tmp_path: Path) -> tuple:
    proc = tmp_path / "proc"
    _write(proc / "cgroup", "0::/system.slice/job.scope\n")
    _write(proc / "mountinfo", V2_MOUNTS)
    top = tmp_path / "sys/fs/cgroup"
    _write(top / "cgroup.controllers", "cpuset cpu io memory pids\n")   # the v2 root has no memory.max
    _write(top / "memory.stat", "inactive_file 0\n")
    return str(proc), top


def test_v1_limit_and_available_count_inactive_page_cache_as_available(tmp_path):
    proc, top = _v1_tree(tmp_path)
    _v1_level(top / "docker", V1_UNLIMITED, 5 * GiB, 0)
    _v1_level(top / "docker/abc", str(6 * GiB), 5 * GiB, 2 * GiB)
    grant = find_grant(proc, str(tmp_path))
    assert grant == memory_grant.MemoryGrant(1, str(top / "docker/abc"), 6 * GiB, 6 * GiB - (5 * GiB - 2 * GiB))
    assert memory_cgroup(proc, str(tmp_path)) == (1, str(top / "docker/abc"), str(top))


def test_v1_an_ancestor_tighter_than_the_cgroup_binds(tmp_path):
    proc, top = _v1_tree(tmp_path)
    _v1_level(top / "docker", str(4 * GiB), 3 * GiB, 0)            # 1 GiB left for all of docker's children
    _v1_level(top / "docker/abc", str(6 * GiB), 2 * GiB, 0)        # 4 GiB left by its own limit
    grant = find_grant(proc, str(tmp_path))
    assert (grant.path, grant.limit_bytes, grant.available_bytes) == (str(top / "docker"), 4 * GiB, 1 * GiB)


def test_v1_unlimited_everywhere_is_no_grant(tmp_path):
    proc, top = _v1_tree(tmp_path)
    _v1_level(top / "docker/abc", V1_UNLIMITED, 5 * GiB, 0)
    assert find_grant(proc, str(tmp_path)) is None


def test_v1_inside_a_container_the_mount_root_is_the_cgroup(tmp_path):
    """Docker without a cgroup namespace: /proc/self/cgroup names the host's path, and the memory
    hierarchy is mounted from that cgroup, so its mount point holds the container's own files."""
    mounts = V1_MOUNTS.replace("35 31 0:32 / /sys/fs/cgroup/memory", "35 31 0:32 /docker/abc /sys/fs/cgroup/memory")
    proc, top = _v1_tree(tmp_path, mounts)
    _v1_level(top, str(3 * GiB), 1 * GiB, 0)
    grant = find_grant(proc, str(tmp_path))
    assert (grant.path, grant.limit_bytes, grant.available_bytes) == (str(top), 3 * GiB, 2 * GiB)


def test_a_usage_below_the_inactive_page_cache_leaves_the_whole_limit(tmp_path):
    proc, top = _v1_tree(tmp_path)
    _v1_level(top / "docker/abc", str(2 * GiB), 1 * GiB, 3 * GiB)   # counters read at different moments
    assert find_grant(proc, str(tmp_path)).available_bytes == 2 * GiB


def test_v2_limit_current_and_inactive_file(tmp_path):
    proc, top = _v2_tree(tmp_path)
    _v2_level(top / "system.slice", "max", 7 * GiB, 0)
    _v2_level(top / "system.slice/job.scope", str(8 * GiB), 7 * GiB, 3 * GiB)
    grant = find_grant(proc, str(tmp_path))
    assert grant == memory_grant.MemoryGrant(2, str(top / "system.slice/job.scope"), 8 * GiB, 4 * GiB)


def test_v2_max_is_no_grant_and_a_huge_limit_is_none_either(tmp_path):
    proc, top = _v2_tree(tmp_path)
    _v2_level(top / "system.slice", "max", 7 * GiB, 0)
    _v2_level(top / "system.slice/job.scope", "max", 7 * GiB, 0)
    assert find_grant(proc, str(tmp_path)) is None
    _v2_level(top / "system.slice/job.scope", str(UNLIMITED_BYTES), 7 * GiB, 0)
    assert find_grant(proc, str(tmp_path)) is None


def test_v2_without_its_memory_controller_and_no_v1_is_no_grant(tmp_path):
    proc, top = _v2_tree(tmp_path)
    _write(top / "cgroup.controllers", "cpu io pids\n")
    _v2_level(top / "system.slice/job.scope", str(GiB), 0, 0)   # stale files: the controller is off
    assert memory_cgroup(proc, str(tmp_path)) is None and find_grant(proc, str(tmp_path)) is None


def test_no_cgroup_files_is_no_grant(tmp_path):
    assert find_grant(str(tmp_path / "proc"), str(tmp_path)) is None


def test_a_mount_point_with_a_space_is_unescaped(tmp_path):
    mounts = V1_MOUNTS.replace("/sys/fs/cgroup/memory rw", "/sys/fs/cgroup/mem\\040ory rw")
    proc, _ = _v1_tree(tmp_path, mounts)
    top = tmp_path / "sys/fs/cgroup/mem ory"
    _v1_level(top / "docker/abc", str(GiB), 0, 0)
    assert find_grant(proc, str(tmp_path)).path == str(top / "docker/abc")


def test_host_memory_is_the_machine_capped_by_the_grant(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_grant.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=64 * GiB, available=60 * GiB))
    proc, top = _v1_tree(tmp_path)
    _v1_level(top / "docker/abc", str(6 * GiB), 2 * GiB, 0)
    mem = host_memory(proc, str(tmp_path))
    assert (mem.total_bytes, mem.available_bytes) == (6 * GiB, 4 * GiB)
    assert (mem.physical_total_bytes, mem.physical_available_bytes) == (64 * GiB, 60 * GiB)
    assert mem.to_dict()["grant"]["limit_bytes"] == 6 * GiB
    _v1_level(top / "docker/abc", str(128 * GiB), 2 * GiB, 0)   # a grant above the machine caps nothing
    mem = host_memory(proc, str(tmp_path))
    assert (mem.total_bytes, mem.available_bytes) == (64 * GiB, 60 * GiB)


def test_auto_budgets_follow_the_grant(tmp_path, monkeypatch):
    """Host and CPU-device ``auto`` are the module rules applied to the grant, not to the machine."""
    monkeypatch.setattr(memory_grant.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=64 * GiB, available=60 * GiB))
    proc, top = _v1_tree(tmp_path)
    _v1_level(top / "docker/abc", str(12 * GiB), 2 * GiB, 0)
    real = memory_grant.find_grant
    monkeypatch.setattr(memory_grant, "find_grant", lambda *a, **k: real(proc, str(tmp_path)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    got = resolve_budgets(TiersConfig(), torch.device("cpu"))
    half = auto_host_bytes(10 * GiB, 12 * GiB, 2)
    assert half == (10 * GiB - 2 * GiB) // 2 // 2    # OS reserve: the 2 GiB minimum
    # a CPU device: both tiers out of the host half, the device's 1/4 of the grant capped at half of it
    assert got[Tier.DEVICE] == min(int(12 * GiB * CPU_DEVICE_FRACTION) // 2, half // 2)
    assert got[Tier.HOST] + got[Tier.DEVICE] == half


_CHILD = """
import json, os
from infinity.config import TiersConfig
from infinity.store.budget import resolve_budgets
from infinity.store.memory_grant import host_memory
import torch
before = host_memory()
budgets = resolve_budgets(TiersConfig(), torch.device("cpu"))
after = host_memory()
print(json.dumps({"before": before.to_dict(), "after": after.to_dict(),
                  "budgets": {t.value: n for t, n in budgets.items()}}))
"""


def test_a_process_inside_a_real_memory_cgroup_sizes_auto_budgets_from_its_grant(tmp_path):
    """A child started in a 3 GiB memory cgroup (made here, removed after) sees the grant, and its host
    and CPU-device ``auto`` budgets are the rules applied to it (2 ranks on the machine). 3 GiB, not
    less: the host rule leaves the OS at least 2 GiB, so a smaller grant gives a host budget of 0."""
    why = unavailable_reason()
    if why is not None:
        pytest.skip(why)
    limit = 3 * GiB
    env = dict(os.environ, LOCAL_WORLD_SIZE="2", PYTHONPATH=str(Path(__file__).parents[2]))
    with MemoryCgroup(limit) as grant:
        child = grant.popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
        # bounded by the work: importing torch and reading a few files; a wedged child is killed by close()
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        path = grant.path
    assert not os.path.exists(path), "the cgroup was not removed"
    seen = json.loads(out)
    for mem in (seen["before"], seen["after"]):
        assert mem["grant"] is not None and mem["grant"]["limit_bytes"] == limit and mem["total_bytes"] == limit
        assert mem["physical_total_bytes"] > limit
    device = seen["budgets"]["device"]
    # the child's charge moves while it runs; v1 charges in per-CPU batches of 64 pages
    batch = 64 * os.sysconf("SC_PAGE_SIZE") * os.cpu_count()
    lows = [seen[k]["available_bytes"] - batch for k in ("before", "after")]
    highs = [seen[k]["available_bytes"] + batch for k in ("before", "after")]
    half = seen["budgets"]["host"] + device   # a CPU device: both tiers share the host half
    assert auto_host_bytes(min(lows), limit, 2) <= half <= auto_host_bytes(max(highs), limit, 2)
    assert 0 < half <= auto_host_bytes(limit, limit, 2)
    assert device == min(int(limit * CPU_DEVICE_FRACTION) // 2, half // 2)


def test_a_failure_inside_the_grant_still_kills_its_processes_and_removes_the_cgroup():
    why = unavailable_reason()
    if why is not None:
        pytest.skip(why)
    with pytest.raises(RuntimeError, match="the job failed"):
        with MemoryCgroup(256 * 2**20) as grant:
            sleeper = grant.popen([sys.executable, "-c", "import time; time.sleep(600)"])
            path = grant.path
            raise RuntimeError("the job failed")
    assert sleeper.poll() is not None, "the process in the grant outlived it"
    assert not os.path.exists(path), "the cgroup was not removed"
