"""``infinity estimate``: model-state memory per tier and communication per step for each ZeRO stage,
with ZeRO++, tensor parallelism, activations and stored formats, as tables or JSON."""

from __future__ import annotations

import json

from infinity.cli.sizes import decimal_size
from infinity.cli.usage import UsageError

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    """Register ``infinity estimate`` and its arguments on ``sub``, the program's sub-command parsers."""
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
        table.append((name, str(e.placement.stage), decimal_size(m.device_bytes), decimal_size(m.host_bytes), decimal_size(m.nvme_bytes),
                      f"{c.total_numel / num_params:g} x params", decimal_size(c.total_bytes)))
    _print_table(table)
    print("not counted: activations, gathered stage-3 working set, buffers; host/nvme are per rank")
    for e in rows:
        if e.memory.spare_bytes:
            print(f"config: includes {decimal_size(e.memory.spare_bytes)} of spare parameter and optimizer copies "
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
            cells.append(" + ".join([decimal_size(m["device_bytes"])] + [f"{decimal_size(m[k + '_bytes'])} {k}"
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
                      decimal_size(-(-num_params // devices) * r["nvme"])))
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
        table.append((r["name"], decimal_size(r["device_bytes"]), decimal_size(r["intra_node_bytes"]), decimal_size(r["cross_node_bytes"]),
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
        table.append((r["label"], decimal_size(r["state_bytes_per_rank"]), f"{r['dp_volume_elements']:,} el",
                      f"{r['tp_volume_elements']:,} el"))
    _print_table(table)
    print("tp axis: 8 x layers x width elements per token (all-reduces of activations; keep it on NVLink)")

