"""``infinity profile``: every section measured, the io section loadable, files written, bad input exit 2."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import infinity
from infinity import profile as prof
from infinity.profile import contention as prof_contention, nvme as prof_nvme, timing as prof_timing
from infinity.profile.memory import FRESH_BYTES
from infinity.cli import main
from infinity.config import MASTER_FORMATS, MOMENT_FORMATS
from infinity.io import probe_direct_io
from infinity.profile import (COMPUTE_SHAPES, PROFILE_JSON, PROFILE_PLOT, STEADY_BYTES, ProfileOptions,
                              best_io, cpu_compute_dtype, measure_collectives, measure_compute, measure_host_device,
                              measure_nvme)

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


# How many times the work's expected seconds the quick profile may take before it counts as hung: the rates
# are measured once, beside whatever else shares the machine, and the profile runs later beside it too.
WORK_MARGIN = 10


def _disk_gbps(directory: Path, nbytes: int = 64 * MiB) -> float:
    """This disk's GB/s writing ``nbytes`` (flushed) and reading them back from the disk, both ways counted."""
    path = directory / "rate.bin"
    data = os.urandom(nbytes)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # the read comes from the disk, not the cache
        os.pread(fd, nbytes, 0)
    finally:
        os.close(fd)
        path.unlink()
    return 2 * nbytes / (time.perf_counter() - t0) / 1e9


def _memory_gbps(nbytes: int = 128 * MiB) -> float:
    """Host memory GB/s of a tensor copy, bytes read and written counted, best of three."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = min(prof_timing._wall_times(lambda: dst.copy_(src), 3))
    return 2 * nbytes / best / 1e9


def quick_profile_work_s(swap: Path, nproc: int = 2) -> float:
    """Seconds the work of ``infinity profile --quick`` takes here, from this machine's rates measured now:
    the bytes it moves through the disk and through memory at their rates, its compute sections at their
    own bounds (the compute section timed, the contention probe's passes at their target), and starting
    its processes (this one and ``nproc`` ranks, each importing the package)."""
    opts = ProfileOptions(quick=True, nproc=nproc)
    base, repeats = opts.base_bytes, opts.repeats
    point = base // 4
    points = prof_nvme._sweep_points(True, point)
    raw_rows = {(block, threads) for block, threads, _ in points}
    # each written and read: the sweep's points, the raw rows, the mixed point's first write and rounds
    disk_bytes = 2 * point * (len(points) + len(raw_rows) + 1 + repeats)
    memcpy_bytes = 2 * base * 3 * (repeats + 1)   # copy_, memmove, into fresh memory; a warm-up each
    formats = len(MASTER_FORMATS) * len(MOMENT_FORMATS) + 1   # each format, and torch's fused AdamW
    adam_bytes = base * (repeats + 1) * formats   # 16 bytes of state a parameter, base // 16 parameters
    collective_bytes = 3 * 2 * (base // 256 + base // 64 + base // 16) * (3 + 1)   # 3 ops, bus factor <= 2
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import infinity.profile"], cwd=REPO, check=True)
    start_s = (1 + nproc) * (time.perf_counter() - t0)
    compute_s = measure_compute(quick=True)["cpu"]["elapsed_s"]
    # the probe: a warm-up and repeats alone, repeats beside the disk, the disk alone for at least a second
    probe_s = prof_contention.CONTENTION_PROBE_S
    contention_s = (1 + 2 * repeats) * probe_s + max(1.0, 2 * probe_s)
    return (disk_bytes / 1e9 / _disk_gbps(swap) + (memcpy_bytes + adam_bytes + collective_bytes) / 1e9 / _memory_gbps()
            + start_s + compute_s + contention_s)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One real ``infinity profile --quick --json`` run (the program, in its own process), default sizes;
    given :data:`WORK_MARGIN` times its work's seconds here before it counts as hung."""
    root = tmp_path_factory.mktemp("profile")
    out, swap = root / "out", root / "swap"
    swap.mkdir()
    timeout_s = WORK_MARGIN * quick_profile_work_s(swap)
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli", "profile", "--quick", "--json",
         "--out", str(out), "--dir", str(swap), "--nproc", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr
    return {"profile": json.loads(proc.stdout), "out": out, "swap": swap}


def test_quick_json_has_every_section_with_positive_values(quick):
    p = quick["profile"]
    assert set(p) >= {"machine", "compute", "memcpy", "host_device", "nvme", "contention", "cpu_adam", "collectives",
                      "io"}
    m = p["machine"]
    assert m["cpu_count"] >= 1 and m["cores_available"] >= 1 and m["ram_bytes"] > m["ram_available_bytes"] > 0
    assert m["fs_type"] not in ("", "unknown")
    assert m["direct_io"] == ("direct" if probe_direct_io(quick["swap"]) else "buffered") == p["nvme"]["mode"]
    assert p["memcpy"]["bytes"] == STEADY_BYTES and p["memcpy"]["gbps"] > 0 and p["memcpy"]["single_thread_gbps"] > 0
    # a copy into fresh memory pays its page faults: slower than into memory already touched
    assert p["memcpy"]["fresh_bytes"] >= FRESH_BYTES and 0 < p["memcpy"]["fresh_gbps"] < p["memcpy"]["gbps"]

    hd = p["host_device"]
    if torch.cuda.is_available():
        assert hd["available"] and all(hd[f"{d}_{k}_gbps"] > 0 for d in ("h2d", "d2h") for k in ("pinned", "pageable"))
    else:
        assert hd == {"available": False, "reason": "no CUDA device: torch.cuda.is_available() is False"}

    nvme = p["nvme"]
    assert nvme["bytes_per_point"] == STEADY_BYTES // 4 and nvme["tensor_bytes"] == STEADY_BYTES // 16
    # quick grid: blocks 1 and 4 MiB x (threads 1 depth 1, threads 2 depth 1, threads 2 depth 2), and the
    # config's default settings (8 MiB, 4 threads, depth 8)
    assert sorted((r["block_bytes"], r["threads"], r["queue_depth"]) for r in nvme["sweep"]) == [
        (b, t, q) for b in (MiB, 4 * MiB) for t, q in ((1, 1), (2, 1), (2, 2))] + [(8 * MiB, 4, 8)]
    for row in nvme["sweep"]:
        for key in ("read_gbps", "write_gbps", "raw_read_gbps", "raw_write_gbps"):
            assert row[key] > 0, (key, row)
        raw = next(r for r in nvme["raw"]["rows"]
                   if (r["block_bytes"], r["threads"]) == (row["block_bytes"], row["threads"]))
        assert row["raw_read_gbps"] == raw["read_gbps"] and row["read_ratio"] == row["read_gbps"] / raw["read_gbps"]
    assert len(nvme["raw"]["rows"]) == 5 and nvme["raw"]["mode"] == nvme["mode"]
    mixed, io = nvme["mixed"], p["io"]
    assert (mixed["block_bytes"], mixed["threads"], mixed["queue_depth"]) == (
        io["block_bytes"], io["threads"], io["queue_depth"])
    assert mixed["read_gbps"] > 0 and mixed["write_gbps"] > 0 and mixed["bytes_each_way"] == STEADY_BYTES // 4
    # the median of three rounds, each direction's own: one disturbed round does not make the figure
    assert len(mixed["rounds"]) == 3
    assert mixed["read_gbps"] == sorted(r for r, _ in mixed["rounds"])[1]
    assert mixed["write_gbps"] == sorted(w for _, w in mixed["rounds"])[1]
    # the probe alone and beside the engine at the best row's settings; the planner reads the ratio
    con = p["contention"]
    assert (con["block_bytes"], con["threads"], con["queue_depth"]) == (io["block_bytes"], io["threads"], io["queue_depth"])
    assert con["compute_alone_s"] > 0 and con["compute_beside_io_s"] > 0
    # in the dtype a CPU device computes in here, never an emulated one
    assert con["dtype"] == cpu_compute_dtype(p["compute"]) and con["probe"].startswith(con["dtype"] + " (")
    assert con["slowdown"] == max(1.0, con["compute_beside_io_s"] / con["compute_alone_s"])
    assert con["io_gbps"] > 0 and con["io_gbps_beside_compute"] > 0 and con["io_cpu_s_per_gb"] > 0
    from infinity.plan.rates import Rates
    assert Rates.from_profile(p).compute_slowdown == con["slowdown"]
    # quick mode runs fewer points, not smaller ones: its figures are steady-state rates
    assert p["settings"]["quick"] and p["settings"]["lower_bound"] is False and "note" not in p["settings"]

    adam = p["cpu_adam"]
    assert adam["numel"] == STEADY_BYTES // 16 and adam["state_bytes_per_param"] == 16
    assert adam["gbps"] > 0 and adam["torch_fused_gbps"] > 0
    assert adam["params_per_s"] == pytest.approx(adam["gbps"] * 1e9 / 16)
    assert adam["ratio"] == pytest.approx(adam["gbps"] / adam["torch_fused_gbps"])
    # every other stored format the config accepts, priced for the planner
    want = {f"{m}/{v}" for m in MASTER_FORMATS for v in MOMENT_FORMATS} - {"fp32/fp32"}
    assert set(adam["formats"]) == want and all(r["params_per_s"] > 0 for r in adam["formats"].values())

    co = p["collectives"]
    assert co["available"] and co["nproc"] == 2 and co["backend"] == "gloo"
    assert sorted((r["op"], r["bytes"]) for r in co["rows"]) == sorted(
        (op, s) for op in ("all_reduce", "all_gather", "reduce_scatter")
        for s in (STEADY_BYTES // 256, STEADY_BYTES // 64, STEADY_BYTES // 16))
    for r in co["rows"]:
        assert r["time_s"] > 0 and r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * (1.0 if r["op"] == "all_reduce" else 0.5))


def test_compute_section_has_each_dtypes_rate_and_the_auto_answer(quick):
    """The compute section: positive matmul GFLOP/s of fp32 and bf16 on the CPU (fp16 too on CUDA) at the
    transformer shapes, what ``auto`` chooses from them with the parameters offloaded and not, and the
    hardware they were measured on."""
    from infinity.precision import choose

    c = quick["profile"]["compute"]
    assert set(c) == {"hardware", "cpu"} | ({"cuda"} if torch.cuda.is_available() else set())
    assert c["hardware"]["cpu"]["model"] and "avx512_bf16" in c["hardware"]["cpu"]
    assert c["hardware"]["torch"] == torch.__version__
    for name, dtypes in (("cpu", {"fp32", "bf16"}), ("cuda", {"fp32", "bf16", "fp16"})):
        if name not in c:
            continue
        dev = c[name]
        assert set(dev["gflops"]) == dtypes and all(g > 0 for g in dev["gflops"].values())
        assert dev["shapes"] == [list(s) for s in COMPUTE_SHAPES] and set(dev["stopped_early"]) < dtypes
        for key, offloaded in (("params_offloaded", True), ("params_not_offloaded", False)):
            want = choose(torch.device(name), COMPUTE_SHAPES, params_offloaded=offloaded, rates=dev)
            assert dev["auto"][key] == {"param_dtype": want.param_dtype, "compute_dtype": want.compute_dtype,
                                        "reason": want.reason}
    cpu = c["cpu"]
    fast = max(cpu["gflops"], key=cpu["gflops"].get)
    assert cpu_compute_dtype(c) == fast == cpu["auto"]["params_not_offloaded"]["compute_dtype"]


def _modeled_step_s(a: torch.Tensor, w: torch.Tensor, fp32_gflops: float, bf16_gflops: float) -> float:
    """A linear layer's three matmuls on a CPU whose bf16 is emulated (compute-bound at ``bf16_gflops``) and
    whose fp32 runs at ``fp32_gflops`` but, for a weight past its 4 MiB of cache, first reads it from
    memory at 2 GB/s each matmul (what makes a few rows' fp32 steps slow)."""
    flops = 3 * 2.0 * a.shape[0] * w.shape[0] * w.shape[1]
    if a.dtype == torch.bfloat16:
        return flops / (bf16_gflops * 1e9)
    weight_bytes = 4 * w.numel()
    return (3 * weight_bytes / 2e9 if weight_bytes > 4 * MiB else 0.0) + flops / (fp32_gflops * 1e9)


@pytest.mark.parametrize("fp32_gflops, bf16_gflops", [
    (100.0, 2.0),    # emulated bf16 under 4x slower than fp32 at 8 rows of a 2048 x 2048 weight
    (100.0, 0.05),   # a bf16 far slower still
    (3.0, 1.0),      # a slow CPU: bf16 3x slower, both slow; its full-size rounds would take a minute
], ids=["bf16-close-at-8-rows", "bf16-very-slow", "slow-cpu"])
def test_a_far_slower_dtype_is_stopped_before_its_full_size_probe(monkeypatch, fp32_gflops, bf16_gflops):
    """The compute section on a CPU whose bf16 is emulated (its matmul steps stubbed with modeled times):
    bf16 is only ever timed at the first look's small weight, never at the full shapes, however its rate
    at measure_rates' own 8-row first pass compares; its figure is the first look's, marked stopped early;
    ``auto`` computes in fp32 and keeps offloaded parameters in bf16."""
    from infinity import precision

    bf16_steps = []

    def modeled(a, w):
        if a.dtype == torch.bfloat16:
            bf16_steps.append((a.shape[0], tuple(w.shape)))
        return _modeled_step_s(a, w, fp32_gflops, bf16_gflops)

    monkeypatch.setattr(precision, "_time_step", modeled)
    c = measure_compute(quick=True)
    cpu = c["cpu"]
    assert {shape for _, shape in bf16_steps} == {precision.SCREEN_SHAPE}   # never a full-size bf16 step
    assert max(rows for rows, _ in bf16_steps) == precision.SCREEN_ROWS
    assert cpu["stopped_early"] == ["bf16"] and cpu["gflops"]["bf16"] == pytest.approx(bf16_gflops)
    assert cpu["gflops"]["bf16"] == cpu["screen"]["gflops"]["bf16"] and cpu["gflops"]["fp32"] > 0
    off = cpu["auto"]["params_offloaded"]
    assert (off["param_dtype"], off["compute_dtype"]) == ("bf16", "fp32")
    assert cpu["auto"]["params_not_offloaded"]["param_dtype"] == "fp32" == cpu_compute_dtype(c)


def test_contention_probe_is_sized_from_the_rate_in_the_dtype_given():
    """The contention probe computes in the dtype it is given, its rows sized so one pass takes about
    CONTENTION_PROBE_S at the measured rate: fewer rows on a slower CPU, within 16 and 2048."""
    probe, text = prof_contention._contention_probe("fp32", 50.0)
    assert text.startswith("fp32 (") and prof_contention._contention_rows(50.0, 2048) == 176   # 0.25 s of 67 MFLOP rows
    assert prof_contention._contention_rows(1.0, 2048) == 16 and prof_contention._contention_rows(1e6, 2048) == 2048
    _, text = prof_contention._contention_probe("bf16", 1e6)
    assert text.startswith("bf16 (2048 x 2048)")


def test_profiles_without_a_compute_section_still_load(quick, tmp_path):
    """A profile written before the compute section (or without it) gives the planner the same rates."""
    from infinity.plan.rates import Rates, load_profile

    old = {k: v for k, v in quick["profile"].items() if k != "compute"}
    (tmp_path / PROFILE_JSON).write_text(json.dumps(old))
    assert load_profile(tmp_path) == Rates.from_profile(quick["profile"], source=str(tmp_path / PROFILE_JSON))


def test_io_section_is_the_best_row_and_loads_as_config(quick):
    p = quick["profile"]
    io = p["io"]
    best = max(p["nvme"]["sweep"], key=lambda r: min(r["read_gbps"], r["write_gbps"]))
    default = next(r for r in p["nvme"]["sweep"] if (r["block_bytes"], r["threads"], r["queue_depth"]) == (8 * MiB, 4, 8))
    if min(best["read_gbps"], best["write_gbps"]) < 1.1 * min(default["read_gbps"], default["write_gbps"]):
        best = default
    assert io == {"block_bytes": best["block_bytes"], "queue_depth": best["queue_depth"],
                  "threads": best["threads"], "direct": p["nvme"]["mode"] == "direct", "checksum": True}
    loaded = infinity.Config.from_dict({"io": io}).io
    assert {k: getattr(loaded, k) for k in io} == io


def test_files_written_and_scratch_removed(quick):
    on_disk = json.loads((quick["out"] / PROFILE_JSON).read_text())
    assert on_disk == quick["profile"]
    png = (quick["out"] / PROFILE_PLOT).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert list(quick["swap"].iterdir()) == []  # sweep files and scratch directory are gone


def test_best_io_takes_highest_min_of_read_and_write():
    rows = [
        {"block_bytes": MiB, "queue_depth": 1, "threads": 1, "read_gbps": 9.0, "write_gbps": 0.5},
        {"block_bytes": 4 * MiB, "queue_depth": 2, "threads": 2, "read_gbps": 2.0, "write_gbps": 1.5},
        {"block_bytes": 8 * MiB, "queue_depth": 4, "threads": 4, "read_gbps": 1.0, "write_gbps": 8.0},
    ]
    assert best_io(rows, direct=False) == {"block_bytes": 4 * MiB, "queue_depth": 2, "threads": 2,
                                           "direct": False, "checksum": True}
    with pytest.raises(ValueError, match="no rows"):
        best_io([], direct=True)
    # the config's default settings are kept unless a row beats them by 10%
    default = {"block_bytes": 8 * MiB, "queue_depth": 8, "threads": 4, "read_gbps": 1.9, "write_gbps": 1.85}
    assert best_io(rows + [default], direct=True) == {"block_bytes": 8 * MiB, "queue_depth": 8, "threads": 4,
                                                      "direct": True, "checksum": True}
    default.update(read_gbps=1.3, write_gbps=1.35)   # 1.5 against 1.3: 15% better, the row wins
    assert best_io(rows + [default], direct=True)["block_bytes"] == 4 * MiB


def test_nvme_sweep_buffered_mode(tmp_path):
    nvme = measure_nvme(str(tmp_path), 4 * MiB, quick=True, direct=False)  # 4 MiB blocks do not fit 4 times
    assert nvme["mode"] == "buffered" and nvme["raw"]["mode"] == "buffered"
    assert [(r["block_bytes"], r["threads"], r["queue_depth"]) for r in nvme["sweep"]] == [
        (MiB, 1, 1), (MiB, 2, 1), (MiB, 2, 2)]
    assert all(r["read_gbps"] > 0 and r["write_gbps"] > 0 for r in nvme["sweep"])
    assert list(tmp_path.iterdir()) == []


def test_sizes_below_steady_state_are_marked_as_lower_bounds():
    """A small --bytes is measured as asked but flagged: set-up cost and caches dominate such points."""
    assert ProfileOptions(quick=True).base_bytes == STEADY_BYTES and not ProfileOptions(quick=True).lower_bound
    assert not ProfileOptions().lower_bound
    assert ProfileOptions(quick=True, size_bytes=64 * MiB).lower_bound


def test_single_rank_has_no_collectives(tmp_path):
    assert measure_collectives(1, [MiB], 1, str(tmp_path)) == {
        "available": False, "nproc": 1, "reason": "single rank: no collectives"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_host_device_without_cuda_says_why():
    assert measure_host_device(MiB) == {"available": False,
                                        "reason": "no CUDA device: torch.cuda.is_available() is False"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_device_cuda_measures_pinned_and_pageable():
    hd = measure_host_device(16 * MiB, repeats=2)
    assert hd["available"] and hd["bytes"] == 16 * MiB
    assert all(hd[f"{d}_{k}_gbps"] > 0 for d in ("h2d", "d2h") for k in ("pinned", "pageable"))


@pytest.mark.parametrize("argv, names", [
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "two"], "--nproc"),
    (["--bytes", "lots"], "--bytes"),
    (["--bytes", "8MiB"], "--bytes"),
    (["--dir", "{tmp}/missing"], "--dir"),
    (["--dir", "{tmp}/afile"], "--dir"),
    (["--out", "{tmp}/afile/sub"], "--out"),
    (["--out", "{tmp}/afile"], "--out"),
    (["--frobnicate"], "--frobnicate"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, tmp_path, argv, names):
    (tmp_path / "afile").write_text("a regular file")
    argv = [a.format(tmp=tmp_path) for a in argv]
    code = main(["profile", "--quick", "--out", str(tmp_path / "out"), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and names in err, err
    # rejected before measuring: no output directory made, no scratch files left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_failing_disk_in_the_contention_probe_names_the_directory(tmp_path, monkeypatch):
    """An I/O error while the contention probe streams (a full disk) ends the profile with a one-line
    ProfileError naming the directory and the probe, not a traceback (the cheap sections are faked)."""
    import errno

    monkeypatch.setattr(prof, "measure_memcpy", lambda *a, **k: {})
    fp32 = {"param_dtype": "fp32", "compute_dtype": "fp32"}
    monkeypatch.setattr(prof, "measure_compute", lambda *a, **k: {
        "hardware": {"cpu": {"model": "x", "torch_cpu_capability": "x", "threads": 1}},
        "cpu": {"gflops": {"fp32": 1.0}, "stopped_early": [],
                "auto": {"params_offloaded": fp32, "params_not_offloaded": fp32}}})
    monkeypatch.setattr(prof, "measure_host_device", lambda *a, **k: {})
    row = {"block_bytes": MiB, "queue_depth": 1, "threads": 1, "read_gbps": 1.0, "write_gbps": 1.0}
    monkeypatch.setattr(prof, "measure_nvme", lambda *a, **k: {"sweep": [row]})

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(prof, "measure_io_contention", full)
    with pytest.raises(prof.ProfileError, match=r"--dir .*the contention probe's I/O failed: .*No space left"):
        prof.run_profile(prof.ProfileOptions(quick=True, directory=str(tmp_path), nproc=1))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".infinity-profile-")]   # scratch removed
