"""Bandwidth profile of this machine, behind ``infinity profile`` (DESIGN §1).

Sections of the profile (GB/s = 1e9 bytes per second throughout):

- ``machine``: cores, RAM, the swap directory's file system and whether it takes O_DIRECT.
- ``compute``: matmul GFLOP/s of each dtype at transformer linear-layer shapes (:data:`COMPUTE_SHAPES`:
  (d, d) and (d, 4d) for d 768 and 2048), forward and both gradients, by
  :func:`infinity.precision.measure_rates` (bounded: a dtype far slower than the fastest is stopped after a
  few rows), on the CPU (fp32, bf16) and on a CUDA device (fp32, bf16, fp16); what
  ``precision.param_dtype: auto`` chooses from those rates with the parameters offloaded and not; and the
  hardware (CPU model and its bf16 instructions, torch, the CUDA device). Later compute probes run in the
  dtype ``auto`` computes in here, so none runs in an emulated one.
- ``memcpy``: host memory copy bandwidth, bytes copied per second (each byte read once and
  written once), by ``Tensor.copy_`` on torch's intra-op threads and by one thread's libc
  ``memcpy``. The ceiling for host-tier moves and for the engine's staging copies.
- ``host_device``: host-to-device and device-to-host copies from pinned and from pageable
  memory; CUDA only, otherwise ``{"available": false, "reason": ...}``.
- ``nvme``: the project's own :class:`~infinity.io.IOEngine` + :class:`~infinity.io.ExtentFile`
  (checksums on, as the config defaults) over a sweep of block_bytes x threads x queue_depth,
  each row next to the baseline measured in the same run: a plain pread/pwrite loop over
  4096-aligned buffers with O_DIRECT (buffered where the file system refuses it), with the
  same block size and thread count, in the same directory. Writes include ``fdatasync``.
- ``cpu_adam``: :class:`~infinity.optim.cpu_adam.CpuAdamW` next to
  ``torch.optim.AdamW(fused=True)`` on one flat fp32 shard: parameters per second and GB/s of
  state streamed (16 bytes per parameter: fp32 param, grad, exp_avg, exp_avg_sq).
- ``collectives``: gloo all-reduce, all-gather and reduce-scatter across ``nproc`` local
  processes: algorithm bandwidth (bytes of the full tensor per second, per rank) and bus
  bandwidth (the same scaled by the ring's traffic factor, as nccl-tests report it).
- ``nvme.mixed``: the engine at the best row's settings reading one set of tensors while it
  writes another, both at once (what the optimizer step's pipeline does): each direction's GB/s
  while sharing the disk. The planner's "read and write at once" rates.
- ``contention``: how much compute on the CPU slows while the engine reads and writes at once (at the
  best row's settings), as an overlapped offloaded step runs them beside a CPU device's compute: a
  probe (matmuls and a LayerNorm + GELU at transformer shapes, on torch's intra-op threads, in the
  CPU's ``auto`` compute dtype, its rows sized from the ``compute`` rate to a fraction of a second)
  timed alone and beside the streaming disk, their ratio (``slowdown``), and the engine's own CPU
  seconds per GB moved (checksums, the I/O threads). The planner's slowdown of a CPU device's compute
  for the part of a phase the disk is busy.
- ``io``: the best sweep row (highest ``min(read, write)``) as a config ``io`` section;
  ``Config.from_dict({"io": profile["io"]})`` loads it as it is.

Sizes: ``--quick`` runs fewer sweep points and repeats, never smaller ones: below
:data:`STEADY_BYTES` per figure, set-up cost (thread start, the first pages, a
disk's request latency) and caches dominate (64 MiB runs put the I/O engine at
0.4-0.7x the raw disk and CPU Adam at 3x torch's, in L3). A ``--bytes`` below it
is measured as asked and marked: ``settings.lower_bound`` is true and
``settings.note`` says the figures are not steady-state rates.

Figures are the best of a few repeats (NVMe points run once: the disk is the slow part).
The profile asks what the machine can do; on a shared machine the best run is the one
least disturbed by its neighbours.

The package: :mod:`~infinity.profile.options` (what to measure and how big), one module a section's probe
(:mod:`~infinity.profile.machine`, :mod:`~infinity.profile.compute`, :mod:`~infinity.profile.memory` for
``memcpy`` and ``host_device``, :mod:`~infinity.profile.nvme` for ``nvme``, ``nvme.mixed`` and ``io``,
:mod:`~infinity.profile.contention`, :mod:`~infinity.profile.cpu_adam`, :mod:`~infinity.profile.collectives`),
:mod:`~infinity.profile.timing` (best and median of repeats); this module runs them in order and writes the
files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from infinity.config import IOConfig, format_size
from infinity.io import SwapIOError, probe_direct_io
from infinity.io.new_files import replaced
from infinity.profile.collectives import measure_collectives
from infinity.profile.compute import COMPUTE_SHAPES, cpu_compute_dtype, describe_compute, measure_compute
from infinity.profile.contention import measure_io_contention
from infinity.profile.cpu_adam import _ADAM_STATE_BYTES_PER_PARAM, measure_cpu_adam
from infinity.profile.machine import machine_info
from infinity.profile.memory import measure_host_device, measure_memcpy
from infinity.profile.nvme import best_io, measure_nvme, measure_nvme_mixed
from infinity.profile.options import STEADY_BYTES, ProfileError, ProfileOptions, _MiB

__all__ = [
    "ProfileError",
    "ProfileOptions",
    "run_profile",
    "write_profile",
    "measure_memcpy",
    "measure_host_device",
    "measure_compute",
    "describe_compute",
    "cpu_compute_dtype",
    "measure_nvme",
    "measure_cpu_adam",
    "measure_collectives",
    "best_io",
    "measure_nvme_mixed",
    "PROFILE_JSON",
    "PROFILE_PLOT",
    "STEADY_BYTES",
    "COMPUTE_SHAPES",
]

PROFILE_JSON = "profile.json"
PROFILE_PLOT = "profile_nvme.png"


def run_profile(options: ProfileOptions, progress: Callable[[str], None] | None = None) -> dict:
    """Measure every section; ``progress`` gets one line per step (None: silent)."""
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    parent = os.path.abspath(options.directory or os.getcwd())
    try:
        scratch = tempfile.mkdtemp(prefix=".infinity-profile-", dir=parent)
    except OSError as e:
        raise ProfileError(f"--dir {parent}: cannot make a scratch directory there ({e.strerror})") from None
    try:
        try:
            direct = probe_direct_io(scratch)
        except SwapIOError as e:
            raise ProfileError(f"--dir {parent}: {e}") from None
        base = options.base_bytes
        profile = {"machine": machine_info(parent, direct)}
        say("compute: matmul GFLOP/s per dtype at transformer shapes")
        profile["compute"] = measure_compute(options.quick)
        for line in describe_compute(profile["compute"]):
            say(f"  {line}")
        say(f"memcpy: {format_size(base)}")
        profile["memcpy"] = measure_memcpy(base, options.repeats)
        say("host<->device copies")
        profile["host_device"] = measure_host_device(base, options.repeats)
        try:
            profile["nvme"] = measure_nvme(scratch, base // 4, options.quick, direct, say)
        except OSError as e:  # a full or failing disk: name the directory, not a traceback
            raise ProfileError(f"--dir {parent}: NVMe sweep failed: {e}") from None
        say("compute beside the disk: a probe alone and while the engine reads and writes at once")
        try:
            dtype = cpu_compute_dtype(profile["compute"])
            profile["contention"] = measure_io_contention(scratch, IOConfig(**best_io(profile["nvme"]["sweep"], direct)),
                                                          base // 4, options.repeats, dtype,
                                                          profile["compute"]["cpu"]["gflops"][dtype])
        except OSError as e:
            raise ProfileError(f"--dir {parent}: the contention probe's I/O failed: {e}") from None
        say(f"cpu adam: {base // _ADAM_STATE_BYTES_PER_PARAM:,} params")
        profile["cpu_adam"] = measure_cpu_adam(base // _ADAM_STATE_BYTES_PER_PARAM, options.repeats)
        say(f"collectives: {options.nproc} gloo rank(s)")
        profile["collectives"] = measure_collectives(
            options.nproc, [base // 256, base // 64, base // 16], 3 if options.quick else 10, scratch)
        profile["io"] = best_io(profile["nvme"]["sweep"], direct)
        profile["settings"] = {"quick": options.quick, "bytes": base, "nproc": options.nproc,
                               "repeats": options.repeats, "elapsed_s": time.perf_counter() - started,
                               "lower_bound": options.lower_bound}
        if options.lower_bound:
            profile["settings"]["note"] = (
                f"--bytes {format_size(base)} is below {format_size(STEADY_BYTES)}: set-up cost and caches "
                "dominate such small points, so these figures are not steady-state rates (disk rates read "
                "low, CPU Adam and memcpy may read high from cache); profile without --bytes for a plan")
        return profile
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_profile(profile: dict, out_dir: str | os.PathLike) -> dict:
    """Write ``profile.json`` and the NVMe sweep plot into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    json_path, plot_path = out / PROFILE_JSON, out / PROFILE_PLOT
    with replaced(json_path, "w") as f:  # a reader never sees half a profile; no planted symlink is followed
        f.write(json.dumps(profile, indent=2) + "\n")
    _plot_nvme(profile["nvme"], plot_path)
    return {"json": str(json_path), "plot": str(plot_path)}


def _plot_nvme(nvme: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, kind in zip(axes, ("write", "read")):
        for threads, depth in sorted({(r["threads"], r["queue_depth"]) for r in nvme["sweep"]}):
            rows = [r for r in nvme["sweep"] if (r["threads"], r["queue_depth"]) == (threads, depth)]
            ax.plot([r["block_bytes"] / _MiB for r in rows], [r[f"{kind}_gbps"] for r in rows],
                    marker="o", label=f"engine t{threads} q{depth}")
        for threads in sorted({r["threads"] for r in nvme["raw"]["rows"]}):
            rows = [r for r in nvme["raw"]["rows"] if r["threads"] == threads]
            ax.plot([r["block_bytes"] / _MiB for r in rows], [r[f"{kind}_gbps"] for r in rows],
                    linestyle="--", marker="x", label=f"raw t{threads}")
        blocks_mib = sorted({r["block_bytes"] / _MiB for r in nvme["sweep"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(blocks_mib, [f"{b:g}" for b in blocks_mib])
        ax.set_ylim(bottom=0)  # ratios between lines read true only from a zero baseline
        ax.set_xlabel("block size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{kind} ({nvme['mode']})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"NVMe sweep: {format_size(nvme['bytes_per_point'])} per point, checksums on")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

