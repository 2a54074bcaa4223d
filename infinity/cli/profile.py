"""``infinity profile``: measure this machine (:mod:`infinity.profile`), write its files, print the
figures."""

from __future__ import annotations

import json
import sys

from infinity.cli.sizes import decimal_size
from infinity.cli.usage import UsageError

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    """Register ``infinity profile`` and its arguments on ``sub``, the program's sub-command parsers."""
    p = sub.add_parser(
        "profile", help="measure this machine: memcpy, host<->device, NVMe sweep, CPU Adam, collectives",
        description="Bandwidth profile of this machine (see infinity/profile/). Writes profile.json, whose "
                    "'io' section is the best NVMe sweep row as a config io section, and profile_nvme.png.")
    p.add_argument("--quick", action="store_true", help="fewer sweep points and repeats, at sizes where set-up cost vanishes (about a minute)")
    p.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    p.add_argument("--out", default="infinity-profile", metavar="DIR",
                   help="where profile.json and profile_nvme.png go (default ./infinity-profile, made if missing)")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="directory on the disk to sweep (default: the current directory); a scratch "
                        "subdirectory is made there and removed afterwards")
    p.add_argument("--nproc", type=int, default=2, metavar="N",
                   help="local gloo ranks for the collectives (default 2; 1 skips them)")
    p.add_argument("--bytes", default=None, metavar="SIZE",
                   help="memcpy buffer and Adam state size; each NVMe point moves a quarter of it "
                        "(default 512MiB with --quick, 1GiB otherwise; at least 16MiB; below 512MiB "
                        "the figures are marked as lower bounds)")
    p.set_defaults(run=_run_profile)


def _run_profile(args) -> int:
    import os
    from pathlib import Path

    from infinity.config import parse_size
    from infinity.profile import ProfileError, ProfileOptions, run_profile, write_profile

    size_bytes = parse_size(args.bytes, "--bytes") if args.bytes is not None else None
    try:
        options = ProfileOptions(quick=args.quick, nproc=args.nproc, directory=args.dir, size_bytes=size_bytes)
    except ProfileError as e:
        raise UsageError(str(e)) from None
    out = Path(args.out)
    try:  # before measuring: a bad --out should not cost a minute of profiling first
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create the directory ({e.strerror})") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {out}: directory is not writable")
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    try:
        profile = run_profile(options, progress)
    except ProfileError as e:
        raise UsageError(str(e)) from None
    paths = write_profile(profile, out)
    if args.json:
        print(json.dumps(profile, indent=2))
        return 0
    _print_profile(profile, paths)
    return 0


def _print_profile(profile: dict, paths: dict) -> None:
    m, mc, hd, nv, ad, co = (profile[k] for k in ("machine", "memcpy", "host_device", "nvme", "cpu_adam",
                                                     "collectives"))
    grant = m.get("memory_grant")   # profiles from before the grant was recorded have none
    granted = f" (a cgroup v{grant['version']} memory grant)" if grant else ""
    print(f"machine      {m['cores_available']} cores, {decimal_size(m['ram_bytes'])} RAM{granted}; {m['dir']} is "
          f"{m['fs_type']}, {m['direct_io']} I/O")
    print(f"memcpy       {mc['gbps']:.2f} GB/s ({mc['threads']} threads), {mc['single_thread_gbps']:.2f} GB/s "
          f"(1 thread), {decimal_size(mc['bytes'])} buffer" + (f"; into fresh memory {mc['fresh_gbps']:.2f} GB/s "
                                                         "(its page faults)" if "fresh_gbps" in mc else ""))
    if "compute" in profile:   # profiles from before the compute section have none
        from infinity.profile import describe_compute
        for line in describe_compute(profile["compute"]):
            print(f"compute      {line}")
    if hd["available"]:
        print(f"host-device  pinned h2d {hd['h2d_pinned_gbps']:.2f} / d2h {hd['d2h_pinned_gbps']:.2f} GB/s, "
              f"pageable h2d {hd['h2d_pageable_gbps']:.2f} / d2h {hd['d2h_pageable_gbps']:.2f} GB/s")
    else:
        print(f"host-device  not measured: {hd['reason']}")
    print(f"cpu adam     {ad['gbps']:.2f} GB/s of state, {ad['params_per_s'] / 1e6:.1f} M params/s "
          f"({ad['threads']} threads); torch AdamW(fused) {ad['torch_fused_gbps']:.2f} GB/s; "
          f"ratio {ad['ratio']:.2f}x")
    if co["available"]:
        print(f"collectives  gloo, {co['nproc']} ranks (algbw / busbw GB/s)")
        for r in co["rows"]:
            print(f"  {r['op']:15s} {decimal_size(r['bytes']):>10s}  {r['algbw_gbps']:7.3f} / {r['busbw_gbps']:7.3f}")
    else:
        print(f"collectives  {co['reason']}")
    print(f"nvme         {nv['mode']} I/O, {decimal_size(nv['bytes_per_point'])} per point; write / read GB/s, "
          f"engine (raw {nv['raw']['mode']} loop)")
    for r in nv["sweep"]:
        print(f"  block {r['block_bytes'] // 2**20:3d} MiB  threads {r['threads']}  depth {r['queue_depth']}  "
              f"write {r['write_gbps']:6.3f} ({r['raw_write_gbps']:6.3f})  "
              f"read {r['read_gbps']:6.3f} ({r['raw_read_gbps']:6.3f})")
    mixed = nv.get("mixed")
    if mixed:
        print(f"  at once (best row): write {mixed['write_gbps']:6.3f}  read {mixed['read_gbps']:6.3f}")
    con = profile.get("contention")
    if con:
        print(f"contention   compute beside the disk {con['slowdown']:.2f}x slower ({con['compute_alone_s']:.3f} -> "
              f"{con['compute_beside_io_s']:.3f} s); the I/O's CPU {con['io_cpu_s_per_gb']:.3f} s per GB")
    print(f"best io      {json.dumps(profile['io'])}")
    if profile.get("settings", {}).get("lower_bound"):
        print(f"LOWER BOUND  {profile['settings']['note']}")
    print(f"wrote        {paths['json']}, {paths['plot']}")

