"""ZeRO++ on this machine: step time and bytes per step with each switch, vs plain ZeRO-3, and a projection.

Four gloo ranks (one process each) run as a 2 x 2 mesh (``zeropp.ranks_per_node: 2``):
2 "nodes" of 2 ranks. For each configuration (plain ZeRO-3, qwZ, hpZ, qgZ int8,
qgZ int4, all three) the same GPT is trained ``--warmup`` untimed and
``--steps`` timed steps on ``--batch`` x ``--seq`` tokens per rank; configurations
run round-robin ``--rounds`` times and the median step time is reported, with
rank 0's bytes per step from the engine's counters (total, intra-node,
cross-node, per collective kind).

On one machine every "link" is a memory copy, so the measured step time shows
the cost of quantization (compute) and not the saving. The projection puts the
measured volumes on a cluster: ``comm_s = intra_bytes / intra_GBps +
cross_bytes / cross_GBps`` per rank per step (``--intra-gbps``, ``--cross-gbps``,
GB/s), and ``projected_step_s`` = this machine's step time without its own
communication wait + ``comm_s`` (no overlap: an upper bound; with full overlap
the step is the larger of the two). The same volumes from
:func:`infinity.estimate.zeropp_comm` are printed beside the measured ones, and
``cluster`` projects the communication time per step of a larger run
(``--project-params`` on ``--project-devices`` ranks, ``--project-ranks-per-node``
a node) from the estimate's volumes at the same bandwidths. The output records the machine
(``infinity.precision.hardware_record``) and the dtypes the engines resolved (``--param-dtype auto`` is
measured here).

    python tools/bench_zeropp.py --json
    python tools/bench_zeropp.py --json --cross-gbps 3 --intra-gbps 150 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from hardware_note import line as hardware_line
from infinity.precision import hardware_record

WORLD, PER_NODE = 4, 2
CONFIGS = {
    "zero3": {},
    "qwZ": {"quantize_weights": True},
    "hpZ": {"hierarchical_partition": True},
    "qgZ": {"quantize_grads": True},
    "qgZ-int4": {"quantize_grads": True, "grad_bits": 4},
    "all": {"quantize_weights": True, "hierarchical_partition": True, "quantize_grads": True},
}


def _config(pp: dict, args) -> dict:
    return {"zero": {"stage": 3}, "precision": {"param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype},
            "zeropp": dict({"ranks_per_node": PER_NODE}, **pp)}


def _gpt_config(text: str):
    """``"tiny"`` or ``"tiny:n_layer=4,n_embd=256"``: a built-in GPT size with integer fields changed."""
    import dataclasses

    from infinity.models import gpt_config

    name, _, fields = text.partition(":")
    changes = dict(kv.split("=") for kv in fields.split(",")) if fields else {}
    return dataclasses.replace(gpt_config(name), **{k: int(v) for k, v in changes.items()})


def _run_one(name: str, args, rank: int) -> dict:
    import infinity
    from infinity.models import GPT

    torch.manual_seed(0)
    model = GPT(_gpt_config(args.model))
    model, opt = infinity.initialize(model, _config(CONFIGS[name], args))
    engine = infinity.engine_of(model)
    g = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    times, waits = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            waits.append(engine.stats.last_step["comm_wait_s"])
    coll = engine.stats.last_step["collectives"]
    units = [(u.padded_numel, u.is_root) for u in engine.units]
    precision = {"param_dtype": engine.config.precision.param_dtype,
                 "compute_dtype": engine.config.precision.compute_dtype}
    engine.close()
    return {"step_s": statistics.median(times), "comm_wait_s": statistics.median(waits),
            "bytes": sum(coll["bytes"].values()),
            "intra_node_bytes": coll["intra_node_bytes"], "cross_node_bytes": coll["cross_node_bytes"],
            "units": units, "precision": precision}


def _rank_main(rank: int, init_file: str, args, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_NODE))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
        results = {name: [] for name in CONFIGS}
        for _ in range(args.rounds):
            for name in CONFIGS:
                results[name].append(_run_one(name, args, rank))
        dist.destroy_process_group()
        queue.put((rank, results))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def _projection(r: dict, args) -> dict:
    intra, cross = sum(r["intra_node_bytes"].values()), sum(r["cross_node_bytes"].values())
    comm_s = intra / (args.intra_gbps * 1e9) + cross / (args.cross_gbps * 1e9)
    compute_s = max(0.0, r["step_s"] - r["comm_wait_s"])
    return {"comm_s": comm_s, "compute_s": compute_s, "projected_step_s": compute_s + comm_s,
            "projected_step_overlapped_s": max(compute_s, comm_s)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny:n_layer=4,n_head=4,n_embd=256,block_size=128",
                   help="built-in GPT (default ~4M parameters, fits 2 cores)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="round-robin repetitions; medians over rounds")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--param-dtype", default="bf16")
    p.add_argument("--reduce-dtype", default="fp32")
    p.add_argument("--intra-gbps", type=float, default=150.0, help="projection: intra-node GB/s per rank (NVLink-ish)")
    p.add_argument("--cross-gbps", type=float, default=3.0,
                   help="projection: cross-node GB/s per rank (25 Gb/s Ethernet shared by a node ~ 3 GB/s)")
    p.add_argument("--project-params", default="7B", help="cluster projection: parameter count")
    p.add_argument("--project-devices", type=int, default=64, help="cluster projection: ranks")
    p.add_argument("--project-ranks-per-node", type=int, default=8, help="cluster projection: ranks a node")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, os.path.join(tmp, "init"), args, queue)) for r in range(WORLD)]
        for proc in procs:
            proc.start()
        got = dict(queue.get(timeout=3600) for _ in procs)
        for proc in procs:
            proc.join()
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    if failed:
        for r, tb in failed.items():
            print(f"--- rank {r}:\n{tb}", file=sys.stderr)
        return 1

    from infinity.estimate.strategies import ZeroPPSwitches, zeropp_comm

    rows = {}
    for name, pp in CONFIGS.items():
        runs = got[0][name]
        r = dict(runs[0], step_s=statistics.median(x["step_s"] for x in runs),
                 comm_wait_s=statistics.median(x["comm_wait_s"] for x in runs))
        psi = sum(n for n, _ in r["units"])
        root = sum(n for n, is_root in r["units"] if is_root)
        sw = ZeroPPSwitches(pp.get("quantize_weights", False), pp.get("hierarchical_partition", False),
                            pp.get("quantize_grads", False), pp.get("grad_bits", 8))
        dtype_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}
        est = zeropp_comm(psi, WORLD, PER_NODE, sw, dtype_bytes[r["precision"]["param_dtype"]],
                          dtype_bytes[args.reduce_dtype], backward_numel=psi - root)
        rows[name] = {"step_s": r["step_s"], "comm_wait_s": r["comm_wait_s"], "bytes_per_step": r["bytes"],
                      "intra_node_bytes": sum(r["intra_node_bytes"].values()),
                      "cross_node_bytes": sum(r["cross_node_bytes"].values()),
                      "estimate_cross_node_bytes": sum(v["cross"] for v in est.values()),
                      "estimate_intra_node_bytes": sum(v["intra"] for v in est.values()),
                      "projection": _projection(r, args), "precision": r["precision"]}
        rows[name]["params"] = psi
    base = rows["zero3"]
    for row in rows.values():
        row["step_vs_zero3"] = row["step_s"] / base["step_s"]
        row["cross_vs_zero3"] = row["cross_node_bytes"] / base["cross_node_bytes"]
        row["projected_speedup_vs_zero3"] = (base["projection"]["projected_step_s"]
                                             / row["projection"]["projected_step_s"])
    from infinity.estimate.strategies import parse_param_count, zeropp_rows

    cluster_rows = zeropp_rows(parse_param_count(args.project_params), args.project_devices,
                               args.project_ranks_per_node)
    cluster = {}
    for r in cluster_rows:
        comm_s = r["intra_node_bytes"] / (args.intra_gbps * 1e9) + r["cross_node_bytes"] / (args.cross_gbps * 1e9)
        cluster[r["name"]] = {"intra_node_bytes": r["intra_node_bytes"], "cross_node_bytes": r["cross_node_bytes"],
                              "comm_s": comm_s, "device_bytes": r["device_bytes"]}
    base_comm = cluster["plain stage 3"]["comm_s"]
    for c in cluster.values():
        c["comm_vs_zero3"] = c["comm_s"] / base_comm
    torch.set_num_threads(args.threads)   # the record says the ranks' threads
    hardware = hardware_record("cpu")
    out = {"world_size": WORLD, "ranks_per_node": PER_NODE, "model": args.model, "batch": args.batch,
           "hardware": hardware,
           "seq": args.seq, "steps": args.steps, "rounds": args.rounds, "param_dtype": args.param_dtype,
           "reduce_dtype": args.reduce_dtype, "intra_gbps": args.intra_gbps, "cross_gbps": args.cross_gbps,
           "configs": rows,
           "cluster": {"params": args.project_params, "devices": args.project_devices,
                       "ranks_per_node": args.project_ranks_per_node, "rows": cluster}}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(hardware_line(hardware))
    print(f"{args.model}, {WORLD} ranks as 2 nodes x {PER_NODE}; projection at {args.intra_gbps:g} GB/s intra, "
          f"{args.cross_gbps:g} GB/s cross")
    print(f"{'config':<10} {'step s':>8} {'x zero3':>8} {'bytes':>10} {'cross':>10} {'x zero3':>8} "
          f"{'proj step s':>11} {'speedup':>8}")
    for name, r in rows.items():
        print(f"{name:<10} {r['step_s']:8.3f} {r['step_vs_zero3']:8.2f} {r['bytes_per_step']:10d} "
              f"{r['cross_node_bytes']:10d} {r['cross_vs_zero3']:8.3f} {r['projection']['projected_step_s']:11.3f} "
              f"{r['projected_speedup_vs_zero3']:8.2f}")
    print(f"cluster: {args.project_params} params on {args.project_devices} ranks, {args.project_ranks_per_node} a node: "
          "communication per step (estimate volumes at the same bandwidths)")
    for name, c in cluster.items():
        print(f"  {name:<18} cross {c['cross_node_bytes'] / 1e9:7.2f} GB  comm {c['comm_s']:7.2f} s  "
              f"x zero3 {c['comm_vs_zero3']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
