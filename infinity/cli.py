"""The ``infinity`` program: argument handling and output, no logic of its own.

Each sub-command is one ``_add_<name>(subparsers)`` that registers its
arguments and a ``_run_<name>(args) -> int`` that calls into the library and
prints. ``main`` returns the exit code; bad arguments or inputs print one line
on stderr and return 2; a run that fails for a reason outside the program (a
full disk, a corrupt checkpoint or swap file, a rank that hung or died)
prints one line and returns 1. ``--debug`` (before or after the sub-command)
shows the traceback instead; an error of any other kind is a bug and always
keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from pathlib import Path
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
                    "ZeRO-1/2/3 and ZeRO-Infinity with host or NVMe offload (see infinity/estimate/strategies.py).")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", metavar="N", help="parameter count, e.g. 7B, 125M, 1.5e9")
    size.add_argument("--model", metavar="NAME", help="a built-in GPT (tiny, 125m, 350m, 1b, 3b), counted on meta")
    p.add_argument("--devices", type=int, default=1, metavar="N", help="data-parallel ranks (default 1)")
    p.add_argument("--precision", choices=("mixed", "fp32"), default=None,
                   help="state bytes per param: mixed = 2+2+12, fp32 = 4+4+8 "
                        "(default: from --config's precision.param_dtype, else mixed)")
    p.add_argument("--config", metavar="FILE", help="also estimate this config's stage, offload and dtypes")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="also ZeRO x tensor parallelism rows: N tp ways, --devices / N dp ranks (needs --model; "
                        "default: --config's parallel.tensor)")
    p.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="tokens per dp rank per step, for the tp-axis bytes and the activations of the peak-RSS "
                        "bound (default: the model's block size)")
    p.add_argument("--seq", metavar="L[,L...]", default=None,
                   help="also the activations a micro-batch saves at each sequence length (needs --model; the "
                        "model's positions stretched to the longest): held in device memory, and in host memory "
                        "or on NVMe, when kept, recomputed, and recomputed with zero.activation_offload")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="sequences per micro-batch for --seq (default 1)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                   help="ranks on one node, for the ZeRO++ rows' cross-node bytes (default: --config's "
                        "zeropp.ranks_per_node if set, else 8, at most --devices)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_estimate)


def _run_estimate(args) -> int:
    from infinity.config import Config
    from infinity.estimate.strategies import (ZEROPP_ROWS, ZeroPPSwitches, count_params, estimate_all, estimate_config,
                                   format_rows, parse_param_count, zeropp_rows)

    if args.devices < 1:
        raise UsageError(f"--devices must be >= 1, got {args.devices}")
    if args.tokens is not None and args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1 (tokens per dp rank per step), got {args.tokens}")
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
    if config is not None and config.parallel.tensor > 1 and args.tp == 1:
        args.tp = config.parallel.tensor   # the config's tensor parallelism gets its rows too
    precision = args.precision
    if precision is None:
        precision = "fp32" if config is not None and config.precision.param_dtype == "fp32" else "mixed"

    rows = estimate_all(num_params, args.devices, precision)
    if config is not None:
        rows.append(estimate_config(config, num_params, args.devices))
    per_node = args.ranks_per_node
    if per_node is None:
        given = config.zeropp.ranks_per_node if config is not None else "auto"
        per_node = given if given != "auto" else min(8, args.devices)
    if per_node < 1 or args.devices % per_node:
        raise UsageError(f"--ranks-per-node: {per_node} must be >= 1 and divide --devices {args.devices}")
    # with a built-in model and a config: the predicted peak RSS and initialize's minimum tier budgets
    memory = None
    if config is not None and args.model is not None and config.parallel.tensor == 1:
        from infinity.estimate.peak_rss import gpt_bound
        memory = gpt_bound(model_cfg, config, args.devices, args.tokens)
    activations = _activation_rows(args, model_cfg if args.model else None, config) if args.seq is not None else None
    with_config = config is not None and config.zeropp.enabled
    extra = (ZeroPPSwitches.from_config(config.zeropp),) if with_config else ()
    pp_rows = zeropp_rows(num_params, args.devices, per_node, precision, ZEROPP_ROWS + extra)
    if with_config:
        pp_rows[-1]["name"] = f"config ({args.config})"
    if args.json:
        out = {"num_params": num_params, "world_size": args.devices, "precision": precision,
               "model": args.model, "config": args.config, "estimates": [e.to_dict() for e in rows],
               "ranks_per_node": per_node, "zeropp": pp_rows, "stored_formats": format_rows(precision)}
        if memory is not None:
            out["memory"] = {k: v for k, v in memory.items() if k != "lines"}
        if args.tp > 1:
            out["tensor_parallel"] = _tp_rows(args)
        if activations is not None:
            out["activations"] = activations
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
    _print_table(table)
    print("not counted: activations, gathered stage-3 working set, buffers; host/nvme are per rank")
    for e in rows:
        if e.memory.spare_bytes:
            print(f"config: includes {_size(e.memory.spare_bytes)} of spare parameter and optimizer copies "
                  "(optimizer.update_at speculative)")
    if memory is not None:
        print("\n" + "\n".join(memory["lines"]))
    elif config is not None:
        print("(peak-RSS bound and minimum tier budgets: need --model and parallel.tensor 1)")
    if args.tp > 1:
        _print_tp(_tp_rows(args), args)
    if activations is not None:
        _print_activations(activations)
    _print_zeropp(pp_rows, args.devices, per_node)
    _print_formats(format_rows(precision), num_params, args.devices)
    return 0


def _activation_rows(args, model_cfg, config) -> list:
    """``--seq``: the built-in GPT with its positions stretched to each length, counted on the meta device."""
    import dataclasses

    import torch

    from infinity.estimate.activations import activation_rows
    from infinity.models import GPT
    from infinity.zero.units import choose_unit_modules

    if args.model is None:
        raise UsageError("--seq needs --model (the activations are counted by running its forward on meta)")
    try:
        seqs = [int(x) for x in args.seq.split(",")]
    except ValueError:
        raise UsageError(f"--seq: expected lengths separated by commas, e.g. 1024,8192, got {args.seq!r}") from None
    if not seqs or min(seqs) < 1 or args.batch < 1:
        raise UsageError(f"--seq and --batch: expected positive numbers, got --seq {args.seq} --batch {args.batch}")
    dtype = config.precision.param_dtype if config is not None else "bf16"
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(dtype, torch.bfloat16)

    def build(seq):
        with torch.device("meta"):
            model = GPT(dataclasses.replace(model_cfg, block_size=max(seq, model_cfg.block_size))).to(dtype)
        blocks = [m for _, m in choose_unit_modules(model)]

        def forward(m):
            ids = torch.zeros((args.batch, seq), dtype=torch.long, device="meta")
            return m(input_ids=ids, labels=ids).loss
        return model, blocks, forward
    prefetch = config.prefetch.bytes if config is not None else 256 * 2**20
    return activation_rows(build, seqs, args.batch, prefetch)


def _print_activations(rows: list) -> None:
    """The ``--seq`` table: bytes each choice holds in device memory (and in its tier), per sequence length."""
    from infinity.estimate.activations import OFFLOAD_MODES

    batch = rows[0]["batch"]
    print(f"\nActivations saved for backward, one micro-batch of {batch} sequence(s) per rank, held at once: "
          "device memory (+ host memory + NVMe)")
    table = [("seq",) + tuple(label for label, _, _ in OFFLOAD_MODES)]
    for r in rows:
        cells = []
        for label, _, off in OFFLOAD_MODES:
            m = r["modes"][label]
            cells.append(" + ".join([_size(m["device_bytes"])] + [f"{_size(m[k + '_bytes'])} {k}"
                                                                  for k in ("host", "nvme") if m[k + "_bytes"]]))
        table.append((str(r["seq"]), *cells))
    _print_table(table)
    print("recompute: each unit keeps only its input, one more forward per unit in backward; + host / nvme: "
          "zero.activation_offload (device memory: the saves outside the units and two units' inputs; host memory "
          "for nvme: what backward brings ahead, within prefetch.bytes)")


def _print_formats(rows: list, num_params: int, devices: int) -> None:
    """Bytes per parameter per tier for each stored format (optimizer.master x optimizer.moments)."""
    print("\nStored formats (optimizer.master / optimizer.moments), ZeRO-Infinity on NVMe: bytes per parameter "
          "per tier, and the optimizer's disk bytes per step")
    table = [("master", "moments", "device", "host", "nvme", "total", "read/step", "written/step", "nvme/rank")]
    for r in rows:
        table.append((r["master"], r["moments"], *(f"{r[k]} B" for k in ("device", "host", "nvme", "total",
                                                                          "optimizer_read", "optimizer_write")),
                      _size(-(-num_params // devices) * r["nvme"])))
    _print_table(table)
    print("remainder: exact (bitwise the fp32 master's training); bf16 and int8 moments: lossy (docs/benchmarks.md: "
          "convergence); int8 is 65/64 B a moment: a block of 256 codes and its fp32 scale")


def _print_table(table: list) -> None:
    """Rows of cells, the first a header: left-aligned names, right-aligned figures."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _print_zeropp(rows: list, devices: int, per_node: int) -> None:
    """The ZeRO++ table: stage 3 with each technique, bytes per rank per step inside and across nodes."""
    print(f"\nZeRO++ at stage 3, {devices // per_node} node(s) x {per_node} ranks; bytes per rank per step "
          "(pairwise: what this rank delivers to others)")
    table = [("strategy", "device", "intra-node", "cross-node", "cross vs zero3")]
    for r in rows:
        table.append((r["name"], _size(r["device_bytes"]), _size(r["intra_node_bytes"]), _size(r["cross_node_bytes"]),
                      f"{r['cross_vs_zero3']:.3f}" if rows[0]["cross_node_bytes"] else "-"))
    _print_table(table)
    if devices == per_node:
        print("one node: nothing crosses a node, ZeRO++ saves nothing here (pass --ranks-per-node)")
    else:
        print("hpZ's device bytes include its secondary shard (params / ranks per node), held from forward to the "
              "end of backward")


def _tp_rows(args) -> list:
    """ZeRO x TP rows for the built-in GPT (see infinity/estimate/tensor_parallel.py)."""
    from infinity.estimate.tensor_parallel import gpt_tp_rows
    if args.model is None:
        raise UsageError("--tp: needs --model (the split and the tp-axis bytes depend on the model's layers)")
    try:
        return gpt_tp_rows(args.model, args.devices, args.tp, args.tokens)
    except ValueError as e:
        raise UsageError(f"--tp: {e}") from None


def _print_tp(rows: list, args) -> None:
    """The ZeRO x TP table: model state per rank (mixed precision) and volume per step on each mesh axis."""
    r0 = rows[0]
    print(f"\nZeRO x tensor parallelism, {args.devices} ranks; {r0['split_params']:,} of {r0['params']:,} params "
          f"split (attention + MLP), {r0['tokens_per_rank']} tokens per dp rank per step")
    table = [("strategy", "state/rank", "dp axis/step", "tp axis/step")]
    for r in rows:
        table.append((r["label"], _size(r["state_bytes_per_rank"]), f"{r['dp_volume_elements']:,} el",
                      f"{r['tp_volume_elements']:,} el"))
    _print_table(table)
    print("tp axis: 8 x layers x width elements per token (all-reduces of activations; keep it on NVLink)")


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
    print(f"machine      {m['cores_available']} cores, {_size(m['ram_bytes'])} RAM{granted}; {m['dir']} is "
          f"{m['fs_type']}, {m['direct_io']} I/O")
    print(f"memcpy       {mc['gbps']:.2f} GB/s ({mc['threads']} threads), {mc['single_thread_gbps']:.2f} GB/s "
          f"(1 thread), {_size(mc['bytes'])} buffer" + (f"; into fresh memory {mc['fresh_gbps']:.2f} GB/s "
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
            print(f"  {r['op']:15s} {_size(r['bytes']):>10s}  {r['algbw_gbps']:7.3f} / {r['busbw_gbps']:7.3f}")
    else:
        print(f"collectives  {co['reason']}")
    print(f"nvme         {nv['mode']} I/O, {_size(nv['bytes_per_point'])} per point; write / read GB/s, "
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


# ---------------------------------------------------------------- plan

def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="pick every knob from a measured profile: the fastest config that fits, predicted and explained",
        description="Enumerate configs (stage, each tensor class's home, chunk size, overlap, activation "
                    "checkpointing, prefetch, reduce dtype), predict each from the machine's profile and the "
                    "model's measured compute, and print the fastest that fits the memory granted as loadable "
                    "YAML, with its predicted phases, peak RSS terms, bytes per tier pair and the next best "
                    "(see infinity/plan/). A request nothing fits is refused, naming the least that would run.")
    p.add_argument("--model", required=True, metavar="NAME|hf:DIR", help="as infinity train --model")
    p.add_argument("--devices", type=int, default=1, metavar="N", help="data-parallel ranks on this machine (default 1)")
    p.add_argument("--host-bytes", default=None, metavar="SIZE", help="host memory granted per rank (default: auto)")
    p.add_argument("--device-bytes", default=None, metavar="SIZE",
                   help="device memory granted per rank (default: auto; on CPU the device is RAM too)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="an infinity profile JSON (or its directory); default: measure a quick one now")
    p.add_argument("--tokens", type=int, default=None, metavar="T",
                   help="tokens per rank per step (default: infinity train's default batch over --devices)")
    p.add_argument("--seq-len", type=int, default=None, metavar="L", help="sequence length (default as infinity train)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="an infinity or DeepSpeed (ds_config.json) config to plan from: its precision, optimizer, "
                        "schedule and other keys are kept, its memory budgets are the grant (unless --host-bytes / "
                        "--device-bytes), and the planner chooses stage, placement, prefetch and I/O (--fix one to "
                        "keep it)")
    p.add_argument("--param-dtype", default=None, choices=("auto", "bf16", "fp16", "fp32"),
                   help="precision.param_dtype (default: --config's, else auto: measured on this machine, "
                        "infinity.precision)")
    p.add_argument("--swap-dir", default=None, metavar="DIR", help="nvme_path of the chosen config (default ./infinity_swap)")
    p.add_argument("--fix", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="plan with this knob fixed (repeatable), e.g. --fix zero.stage=3 --fix offload.optimizer=none")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the chosen config there (YAML)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(run=_run_plan)


def _run_plan(args) -> int:
    import yaml

    from infinity.config import parse_size
    from infinity.plan import InfeasiblePlan, PlanInputError, describe
    from infinity.train import TrainError
    from infinity.train.auto import plan_model, request_for_model

    for flag, value in (("--devices", args.devices), ("--tokens", args.tokens), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    fixed = {}
    for item in args.fix:
        key, eq, text = item.partition("=")
        if not eq:
            raise UsageError(f"--fix {item!r}: expected SECTION.KEY=VALUE, e.g. zero.stage=3")
        key = key.strip()
        fixed[key] = parse_size(text, f"--fix {key}") if key.endswith("bytes") else yaml.safe_load(text)
    base, grant = _plan_base(args.config)

    def granted(value, flag, key):   # the flag, else the config's budget; "auto": the tiers' auto
        if value is None:
            return grant.get(key)
        return None if value == "auto" else parse_size(value, flag)

    try:
        request = request_for_model(
            args.model, tokens=args.tokens, world=args.devices,
            host_bytes=granted(args.host_bytes, "--host-bytes", "host_bytes"),
            device_bytes=granted(args.device_bytes, "--device-bytes", "device_bytes"),
            swap_dir=args.swap_dir or grant.get("nvme_path"), base=base, seq_len=args.seq_len, fixed=fixed,
            param_dtype=args.param_dtype or (base.get("precision") or {}).get("param_dtype", "auto"))
        plan = plan_model(request, args.profile, None if args.json else (lambda m: print(m, file=sys.stderr)))
    except (InfeasiblePlan, PlanInputError, TrainError) as e:
        raise UsageError(str(e)) from None
    if args.out:
        with open(args.out, "w") as f:
            yaml.safe_dump(plan.config_dict(), f, sort_keys=False, default_flow_style=None)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        print("\n".join(describe(plan)))
    return 0


def _plan_base(path: str | None) -> tuple:
    """``(base sections, grant)`` of ``infinity plan --config``: the sections the plan keeps (all but the tiers,
    prefetch and I/O, which it sizes; its knobs override the rest) and the config's memory budgets and swap
    directory where it gives them."""
    if path is None:
        return {}, {}
    from infinity.config import Config
    config = Config.from_file(path).to_dict()
    tiers = config["tiers"]
    grant = {k: tiers[k] for k in ("host_bytes", "device_bytes", "nvme_path") if tiers[k] not in (None, "auto")}
    return {k: v for k, v in config.items() if k not in ("tiers", "prefetch", "io")}, grant


# ---------------------------------------------------------------- consolidate

def _add_consolidate(sub) -> None:
    p = sub.add_parser(
        "consolidate", help="sharded checkpoint to one state dict in safetensors files",
        description="Write a checkpoint's model state (every state_dict name, buffers included) as safetensors, "
                    "split above --max-shard-bytes with a model.safetensors.index.json, plus config.json for a "
                    "transformers model, streaming in bounded memory (see infinity/checkpoint/consolidate.py).")
    p.add_argument("checkpoint", metavar="CKPT", nargs="+",
                   help="a step directory, or a checkpoint root (its latest step); for a node-local checkpoint, "
                        "every node's (the same step)")
    p.add_argument("out", metavar="OUT", help="output directory (made if missing)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="output dtype (default fp32)")
    p.add_argument("--max-shard-bytes", default="2GiB", metavar="SIZE",
                   help="start a new output file past this size (default 2GiB)")
    p.add_argument("--buffer-bytes", default="64MiB", metavar="SIZE",
                   help="tensor data held in memory at once (default 64MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_consolidate)


def _run_consolidate(args) -> int:
    from infinity.checkpoint import CheckpointError, consolidate
    from infinity.config import parse_size

    max_shard_bytes = parse_size(args.max_shard_bytes, "--max-shard-bytes")
    buffer_bytes = parse_size(args.buffer_bytes, "--buffer-bytes")
    for flag, value, least in (("--max-shard-bytes", max_shard_bytes, 1), ("--buffer-bytes", buffer_bytes, 16)):
        if value < least:
            raise UsageError(f"{flag} must be at least {least} bytes, got {value}")
    try:
        checkpoint = args.checkpoint[0] if len(args.checkpoint) == 1 else args.checkpoint
        summary = consolidate(checkpoint, args.out, args.dtype, max_shard_bytes, buffer_bytes)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"consolidated {summary['checkpoint']} (step {summary['step']}): {summary['tensors']} tensors, "
          f"{_size(summary['bytes'])} as {summary['dtype']} -> {summary['out']}")
    for name in summary["files"]:
        print(f"  {name}")
    return 0


# ---------------------------------------------------------------- train

def _add_train(sub) -> None:
    from infinity.train import (DEFAULT_BATCH_SIZE, DEFAULT_MODEL, DEFAULT_SEQ_LEN, DEFAULT_STEPS,
                                DEFAULT_SWAP_DIR)
    from infinity.train.options import (DEFAULT_EVAL_BATCHES, DEFAULT_EVAL_EVERY, DEFAULT_SAVE_ROOT,
                                        DEFAULT_SCHEDULE, DEFAULT_VAL_FRACTION)

    p = sub.add_parser(
        "train", help="train a model (default: a small built-in GPT on the embedded corpus, ZeRO-3)",
        description="Train with ZeRO stages 0-3 and device/host/NVMe tiers (see infinity/train/). With no "
                    "arguments: a small built-in GPT on the Python standard library's source, ZeRO-3, with the "
                    f"swap directory ./{DEFAULT_SWAP_DIR}, a checkpoint at the end under ./{DEFAULT_SAVE_ROOT}. "
                    "Ctrl-C or SIGTERM stops after the current step, saves, and removes the swap files (exit code "
                    "130 or 143). "
                    "Flags marked 'resumable' default to the checkpoint's value under --resume.")
    p.add_argument("--config", metavar="FILE", help="YAML/JSON config (default: the built-in ZeRO-3 NVMe config); "
                   "a DeepSpeed ds_config.json is read as one (docs/migrating-from-deepspeed.md); "
                   "auto (or a file with offload: auto, e.g. configs/auto.yaml): the planner picks it (infinity plan)")
    p.add_argument("--print-config", action="store_true",
                   help="print the config the run would use (YAML; with --json, JSON), flags applied, and exit")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="local ranks to start (default 1); under torchrun the launcher's ranks are joined instead")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help=f"optimizer steps in all, resumed ones included (default {DEFAULT_STEPS}; resumable)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="built-in GPT size (tiny, 125m, 350m, 1b, 3b), optionally with changed fields "
                        "(125m:n_layer=4); a transformers config class: hf:GPT2Config:n_layer=2,n_embd=64,n_head=2 "
                        "(built from config, never downloaded); or hf:PATH, a local transformers model directory "
                        "to fine-tune (config.json + safetensors). "
                        f"Default {DEFAULT_MODEL}; resumable")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="global sequences per step, over all ranks and micro-batches "
                        f"(default {DEFAULT_BATCH_SIZE}; resumable)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's limit if shorter; resumable)")
    p.add_argument("--accum", type=int, default=None, metavar="N",
                   help="micro-batches per rank per step (default: the config's schedule.accum_steps, a DeepSpeed "
                        "config's gradient_accumulation_steps, else 1)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (overrides optimizer.lr)")
    p.add_argument("--seed", type=int, default=None, help="model init and batch order (default 0; resumable)")
    p.add_argument("--stage", type=int, default=None, choices=(0, 1, 2, 3), help="overrides zero.stage")
    p.add_argument("--swap-dir", metavar="DIR", help=f"overrides tiers.nvme_path (default ./{DEFAULT_SWAP_DIR}); "
                                                     "each run uses a subdirectory of its own, removed at the end")
    p.add_argument("--device-bytes", metavar="SIZE", help="overrides tiers.device_bytes, e.g. 512MiB")
    p.add_argument("--host-bytes", metavar="SIZE", help="overrides tiers.host_bytes, e.g. 8GiB")
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--data", metavar="FILE", help="train on this file instead of the default corpus: its bytes, or "
                                                  "its text tokenized when there is a tokenizer (resumable)")
    g.add_argument("--corpus-bytes", metavar="SIZE", help="how much of the default corpus to use (default 4MiB; "
                                                          "resumable)")
    g.add_argument("--tokenizer", metavar="DIR", help="a local transformers tokenizer directory (default: the "
                                                      "hf:PATH model's own, if it has one; else byte tokens)")
    g.add_argument("--val-fraction", type=float, default=None, metavar="F",
                   help=f"held-out tail of the data (default {DEFAULT_VAL_FRACTION}; resumable)")
    g.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY, metavar="N",
                   help=f"validation loss and perplexity every N steps and at the last (default {DEFAULT_EVAL_EVERY}; "
                        "0 = never)")
    g.add_argument("--eval-batches", type=int, default=DEFAULT_EVAL_BATCHES, metavar="N",
                   help=f"held-out batches per evaluation (default {DEFAULT_EVAL_BATCHES})")
    g.add_argument("--sample-every", type=int, default=0, metavar="N",
                   help="print a sample continuing the data's first tokens every N steps (default 0 = never)")
    g.add_argument("--sample-tokens", type=int, default=64, metavar="N", help="tokens per sample (default 64)")
    g = p.add_argument_group("schedule (defaults: the config's schedule section; resumable)")
    g.add_argument("--lr-schedule", choices=("constant", "linear", "cosine"), default=None,
                   help=f"decay after warmup (default config: {DEFAULT_SCHEDULE['lr_schedule']})")
    g.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                   help=f"linear warmup steps (default config: {DEFAULT_SCHEDULE['warmup_steps']})")
    g.add_argument("--min-lr", type=float, default=None, help="lr at the end of the decay "
                                                              f"(default config: {DEFAULT_SCHEDULE['min_lr']:g})")
    g.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help=f"clip the gradient norm to MAX, 0 = never (default config: "
                        f"{DEFAULT_SCHEDULE['clip_grad_norm']:g})")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-dir", metavar="DIR",
                   help=f"save DIR/step_N and DIR/latest (default ./{DEFAULT_SAVE_ROOT}/run-<time>-<pid>, or the "
                        "directory a --resume came from)")
    g.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="also save every N steps (default 0: at the end and on Ctrl-C only)")
    g.add_argument("--keep-last", type=int, default=None, metavar="K", help="keep only the newest K checkpoints")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CKPT",
                   help="continue a run: from CKPT (a step directory or a save directory), or with no value from "
                        f"--save-dir's latest (else the newest run under ./{DEFAULT_SAVE_ROOT}); 'if-saved': from "
                        "--save-dir's latest if it has one, else start fresh (the command torchrun --max-restarts "
                        "runs again after a failure)")
    g.add_argument("--save-node-local", action="store_true", default=None,
                   help="the nodes share no file system: each node saves its own ranks' files into its own "
                        "--save-dir (consolidate or load elsewhere with every node's directory; resumable)")
    g.add_argument("--no-save", action="store_true", help="save no checkpoint")
    p.add_argument("--metrics", metavar="FILE", help="write one JSON line per step (appended to when resuming)")
    p.add_argument("--trace", metavar="FILE", help="write a Perfetto/Chrome trace of one step (every rank)")
    p.add_argument("--trace-step", type=int, default=1, metavar="N",
                   help="which step --trace records, 0-based (default 1: step 0 also records the gather order)")
    p.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_train)


def _run_train(args) -> int:
    from infinity.train import RankError, TrainError, TrainOptions, train
    from infinity.train.resolve import effective_config

    options = TrainOptions(
        config=args.config, nproc=args.nproc, steps=args.steps, model=args.model, batch_size=args.batch_size,
        seq_len=args.seq_len, accum=args.accum, lr=args.lr, seed=args.seed, stage=args.stage,
        swap_dir=args.swap_dir, device_bytes=args.device_bytes, host_bytes=args.host_bytes, data=args.data,
        corpus_bytes=args.corpus_bytes, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
        eval_every=args.eval_every, eval_batches=args.eval_batches, warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule, min_lr=args.min_lr, clip_grad_norm=args.clip_grad_norm,
        save=not args.no_save, save_dir=args.save_dir, save_node_local=args.save_node_local,
        save_every=args.save_every, keep_last=args.keep_last,
        resume=args.resume, sample_every=args.sample_every, sample_tokens=args.sample_tokens,
        metrics=args.metrics, trace=args.trace, trace_step=args.trace_step, progress=not args.no_progress)
    if args.print_config:
        try:
            config = effective_config(options).to_dict()
        except TrainError as e:
            raise UsageError(str(e)) from None
        if args.json:
            print(json.dumps(config, indent=2))
        else:
            import yaml
            print(yaml.safe_dump(config, sort_keys=False, default_flow_style=False), end="")
        return 0
    try:
        result = train(options)
    except TrainError as e:
        raise UsageError(str(e)) from None
    except RankError as e:
        if getattr(args, "debug", False) and e.traceback:
            print(e.traceback, file=sys.stderr, end="")
        print(f"infinity train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:   # a second Ctrl-C / SIGTERM: stopped at once
        print("infinity train: interrupted; stopped without finishing the step, swap files removed",
              file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    stopped_code = 128 + (result.stop_signal or signal.SIGINT)   # 130 after SIGINT, 143 after SIGTERM
    if result.rank != 0:    # under torchrun only rank 0 speaks
        return stopped_code if result.interrupted else 0
    s = result.summary
    if result.interrupted:
        done = f"after step {s['steps']} of {s['steps_requested']}" if s.get("steps") is not None else "at once"
        saved = "; saved" if s.get("checkpoint") else ""
        print(f"infinity train: interrupted {done}{saved}; swap files removed", file=sys.stderr)
    if args.json:
        print(json.dumps(s, indent=2))
    elif s.get("steps"):
        offload = ", ".join(f"{k} {v}" for k, v in s["offload"].items() if v != "none") or "no offload"
        print(f"{s['model']}: {s['num_params']:,} params, {s['world_size']} rank(s), ZeRO-{s['stage']}, "
              f"{_dtypes(s)}, {offload}")
        ran = s["steps"] - s["start_step"]
        resumed = f" (resumed at step {s['start_step']})" if s["start_step"] else ""
        if s["first_loss"] is not None:
            print(f"{ran} steps of {s['batch_size']} x {s['seq_len']} tokens in {s['elapsed_s']:.1f} s{resumed}; "
                  f"loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}; {s['tokens_per_s']:,.0f} tokens/s")
        if s.get("val_loss") is not None:
            print(f"validation loss {s['val_loss']:.4f}, perplexity {s['val_perplexity']:.2f}")
        if s.get("memory"):
            from infinity.train.report import memory_line
            print(f"the step with the highest {memory_line(s['memory'])}")
        for what in ("metrics", "trace"):
            if s.get(what):
                print(f"wrote {what} to {s[what]}")
        if s.get("checkpoint"):
            print(f"saved checkpoint {s['checkpoint']}; continue with: infinity train --resume "
                  f"{Path(s['checkpoint']).parent} --steps N")
    return stopped_code if result.interrupted else 0


# ---------------------------------------------------------------- sample

def _add_sample(sub) -> None:
    p = sub.add_parser(
        "sample", help="continue a prompt with a model saved by infinity train",
        description="Load a checkpoint saved by `infinity train` (a step directory, or a save directory: its "
                    "latest), consolidate its weights into a temporary directory, and continue --prompt on the "
                    "CPU (see infinity/train/sample.py). The model must fit in memory.")
    p.add_argument("checkpoint", metavar="CKPT", help="a step directory, or a save directory (its latest step)")
    p.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    p.add_argument("--tokens", type=int, default=64, metavar="N", help="tokens to add (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="draw among the K likeliest (default 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_sample)


_SAMPLE_BAR_TOKENS = 256   # samples this long (seconds on a CPU) get a progress bar


def _run_sample(args) -> int:
    from infinity.checkpoint import CheckpointError
    from infinity.train import TrainError
    from infinity.train.sample import sample_checkpoint

    if args.tokens < 1 or args.top_k < 1 or not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--tokens and --top-k must be >= 1 and --temperature a finite number >= 0, got "
                         f"--tokens {args.tokens}, --top-k {args.top_k}, --temperature {args.temperature}")
    bars = []

    def progress(total: int):   # a bar on stderr for long samples; stdout keeps only the text (or JSON)
        if args.json or total < _SAMPLE_BAR_TOKENS:
            return None
        from tqdm import tqdm
        bars.append(tqdm(total=total, desc="sample", unit="tok", file=sys.stderr, dynamic_ncols=True))
        return lambda: bars[0].update(1)

    try:
        out = sample_checkpoint(args.checkpoint, args.prompt, args.tokens, args.temperature, args.top_k, args.seed,
                                say=lambda line: print(f"infinity sample: {line}", file=sys.stderr), progress=progress)
    except (TrainError, CheckpointError, ValueError) as e:
        raise UsageError(str(e)) from None
    finally:
        for bar in bars:
            bar.close()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(out["text"])
    return 0


# ---------------------------------------------------------------- report

def _add_report(sub) -> None:
    p = sub.add_parser(
        "report", help="what this machine and install can do (as DeepSpeed's ds_report)",
        description="torch, Python, CUDA and device capabilities, the compute dtype precision auto would pick "
                    "and why, whether the native libraries build here, and with --dir a swap directory's file "
                    "system, O_DIRECT, free space and a short read/write figure.")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="also probe this swap directory (writes and reads one file there, then removes it)")
    p.add_argument("--bytes", default="256MiB", metavar="SIZE",
                   help="bytes the --dir probe writes and reads (default 256MiB; 0 = no read/write figure)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_report)


def _run_report(args) -> int:
    from infinity.config import parse_size
    from infinity.report import build_report, report_lines

    size = parse_size(args.bytes, "--bytes")
    if args.dir is not None and not Path(args.dir).is_dir():
        raise UsageError(f"--dir {args.dir}: not a directory")
    report = build_report(args.dir, size)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(report_lines(report)))
    return 0


# ---------------------------------------------------------------- program

def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="infinity", description="Train models whose training state is larger than device memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_train(sub)
    _add_estimate(sub)
    _add_profile(sub)
    _add_plan(sub)
    _add_consolidate(sub)
    _add_sample(sub)
    _add_report(sub)
    # --debug after the sub-command too; SUPPRESS keeps the main parser's value when it is not repeated
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks instead of one-line errors")
    return parser


def _run_errors() -> tuple:
    """Failures of a run whose cause is outside the program: reported in one line (exit 1) unless --debug.
    Imported only once something failed, so that ``infinity --help`` stays light."""
    from infinity.checkpoint import CheckpointError
    from infinity.comm.watchdog import CollectiveTimeout
    from infinity.store import StoreError
    return (CheckpointError, StoreError, CollectiveTimeout, OSError)   # OSError covers SwapIOError


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
        if args.debug:
            raise
        print(f"infinity {args.command}: {e}", file=sys.stderr)
        return 2
    except _run_errors() as e:
        # the input was fine, the world was not (disk, files, other ranks); anything else is a bug and
        # keeps its traceback
        if args.debug:
            raise
        print(f"infinity {args.command}: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    """The error's own first line; an OSError without a message of its own says its errno's."""
    text = (str(e).strip().splitlines() or [""])[0]
    return text or type(e).__name__


def _dtypes(summary: dict) -> str:
    """``bf16``, or ``bf16 stored, fp32 compute`` where they differ."""
    stored, compute = summary["param_dtype"], summary.get("compute_dtype", summary["param_dtype"])
    return stored if compute == stored else f"{stored} stored, {compute} compute"


if __name__ == "__main__":
    sys.exit(main())
