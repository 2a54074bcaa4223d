"""The profile's ``machine`` section: cores, RAM as this process may use it, the swap directory's file system and
I/O mode, the platform and torch."""

from __future__ import annotations

import os
import platform

import psutil
import torch

from infinity.optim.cpu_adam import default_adam_threads
from infinity.store.memory_grant import host_memory

__all__ = ["machine_info"]


def _fs_type(path: str) -> str:
    """File system type of the mount holding ``path`` (longest mount point that contains it)."""
    path = os.path.realpath(path)
    best_mount, kind = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best_mount):  # >=: a later mount on the same point shadows
            best_mount, kind = mount, part.fstype
    return kind


def machine_info(directory: str, direct: bool) -> dict:
    """The machine, as far as this process may use it: RAM is its cgroup's memory grant where that is
    smaller than the machine's (``memory_grant``: the grant as :mod:`infinity.store.memory_grant` reads it,
    None without one), since the planner sizes budgets from it."""
    mem = host_memory()
    info = {
        "cpu_count": os.cpu_count(),
        "cores_available": default_adam_threads(1),
        "ram_bytes": mem.total_bytes,
        "ram_available_bytes": mem.available_bytes,
        "memory_grant": mem.to_dict()["grant"],
        "dir": directory,
        "fs_type": _fs_type(directory),
        "direct_io": "direct" if direct else "buffered",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if info["cuda"]:  # CUDA-only: which device the host_device figures are for
        info["cuda_device"] = torch.cuda.get_device_name()
    return info

