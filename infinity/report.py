"""What this machine and install can do: the facts behind ``infinity report`` (DeepSpeed's ``ds_report``).

:func:`build_report` gathers them as one JSON-ready dict and :func:`report_lines` renders it for a
terminal. It measures little, and only with the probes training itself uses: the RAM this process may
use (:mod:`infinity.store.memory_grant`: the machine's, capped by a cgroup's memory grant), the compute dtype
``auto`` would pick is :func:`infinity.precision.choose`'s answer (on a CPU, its short matmul probe,
cached per CPU, torch version and thread count), the native libraries are the ones
:mod:`infinity.optim.native` and :mod:`infinity.store.host_cache` build at first use (built now if
they were not, about a second each), and a swap directory's figures are
:func:`infinity.io.probe_direct_io` and one point of :mod:`infinity.profile`'s engine sweep (a few
seconds; its file is removed after).
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time

import torch

from infinity.config import IOConfig, format_size
from infinity.io import aligned_empty, probe_direct_io
from infinity.precision import choose, hardware_record
from infinity.profile.compute import COMPUTE_SHAPES
from infinity.profile.machine import _fs_type
from infinity.profile.nvme import _engine_point
from infinity.store.memory_grant import host_memory

__all__ = ["build_report", "report_lines", "probe_directory", "DEFAULT_PROBE_BYTES"]

DEFAULT_PROBE_BYTES = 256 * 2**20   # one engine point: a few seconds on a slow disk, under one on NVMe
_TENSORS = 4                        # requests in flight at once, as in the profile's sweep


def _software() -> dict:
    """Python, torch and the libraries infinity optionally uses, with their versions (None: absent)."""
    out = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "infinity": sys.modules["infinity"].__version__}
    for name in ("transformers", "accelerate", "safetensors", "deepspeed"):
        try:
            out[name] = __import__(name).__version__
        except Exception:   # absent, or broken on import: either way not usable here
            out[name] = None
    return out


def _devices() -> dict:
    """The CPU (:func:`~infinity.precision.hardware_record`) and each CUDA device with its capability."""
    out = {"cpu": hardware_record("cpu")["cpu"], "cuda": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out["cuda"].append({"index": i, "name": props.name, "capability": [props.major, props.minor],
                                "memory_bytes": props.total_memory,
                                "native_bf16": props.major >= 8})
    return out


def _precision() -> dict:
    """What ``precision.param_dtype: auto`` picks on the device training would use, offloaded parameters
    and not, and why (the one line ``infinity train`` logs)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {"device": str(device)}
    for key, offloaded in (("params_offloaded", True), ("params_not_offloaded", False)):
        choice = choose(device, COMPUTE_SHAPES, params_offloaded=offloaded)
        out[key] = {"param_dtype": choice.param_dtype, "compute_dtype": choice.compute_dtype,
                    "reason": choice.reason}
    return out


def _compiler(env: str, default: str) -> dict:
    command = os.environ.get(env) or default
    path = shutil.which(command.split()[0]) if command.split() else None
    return {"env": env, "command": command, "found": path}


def _native() -> dict:
    """The two optional native libraries: whether each builds and loads here, and why not."""
    from infinity.optim.native import kernel, native_reason
    from infinity.store.host_cache import library_reason

    int8 = kernel() is not None
    cache_reason = library_reason()
    return {
        "int8_adam_kernel": {"available": int8, "reason": None if int8 else native_reason(),
                             "compiler": _compiler("CC", "cc"),
                             "without_it": "optimizer.moments: int8 runs as torch ops, about 5x slower"},
        "host_block_cache": {"available": cache_reason is None, "reason": cache_reason,
                             "compiler": _compiler("CXX", "c++"),
                             "without_it": "tiers.host_cache_bytes is off: more page faults when offloading"},
        "disabled_by_env": os.environ.get("INFINITY_NATIVE") == "0",
    }


def probe_directory(directory: str, probe_bytes: int = DEFAULT_PROBE_BYTES) -> dict:
    """A swap directory: its file system, whether it takes O_DIRECT, free space, and the I/O engine's
    write and read rates for ``probe_bytes`` (0: not measured) at the default ``io`` settings."""
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--dir {directory}: not a directory (create it first)")
    usage = shutil.disk_usage(directory)
    direct = probe_direct_io(directory)
    out = {"path": directory, "fs_type": _fs_type(directory), "o_direct": direct,
           "free_bytes": usage.free, "total_bytes": usage.total}
    probe_bytes = min(probe_bytes, usage.free // 4) // (_TENSORS * 2**20) * (_TENSORS * 2**20)
    if probe_bytes <= 0:
        out["io"] = None
        return out
    io = IOConfig(direct=direct)
    tensor_bytes = probe_bytes // _TENSORS
    src = aligned_empty(tensor_bytes).copy_(torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8))
    dsts = [aligned_empty(tensor_bytes) for _ in range(_TENSORS)]
    t0 = time.perf_counter()
    write_gbps, read_gbps = _engine_point(directory, io, probe_bytes, src, dsts)
    out["io"] = {"bytes": probe_bytes, "write_gbps": write_gbps, "read_gbps": read_gbps,
                 "elapsed_s": time.perf_counter() - t0,
                 "settings": {"block_bytes": io.block_bytes, "queue_depth": io.queue_depth, "threads": io.threads,
                              "checksum": io.checksum}}
    return out


def build_report(directory: str | None = None, probe_bytes: int = DEFAULT_PROBE_BYTES) -> dict:
    """Everything ``infinity report`` says, JSON-ready."""
    out = {"software": _software(), "devices": _devices(), "memory": host_memory().to_dict(),
           "precision_auto": _precision(), "native": _native()}
    if directory is not None:
        out["directory"] = probe_directory(directory, probe_bytes)
    return out


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _memory_lines(mem: dict) -> list[str]:
    """RAM, and the cgroup grant that caps what this process may use of it (what ``auto`` budgets follow)."""
    machine = (f"RAM: {format_size(mem['physical_total_bytes'])}, "
               f"{format_size(mem['physical_available_bytes'])} available")
    g = mem["grant"]
    if g is None:
        return [machine + "; no cgroup memory grant (auto budgets are sized from the machine's RAM)"]
    return [machine, f"memory grant: cgroup v{g['version']} limit {format_size(g['limit_bytes'])}, "
                     f"{format_size(g['available_bytes'])} available ({g['path']}); auto budgets are sized "
                     "from it"]


def report_lines(report: dict) -> list[str]:
    """The report for a terminal, one fact a line."""
    sw, dev, prec, nat = report["software"], report["devices"], report["precision_auto"], report["native"]
    cpu = dev["cpu"]
    lines = [f"infinity {sw['infinity']}, torch {sw['torch']} (CUDA build: {sw['torch_cuda'] or 'none'}), "
             f"Python {sw['python']}, {sw['platform']}",
             "libraries: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in sw.items()
                                       if k in ("transformers", "accelerate", "safetensors", "deepspeed")),
             f"CPU: {cpu['model']} ({cpu['cores']} cores, torch uses {cpu['threads']} threads); "
             f"avx512_bf16 {_yes(cpu['avx512_bf16'])}, amx_bf16 {_yes(cpu['amx_bf16'])}, "
             f"torch kernels {cpu['torch_cpu_capability']}"
             + (f", held by {', '.join(f'{k}={v}' for k, v in cpu['isa_caps'].items())}" if cpu["isa_caps"] else "")]
    if dev["cuda"]:
        for d in dev["cuda"]:
            lines.append(f"CUDA device {d['index']}: {d['name']}, compute capability {d['capability'][0]}."
                         f"{d['capability'][1]}, {format_size(d['memory_bytes'])}, native bf16 "
                         f"{_yes(d['native_bf16'])}")
    else:
        lines.append("CUDA: no device (the compute device is the CPU; its device tier is RAM)")
    lines += _memory_lines(report["memory"])
    lines.append(f"precision auto on {prec['device']}:")
    for key, label in (("params_offloaded", "parameters offloaded"), ("params_not_offloaded", "in memory")):
        c = prec[key]
        lines.append(f"  {label}: param_dtype {c['param_dtype']}, compute_dtype {c['compute_dtype']}: {c['reason']}")
    lines.append("native libraries (built at first use; INFINITY_NATIVE=0 turns them off):")
    for key, label in (("int8_adam_kernel", "int8 Adam kernel"), ("host_block_cache", "host block cache")):
        n = nat[key]
        comp = n["compiler"]
        found = comp["found"] or "not found"
        state = "available" if n["available"] else f"not available ({n['reason']}); {n['without_it']}"
        lines.append(f"  {label}: {state}; ${comp['env']} {comp['command']!r}: {found}")
    d = report.get("directory")
    if d is not None:
        lines.append(f"directory {d['path']}: {d['fs_type']}, O_DIRECT {_yes(d['o_direct'])}, "
                     f"{format_size(d['free_bytes'])} free of {format_size(d['total_bytes'])}")
        if d["io"] is None:
            lines.append("  I/O not measured: too little free space")
        else:
            io = d["io"]
            lines.append(f"  I/O engine, {format_size(io['bytes'])} at the default io settings: write "
                         f"{io['write_gbps']:.2f} GB/s, read {io['read_gbps']:.2f} GB/s (cold cache) "
                         f"in {io['elapsed_s']:.1f} s; `infinity profile --dir` sweeps the settings")
    return lines
