"""ZeRO-3 and ZeRO++ across two real "nodes": bytes on the link against the estimate, and step time on a slow link.

Two network namespaces joined by a veth link (``tests/helpers/two_nodes.py``), the link limited to
``--rate`` (tc tbf) and, where the kernel has netem, delayed by ``--delay-ms``; ``torchrun --nnodes 2
--nproc-per-node 2`` in each, gloo over the veth. One job trains the same GPT, stage 3, with each
configuration in turn (plain ZeRO-3, qwZ, hpZ, qgZ, all three), ``--warmup`` untimed and ``--steps``
timed steps each on the same global batches. Per configuration:

- ``link_bytes_per_step``: what crossed the veth per step, both directions, read from node 0's end of the
  link inside its namespace (kernel counters: TCP/IP headers, ACKs, the per-step loss all-reduce and
  barriers included);
- ``estimate_cross_bytes_per_step``: ``infinity estimate``'s cross-node figure
  (:func:`infinity.estimate.strategies.zeropp_comm`, bytes one rank sends to other nodes) for this model,
  world and dtypes, times the world size (every rank sends its own);
- ``counted_cross_bytes_per_step``: the engines' own cross-node byte counters, summed over the ranks;
- ``estimate_on_backend_bytes_per_step``: the estimate with each phase weighted by what gloo's algorithm for
  its collective puts on the link per counted byte, measured in the same job
  (``backend_link_bytes_per_counted_byte``: the estimate counts each shard delivered once to each rank of
  another node; gloo's ring all-gather crosses the boundary on 2 of its 4 edges, 0.75 of that, and its
  reduce-scatter 1.5 times it; qgZ's cross-node all-to-all, between one rank of each node, is what it counts);
- ``step_s``: the median step time (each step starts at a barrier), and the loss after the last step.

The machine is recorded (:func:`infinity.precision.hardware_record`); figures from other hardware are not
comparable. Needs root and iproute2.

    sudo python tools/bench_two_nodes.py --rate 1gbit --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))

CONFIGS = {
    "zero3": {},
    "qwZ": {"quantize_weights": True},
    "hpZ": {"hierarchical_partition": True},
    "qgZ": {"quantize_grads": True},
    "all": {"quantize_weights": True, "hierarchical_partition": True, "quantize_grads": True},
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ---------------------------------------------------------------- the ranks (run by torchrun in each namespace)

def _link_bytes() -> int:
    """Bytes node 0's end of the veth has sent and received: everything that crossed the link."""
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    stats = Path("/sys/class/net") / dev / "statistics"
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def _run_config(name: str, args) -> dict:
    import torch
    import torch.distributed as dist

    import infinity
    from bench_zeropp import _gpt_config
    from infinity.models import GPT

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(_gpt_config(args.model))
    cfg = {"zero": {"stage": 3}, "precision": {"param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype},
           "optimizer": {"lr": 1e-3}, "zeropp": dict({"ranks_per_node": "auto"}, **CONFIGS[name])}
    model, opt = infinity.initialize(model, cfg)
    engine = infinity.engine_of(model)
    vocab, per_rank = model.config.vocab_size, args.batch
    times, losses, link, counted = [], [], 0, 0
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 + step)   # the same global batch for every configuration
        ids = torch.randint(0, vocab, (per_rank * world, args.seq), generator=g)[rank * per_rank:(rank + 1) * per_rank]
        dist.barrier()
        if step == args.warmup:
            link = _link_bytes() if rank == 0 else 0
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s = time.perf_counter() - t0
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if step >= args.warmup:
            times.append(step_s)
            counted += sum(engine.stats.last_step["collectives"]["cross_node_bytes"].values())
    dist.barrier()
    link = (_link_bytes() - link) if rank == 0 else 0
    counted = torch.tensor([float(counted)])
    dist.all_reduce(counted)
    units = [(u.padded_numel, u.is_root) for u in engine.units]
    dtype = engine.config.precision.param_dtype
    engine.close()
    return {"step_s": statistics.median(times), "step_s_all": times, "loss": losses[-1], "losses": losses,
            "link_bytes_per_step": link / args.steps, "counted_cross_bytes_per_step": counted.item() / args.steps,
            "units": units, "param_dtype": dtype}


def _calibrate(per_node: int) -> dict:
    """Link bytes of one collective of each kind the engine uses, over the world, per byte of the pairwise
    cross-node count (what the estimate and the engine's counters count: each rank's shard delivered to
    every rank of another node). The backend's algorithm decides the rest: a ring all-gather crosses the
    node boundary on 2 of its 4 edges, for example."""
    import torch
    import torch.distributed as dist

    from infinity.comm.collectives import _all_gather, _reduce_scatter

    rank, n = dist.get_rank(), dist.get_world_size()
    numel = 1 << 20   # 4 MiB of fp32 a shard
    shard, full = torch.ones(numel), torch.ones(n * numel)
    pairwise = n * (n - per_node) * numel * 4
    kinds = {"all_gather": lambda: _all_gather(full, shard),
             "reduce_scatter": lambda: _reduce_scatter(shard, full, op=dist.ReduceOp.AVG)}
    factors = {}
    for kind, run in kinds.items():
        dist.barrier()
        before = _link_bytes() if rank == 0 else 0
        run()
        dist.barrier()
        factors[kind] = (_link_bytes() - before) / pairwise if rank == 0 else None
    return factors


def _child(args) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    calibration = _calibrate(int(os.environ["LOCAL_WORLD_SIZE"]))
    results = {name: _run_config(name, args) for name in args.configs}
    if dist.get_rank() == 0:
        Path(os.environ["INFINITY_NODE_DIR"], "bench.json").write_text(
            json.dumps({"configs": results, "calibration": calibration}))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the driver

def _estimate(r: dict, name: str, args, world: int, per_node: int, factors: dict) -> tuple:
    """(the estimate's cross-node bytes per step, all ranks; the same with each phase weighted by the
    backend's link bytes per counted byte for the collective that phase uses)."""
    from infinity.estimate.strategies import ZeroPPSwitches, zeropp_comm

    pp = CONFIGS[name]
    psi = sum(n for n, _ in r["units"])
    root = sum(n for n, is_root in r["units"] if is_root)
    sw = ZeroPPSwitches(pp.get("quantize_weights", False), pp.get("hierarchical_partition", False),
                        pp.get("quantize_grads", False), 8)
    est = zeropp_comm(psi, world, per_node, sw, DTYPE_BYTES[r["param_dtype"]], DTYPE_BYTES[args.reduce_dtype],
                      backward_numel=psi - root)
    # qgZ's cross-node step is an all-to-all within each local index's group of one rank a node: every byte
    # goes straight to its node, as counted (factor 1)
    factor = {"forward_gather": factors["all_gather"], "backward_gather": factors["all_gather"],
              "grad_reduce": 1.0 if sw.quantize_grads else factors["reduce_scatter"]}
    plain = world * sum(v["cross"] for v in est.values())
    on_backend = world * sum(v["cross"] * factor[phase] for phase, v in est.items())
    return plain, on_backend


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny:n_layer=4,n_head=4,n_embd=256,block_size=128",
                   help="built-in GPT with changed fields (default ~3.3M parameters)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--param-dtype", default="fp32")
    p.add_argument("--reduce-dtype", default="fp32")
    p.add_argument("--rate", default="1gbit", help="tc rate of each direction of the link ('none': unlimited)")
    p.add_argument("--delay-ms", type=float, default=None, help="one-way delay on each end (tc netem)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)

    from two_nodes import HarnessError, TwoNodes, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    world, per_node = 4, 2
    child = [str(Path(__file__).resolve()), "--child", "--model", args.model, "--batch", str(args.batch),
             "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--threads", str(args.threads), "--param-dtype", args.param_dtype, "--reduce-dtype", args.reduce_dtype,
             "--configs", *args.configs]
    rate = None if args.rate == "none" else args.rate
    try:
        with TwoNodes(rate=rate, delay_ms=args.delay_ms) as nodes:
            result = nodes.run(child, timeout_s=args.timeout_s, nproc_per_node=per_node)
            if not result.ok:
                print(result.describe(), file=sys.stderr)
                print(f"bench_two_nodes: the two-node job failed (exit codes {result.returncodes})", file=sys.stderr)
                return 1
            got = json.loads((nodes.nodes[0].dir / "bench.json").read_text())
            crossed = result.link_bytes
    except HarnessError as e:
        print(f"bench_two_nodes: {e}", file=sys.stderr)
        return 2

    import torch

    from hardware_note import line as hardware_line
    from infinity.precision import hardware_record

    rows, factors = {}, got["calibration"]
    for name, r in got["configs"].items():
        est, on_backend = _estimate(r, name, args, world, per_node, factors)
        rows[name] = {"step_s": r["step_s"], "loss": r["loss"], "link_bytes_per_step": r["link_bytes_per_step"],
                      "estimate_cross_bytes_per_step": est,
                      "estimate_on_backend_bytes_per_step": on_backend,
                      "counted_cross_bytes_per_step": r["counted_cross_bytes_per_step"],
                      "link_vs_estimate": r["link_bytes_per_step"] / est if est else None,
                      "link_vs_estimate_on_backend": r["link_bytes_per_step"] / on_backend if on_backend else None,
                      "params": sum(n for n, _ in r["units"]), "param_dtype": r["param_dtype"],
                      "step_s_all": r["step_s_all"]}
    if "zero3" in rows:
        base = rows["zero3"]
        for row in rows.values():
            row["step_vs_zero3"] = row["step_s"] / base["step_s"]
            row["link_vs_zero3"] = row["link_bytes_per_step"] / base["link_bytes_per_step"]
    torch.set_num_threads(args.threads)   # the record says the ranks' threads
    hardware = hardware_record("cpu")
    out = {"nodes": 2, "ranks_per_node": per_node, "model": args.model, "batch_per_rank": args.batch, "seq": args.seq,
           "steps": args.steps, "warmup": args.warmup, "param_dtype": args.param_dtype,
           "reduce_dtype": args.reduce_dtype, "rate": rate, "delay_ms": args.delay_ms, "hardware": hardware,
           "backend_link_bytes_per_counted_byte": factors, "job_link_bytes": crossed, "configs": rows}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(hardware_line(hardware))
    print(f"{args.model}, 2 nodes x {per_node} ranks over a veth link, rate {rate or 'unlimited'}, "
          f"delay {args.delay_ms or 0:g} ms; {args.steps} timed steps of {args.batch} x {args.seq} tokens a rank")
    print("gloo's link bytes per counted cross-node byte: " + ", ".join(f"{k} {v:.3f}" for k, v in factors.items()))
    print(f"{'config':<7} {'link B/step':>12} {'estimate':>12} {'link/est':>8} {'est x gloo':>12} {'link/that':>9} "
          f"{'counted':>12} {'step s':>8} {'x zero3':>8} {'loss':>8}")
    for name, r in rows.items():
        print(f"{name:<7} {r['link_bytes_per_step']:12,.0f} {r['estimate_cross_bytes_per_step']:12,d} "
              f"{r['link_vs_estimate']:8.3f} {r['estimate_on_backend_bytes_per_step']:12,.0f} "
              f"{r['link_vs_estimate_on_backend']:9.3f} {r['counted_cross_bytes_per_step']:12,.0f} "
              f"{r['step_s']:8.3f} {r.get('step_vs_zero3', float('nan')):8.2f} {r['loss']:8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
