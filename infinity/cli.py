"""The ``infinity`` program: argument handling and output, no logic of its own.

Each sub-command is one ``_add_<name>(subparsers)`` that registers its
arguments and a ``_run_<name>(args) -> int`` that calls into the library and
prints. ``main`` returns the exit code; bad arguments or inputs print one line
on stderr and return 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

__all__ = ["main"]


class UsageError(Exception):
    """Bad command-line input: reported as one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and calls sys.exit; we want one line and a return code
    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")


# ---------------------------------------------------------------- estimate

def _add_estimate(sub) -> None:
    p = sub.add_parser(
        "estimate", help="model-state memory per tier and communication per step, for each ZeRO stage",
        description="Model-state bytes per rank (device, host, NVMe) and collective volume per step for DDP, "
                    "ZeRO-1/2/3 and ZeRO-Infinity with host or NVMe offload (see infinity/estimate.py).")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", metavar="N", help="parameter count, e.g. 7B, 125M, 1.5e9")
    size.add_argument("--model", metavar="NAME", help="a built-in GPT (tiny, 125m, 350m, 1b, 3b), counted on meta")
    p.add_argument("--devices", type=int, default=1, metavar="N", help="data-parallel ranks (default 1)")
    p.add_argument("--precision", choices=("mixed", "fp32"), default=None,
                   help="state bytes per param: mixed = 2+2+12, fp32 = 4+4+8 "
                        "(default: from --config's precision.param_dtype, else mixed)")
    p.add_argument("--config", metavar="FILE", help="also estimate this config's stage, offload and dtypes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_estimate)


def _run_estimate(args) -> int:
    from infinity.config import Config
    from infinity.estimate import count_params, estimate_all, estimate_config, parse_param_count

    if args.devices < 1:
        raise UsageError(f"--devices must be >= 1, got {args.devices}")
    if args.model is not None:
        from infinity.models import GPT, gpt_config
        try:
            model_cfg = gpt_config(args.model)
        except ValueError as e:
            raise UsageError(f"--model: {e}") from None
        num_params = count_params(lambda: GPT(model_cfg))
    else:
        try:
            num_params = parse_param_count(args.params)
        except ValueError as e:
            raise UsageError(f"--params: {e}") from None
    config = Config.from_file(args.config) if args.config else None
    precision = args.precision
    if precision is None:
        precision = "fp32" if config is not None and config.precision.param_dtype == "fp32" else "mixed"

    rows = estimate_all(num_params, args.devices, precision)
    if config is not None:
        rows.append(estimate_config(config, num_params, args.devices))
    if args.json:
        out = {"num_params": num_params, "world_size": args.devices, "precision": precision,
               "model": args.model, "config": args.config, "estimates": [e.to_dict() for e in rows]}
        print(json.dumps(out, indent=2))
        return 0

    what = f"{args.model} ({num_params:,} params)" if args.model else f"{num_params:,} params"
    print(f"{what}, {args.devices} device(s), {precision} precision; model states per rank (GB = 1e9 bytes)")
    header = ("strategy", "stage", "device", "host", "nvme", "comm/step", "comm bytes")
    table = [header]
    for e in rows:
        m, c = e.memory, e.comm
        name = f"config ({args.config})" if e.placement.name == "config" else e.placement.name
        table.append((name, str(e.placement.stage), _size(m.device_bytes), _size(m.host_bytes), _size(m.nvme_bytes),
                      f"{c.total_numel / num_params:g} x params", _size(c.total_bytes)))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("not counted: activations, gathered stage-3 working set, buffers; host/nvme are per rank")
    return 0


def _size(n_bytes: int) -> str:
    """Decimal units, as the ZeRO paper quotes them: 112 GB = 112e9 bytes."""
    if n_bytes == 0:
        return "0"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes} B"


# ---------------------------------------------------------------- profile

def _add_profile(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure this machine: memcpy, host<->device, NVMe sweep, CPU Adam, collectives",
        description="Bandwidth profile of this machine (see infinity/profile.py). Writes profile.json, whose "
                    "'io' section is the best NVMe sweep row as a config io section, and profile_nvme.png.")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer sweep points (under a minute)")
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
                        "(default 64MiB with --quick, 1GiB otherwise; at least 16MiB)")
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
    print(f"machine      {m['cores_available']} cores, {_size(m['ram_bytes'])} RAM; {m['dir']} is "
          f"{m['fs_type']}, {m['direct_io']} I/O")
    print(f"memcpy       {mc['gbps']:.2f} GB/s ({mc['threads']} threads), {mc['single_thread_gbps']:.2f} GB/s "
          f"(1 thread), {_size(mc['bytes'])} buffer")
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
            print(f"  {r['op']:15s} {_size(r['bytes']):>10s}  {r['algbw_gbps']:7.3f} / {r['busbw_gbps']:7.3f}")
    else:
        print(f"collectives  {co['reason']}")
    print(f"nvme         {nv['mode']} I/O, {_size(nv['bytes_per_point'])} per point; write / read GB/s, "
          f"engine (raw {nv['raw']['mode']} loop)")
    for r in nv["sweep"]:
        print(f"  block {r['block_bytes'] // 2**20:3d} MiB  threads {r['threads']}  depth {r['queue_depth']}  "
              f"write {r['write_gbps']:6.3f} ({r['raw_write_gbps']:6.3f})  "
              f"read {r['read_gbps']:6.3f} ({r['raw_read_gbps']:6.3f})")
    print(f"best io      {json.dumps(profile['io'])}")
    print(f"wrote        {paths['json']}, {paths['plot']}")


# ---------------------------------------------------------------- program

def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="infinity", description="Train models whose training state is larger than device memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    # Each sub-command registers itself here: train, plan and consolidate join as they are built.
    _add_estimate(sub)
    _add_profile(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from infinity.config import ConfigError

    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:          # --help exits through argparse
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except (UsageError, ConfigError) as e:
        # only input errors become one line; anything else is a bug and keeps its traceback
        print(f"infinity {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
