"""What the tensor store costs on top of the layers under it, measured in the same run.

    python tools/bench_store.py [--bytes 512MiB] [--tensor-bytes 16MiB] [--dir DIR] [--json]

- nvme_to_host_gbps: ``store.bring(key, "host")`` for every key, all issued at once, then
  waited; BASELINE raw_read_gbps: the same tensors read with a bare ``ExtentFile`` on the same
  engine settings and directory into preallocated aligned buffers, all submitted at once.
- host_to_device_gbps: ``store.bring(key, "device")`` from resident host copies (on CPU the
  device tier is plain memory); BASELINE memcpy_gbps: ``dst.copy_(src)`` over the same
  tensors in one thread into preallocated tensors.
- cycle_gbps / cycle_evictions: bring every key to a device tier holding a quarter of them,
  twice over (NVMe-homed, host tier holding half): the over-subscribed path end to end.
Reads use O_DIRECT where the file system takes it, so the page cache does not flatter them.
The machine (``infinity.precision.hardware_record``) is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from hardware_note import line as hardware_line  # noqa: E402
from infinity.config import IOConfig, TiersConfig, parse_size  # noqa: E402
from infinity.io import ExtentFile, IOEngine, aligned_empty  # noqa: E402
from infinity.precision import hardware_record  # noqa: E402
from infinity.store import TensorStore, Tier  # noqa: E402


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def raw_read(directory: str, tensors: list[torch.Tensor], io: IOConfig) -> float:
    with IOEngine(io) as engine, ExtentFile(directory, engine, direct=io.direct, checksum=io.checksum) as f:
        for i, t in enumerate(tensors):
            f.write(f"k{i}", t).result()
        dsts = [aligned_empty(t.numel()) for t in tensors]
        t0 = time.perf_counter()
        for fut in [f.read(f"k{i}", d) for i, d in enumerate(dsts)]:
            fut.result()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", default="512MiB")
    ap.add_argument("--tensor-bytes", default="16MiB")
    ap.add_argument("--dir", default=None, help="swap directory (default: a temp dir under /work)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    total, each = parse_size(args.bytes, "--bytes"), parse_size(args.tensor_bytes, "--tensor-bytes")
    n = max(4, total // each)
    total = n * each
    io = IOConfig()
    tensors = [torch.randint(0, 255, (each,), dtype=torch.uint8) for _ in range(n)]
    out = {"bytes": total, "tensor_bytes": each, "tensors": n, "hardware": hardware_record("cpu")}

    with tempfile.TemporaryDirectory(dir=args.dir or "/work") as d:
        out["raw_read_gbps"] = gbps(total, raw_read(d, tensors, io))
        tiers = TiersConfig(device_bytes=total, host_bytes=total)
        with TensorStore(tiers, io, swap_dir=d) as store:
            for i, t in enumerate(tensors):
                store.register(f"k{i}", t).result()
                store.evict(f"k{i}", Tier.HOST).result()     # clean: dropped, key now on NVMe only
            out["io_mode"] = store.stats()["io"]["mode"]
            t0 = time.perf_counter()
            for fut in [store.bring(f"k{i}", Tier.HOST) for i in range(n)]:
                fut.result()
            out["nvme_to_host_gbps"] = gbps(total, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for fut in [store.bring(f"k{i}", Tier.DEVICE) for i in range(n)]:
                fut.result()
            out["host_to_device_gbps"] = gbps(total, time.perf_counter() - t0)
            srcs = [store.get(f"k{i}", Tier.HOST) for i in range(n)]
            dsts = [torch.empty_like(s) for s in srcs]
            t0 = time.perf_counter()
            for s, dst in zip(srcs, dsts):
                dst.copy_(s)
            out["memcpy_gbps"] = gbps(total, time.perf_counter() - t0)
            del srcs, dsts

        tiers = TiersConfig(device_bytes=total // 4, host_bytes=total // 2)
        with TensorStore(tiers, io, swap_dir=d) as store:
            for i, t in enumerate(tensors):
                store.register(f"k{i}", t).result()
            t0 = time.perf_counter()
            for _ in range(2):
                for i in range(n):
                    store.bring(f"k{i}", Tier.DEVICE).result()
            out["cycle_gbps"] = gbps(2 * total, time.perf_counter() - t0)
            st = store.stats()
            out["cycle_evictions"] = st["evictions"]
            out["cycle_peak_bytes"] = st["peak_bytes"]
            out["cycle_budget_bytes"] = st["budget_bytes"]

    out["read_ratio"] = out["nvme_to_host_gbps"] / out["raw_read_gbps"]
    out["copy_ratio"] = out["host_to_device_gbps"] / out["memcpy_gbps"]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(hardware_line(out["hardware"]))
        print(f"NVMe->host  store {out['nvme_to_host_gbps']:.2f} GB/s   raw ExtentFile {out['raw_read_gbps']:.2f} GB/s"
              f"   ratio {out['read_ratio']:.2f}  ({out['io_mode']})")
        print(f"host->device store {out['host_to_device_gbps']:.2f} GB/s   memcpy {out['memcpy_gbps']:.2f} GB/s"
              f"   ratio {out['copy_ratio']:.2f}")
        print(f"over-subscribed cycle {out['cycle_gbps']:.2f} GB/s, evictions {out['cycle_evictions']}")


if __name__ == "__main__":
    main()
