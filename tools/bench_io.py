"""Bandwidth of the swap engine next to raw O_DIRECT I/O on the same file system, same run.

    python tools/bench_io.py --bytes 2GiB --json [--dir DIR] [--runs 3]

Measures, on one directory (default: a fresh temp dir under /work):
- raw_write_gbps / raw_read_gbps: THE BASELINE - one thread, sequential os.pwritev/os.preadv
  of block_bytes with O_DIRECT over a preallocated file (fdatasync included in writes);
- raw_*_gbps_threads: the same loop over the engine's thread count (blocks dealt round-robin);
- write_gbps / read_gbps: ExtentFile + IOEngine with the given knobs, checksum on (the default),
  tensors of --tensor-bytes each, all submitted at once; *_nocrc_gbps: the same, checksum off;
- crc32_gbps: zlib.crc32 alone on one core over an in-memory buffer;
- aiofiles_read_gbps: aiofiles (buffered, it has no O_DIRECT) reading the raw file in
  block_bytes chunks; null when aiofiles is not installed.
Reads are cold: page cache dropped (as root) before each read pass; "cold_cache" says if not.
With --runs N every figure is the median over N runs (all values under "runs"). The machine
(``infinity.precision.hardware_record``: the CPU runs the checksums and the copies) is recorded beside them.

With ``--mixed 0,64MiB,...`` each run also times reads and writes at once, as the optimizer step
moves them (read tensor i while writing a new one, at most ``--window`` of each kind in flight, the
pipeline's lookahead), once per ``io.phase_bytes`` listed (0: today's mixed queue; > 0: phased):
``mixed_gbps[phase]`` is bytes read + written over the wall time, beside two bounds from the
same run's engine alone rates: ``phased_bound_gbps`` (the reads alone, then the writes alone) and
the ratio of each to the mixed queue (``phased_speedup[phase]``: > 1 means phases are faster).

    python tools/bench_io.py --bytes 2GiB --mixed 0,64MiB,256MiB,1GiB --runs 3 --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from hardware_note import line as hardware_line  # noqa: E402
from infinity.config import IOConfig, parse_size  # noqa: E402
from infinity.io import ExtentFile, IOEngine, aligned_empty, probe_direct_io  # noqa: E402
from infinity.io.buffers import tensor_bytes_view  # noqa: E402
from infinity.io.syscalls import O_DIRECT  # noqa: E402
from infinity.precision import hardware_record  # noqa: E402

try:
    import aiofiles
except ImportError:  # the bench reports null rather than failing
    aiofiles = None


def drop_caches() -> bool:
    """Empty the page cache so reads come from the disk. Needs root; False when not possible."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fs_type(path: str) -> str:
    best, kind = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def raw_pass(path: str, total_bytes: int, block_bytes: int, threads: int, write: bool,
             memory: list) -> float:
    """GB/s of a plain O_DIRECT pread/pwrite loop; ``threads`` workers take every threads-th block.

    Block b moves from/to the same host memory the engine pass uses for those bytes
    (``memory``: the aligned tensors, in file order), so both pay the same memory traffic.
    """
    flags = os.O_RDWR | (O_DIRECT if O_DIRECT else 0)
    fd = os.open(path, flags)
    blocks = total_bytes // block_bytes
    views = [tensor_bytes_view(t) for t in memory]
    tensor_bytes = memory[0].numel()

    def loop(t: int) -> None:
        for b in range(t, blocks, threads):
            start = b * block_bytes
            mem = views[(start // tensor_bytes) % len(views)]
            view = mem[start % tensor_bytes:start % tensor_bytes + block_bytes]
            done = 0
            while done < block_bytes:
                part = view[done:]
                n = os.pwritev(fd, [part], b * block_bytes + done) if write else os.preadv(fd, [part], b * block_bytes + done)
                done += n

    try:
        t0 = time.perf_counter()
        workers = [threading.Thread(target=loop, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if write:
            os.fdatasync(fd)
        return blocks * block_bytes / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def engine_pass(directory: str, total_bytes: int, tensor_bytes: int, io: IOConfig, checksum: bool,
                src: torch.Tensor, dsts: list, cold: list) -> tuple[float, float, dict]:
    """(write GB/s, read GB/s, engine stats) for ExtentFile writing then reading total_bytes."""
    keys = total_bytes // tensor_bytes
    with IOEngine(io) as engine, ExtentFile(directory, engine, direct=io.direct, checksum=checksum,
                                            initial_bytes=total_bytes) as f:
        t0 = time.perf_counter()
        futures = [f.write(f"t{i}", src) for i in range(keys)]
        for fut in futures:
            fut.result()
        f.flush()
        write_gbps = keys * tensor_bytes / (time.perf_counter() - t0) / 1e9
        cold.append(drop_caches())
        t0 = time.perf_counter()
        futures = [f.read(f"t{i}", dsts[i]) for i in range(keys)]
        for fut in futures:
            fut.result()
        read_gbps = keys * tensor_bytes / (time.perf_counter() - t0) / 1e9
        if not torch.equal(dsts[0], src) or not torch.equal(dsts[-1], src):
            raise AssertionError("bench read back different bytes than it wrote")
        return write_gbps, read_gbps, engine.stats()


def mixed_pass(directory: str, total_bytes: int, tensor_bytes: int, io: IOConfig, window: int,
               src: torch.Tensor, dsts: list, cold: list) -> tuple[float, dict]:
    """(GB/s read + written, engine stats): total_bytes written first, then read back tensor by tensor
    while as many new bytes are written, read i and write i submitted together, at most ``window``
    pairs in flight (``io.phase_bytes`` decides how the engine orders them)."""
    keys = total_bytes // tensor_bytes
    with IOEngine(io) as engine, ExtentFile(directory, engine, direct=io.direct, checksum=True,
                                            initial_bytes=2 * total_bytes) as f:
        for fut in [f.write(f"t{i}", src) for i in range(keys)]:
            fut.result()
        f.flush()
        cold.append(drop_caches())
        t0 = time.perf_counter()
        pending = []
        for i in range(keys):
            if len(pending) == window:
                for fut in pending.pop(0):
                    fut.result()
            pending.append((f.read(f"t{i}", dsts[i]), f.write(f"n{i}", src)))
        for pair in pending:
            for fut in pair:
                fut.result()
        f.flush()
        gbps = 2 * keys * tensor_bytes / (time.perf_counter() - t0) / 1e9
        if not torch.equal(dsts[0], src) or not torch.equal(dsts[-1], src):
            raise AssertionError("bench read back different bytes than it wrote")
        return gbps, engine.stats()


def aiofiles_read(path: str, total_bytes: int, block_bytes: int) -> float | None:
    if aiofiles is None:
        return None

    async def run() -> int:
        got = 0
        async with aiofiles.open(path, "rb", buffering=0) as f:
            while got < total_bytes:
                chunk = await f.read(block_bytes)
                if not chunk:
                    break
                got += len(chunk)
        return got

    t0 = time.perf_counter()
    got = asyncio.run(run())
    return got / (time.perf_counter() - t0) / 1e9


def crc_gbps(buf: torch.Tensor) -> float:
    view = tensor_bytes_view(buf)
    t0 = time.perf_counter()
    zlib.crc32(view)
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def one_run(directory: str, args, io: IOConfig, src, dsts) -> dict:
    total = args.bytes
    raw_path = os.path.join(directory, "raw.bin")

    def fresh_raw_file() -> None:
        # Every write pass, raw or engine, goes to newly fallocated space: overwriting
        # written blocks skips ext4's unwritten-extent conversion and would flatter raw.
        fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(fd, 0, total)
        os.close(fd)

    cold = []
    out = {}
    try:
        fresh_raw_file()
        out["raw_write_gbps"] = raw_pass(raw_path, total, io.block_bytes, 1, True, [src])
        cold.append(drop_caches())
        out["raw_read_gbps"] = raw_pass(raw_path, total, io.block_bytes, 1, False, dsts)
        fresh_raw_file()
        out["raw_write_gbps_threads"] = raw_pass(raw_path, total, io.block_bytes, io.threads, True, [src])
        cold.append(drop_caches())
        out["raw_read_gbps_threads"] = raw_pass(raw_path, total, io.block_bytes, io.threads, False, dsts)
        cold.append(drop_caches())
        out["aiofiles_read_gbps"] = aiofiles_read(raw_path, total, io.block_bytes)
    finally:
        if os.path.exists(raw_path):
            os.unlink(raw_path)
    w, r, stats = engine_pass(directory, total, args.tensor_bytes, io, True, src, dsts, cold)
    out.update(write_gbps=w, read_gbps=r, engine_checksum_s=stats["checksum_s"], engine_busy_s=stats["busy_s"])
    w, r, _ = engine_pass(directory, total, args.tensor_bytes, io, False, src, dsts, cold)
    out.update(write_nocrc_gbps=w, read_nocrc_gbps=r)
    out["crc32_gbps"] = crc_gbps(src)
    for phase in args.mixed:
        mixed_io = dataclasses.replace(io, phase_bytes=phase)
        gbps, stats = mixed_pass(directory, total, args.tensor_bytes, mixed_io, args.window, src, dsts, cold)
        out[f"mixed_gbps_{phase}"] = gbps
        out[f"phase_switches_{phase}"] = stats["phase_switches"]
    if args.mixed:   # the reads alone, then the writes alone, at this run's engine rates
        out["phased_bound_gbps"] = 2 / (1 / out["read_gbps"] + 1 / out["write_gbps"])
    out["cold_cache"] = all(cold)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", default="2GiB", help="bytes moved per pass (default 2GiB)")
    p.add_argument("--tensor-bytes", default="256MiB", help="size of each tensor the engine moves")
    p.add_argument("--dir", default=None, help="parent directory for the bench files (default /work)")
    p.add_argument("--block-bytes", default=None, help="io.block_bytes (default: IOConfig default)")
    p.add_argument("--threads", type=int, default=None, help="io.threads (default: IOConfig default)")
    p.add_argument("--queue-depth", type=int, default=None, help="io.queue_depth (default: IOConfig default)")
    p.add_argument("--direct", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--runs", type=int, default=1, help="repeat and report medians")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--mixed", default="", help="comma-separated io.phase_bytes values (0 = mixed queue) to time "
                   "reads and writes at once with (see the module doc); default: not timed")
    p.add_argument("--window", type=int, default=2, help="read+write pairs in flight in the --mixed passes")
    args = p.parse_args(argv)
    args.mixed = [parse_size(v.strip(), "--mixed") for v in args.mixed.split(",") if v.strip()]
    if args.mixed and 0 not in args.mixed:
        args.mixed.insert(0, 0)   # the mixed queue is the baseline every phased pass is held against

    defaults = IOConfig()
    block = parse_size(args.block_bytes, "--block-bytes") if args.block_bytes else defaults.block_bytes
    direct = {"auto": "auto", "true": True, "false": False}[args.direct]
    io = IOConfig(block_bytes=block, threads=args.threads or defaults.threads,
                  queue_depth=args.queue_depth or defaults.queue_depth, direct=direct, checksum=True)
    args.bytes = parse_size(args.bytes, "--bytes") // io.block_bytes * io.block_bytes
    args.tensor_bytes = min(parse_size(args.tensor_bytes, "--tensor-bytes"), args.bytes)
    args.bytes = args.bytes // args.tensor_bytes * args.tensor_bytes
    if args.tensor_bytes % io.block_bytes:
        p.error("--tensor-bytes must be a multiple of the block size")

    parent = os.path.abspath(args.dir or ("/work" if os.path.isdir("/work") else tempfile.gettempdir()))
    directory = tempfile.mkdtemp(prefix="bench_io-", dir=parent)
    torch.manual_seed(0)
    src = aligned_empty(args.tensor_bytes)
    src.copy_(torch.randint(0, 256, (args.tensor_bytes,), dtype=torch.uint8))
    dsts = [aligned_empty(args.tensor_bytes).zero_() for _ in range(args.bytes // args.tensor_bytes)]
    try:
        mode = "direct" if (direct is True or (direct == "auto" and probe_direct_io(directory))) else "buffered"
        runs = [one_run(directory, args, io, src, dsts) for _ in range(max(1, args.runs))]
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)

    def med(key):
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    keys = [k for k in runs[0] if k != "cold_cache"]
    result = {
        "bytes": args.bytes, "tensor_bytes": args.tensor_bytes, "dir": parent, "fs_type": fs_type(parent),
        "mode": mode, "block_bytes": io.block_bytes, "threads": io.threads, "queue_depth": io.queue_depth,
        "hardware": hardware_record("cpu"),
        "baseline": "raw_*_gbps: one thread, sequential O_DIRECT preadv/pwritev of block_bytes, same file "
                    "system, same run; raw_*_gbps_threads: the same at the engine's thread count",
        **{k: med(k) for k in keys},
        "cold_cache": all(r["cold_cache"] for r in runs),
    }
    if not result["cold_cache"]:
        result["cold_cache_note"] = "could not write /proc/sys/vm/drop_caches (not root?): reads may be cached"
    result["read_ratio"] = result["read_gbps"] / result["raw_read_gbps"]
    result["write_ratio"] = result["write_gbps"] / result["raw_write_gbps"]
    result["read_ratio_vs_threads"] = result["read_gbps"] / result["raw_read_gbps_threads"]
    result["write_ratio_vs_threads"] = result["write_gbps"] / result["raw_write_gbps_threads"]
    result["checksum_cost_read"] = 1 - result["read_gbps"] / result["read_nocrc_gbps"]
    result["checksum_cost_write"] = 1 - result["write_gbps"] / result["write_nocrc_gbps"]
    for phase in args.mixed:
        result[f"phased_speedup_{phase}"] = result[f"mixed_gbps_{phase}"] / result["mixed_gbps_0"]
    result["runs"] = runs
    if args.json:
        print(json.dumps(result, indent=None))
    else:
        print(hardware_line(result["hardware"]))
        for k, v in result.items():
            if k not in ("runs", "hardware"):
                print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
