"""Rank-side cases for the ZeRO++ tests (tests/comm/test_zeropp.py); importable by :mod:`world` ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zero_cases
from zero_cases import _loss, backward_on_share, build_model, global_batch


def config_for(spec: dict) -> dict:
    """zero_cases' config plus a ``zeropp`` section from the spec's ``pp`` dict (2 ranks a "node"),
    the spec's ``offload`` section if any, and activation checkpointing if ``checkpointing``."""
    cfg = zero_cases.config_for(spec)
    cfg["zeropp"] = dict({"ranks_per_node": spec.get("ranks_per_node", 2)}, **spec.get("pp", {}))
    if spec.get("offload"):
        cfg["offload"] = spec["offload"]
    if spec.get("checkpointing"):
        cfg["zero"]["activation_checkpointing"] = True
    return cfg


def many(fn_name: str, specs: list) -> list:
    fn = globals()[fn_name]
    return [fn(s) for s in specs]


def bytes_case(spec: dict) -> dict:
    """One step: per phase (forward, backward, step) the counters' bytes by kind, intra- and cross-node,
    and resident bytes after forward (hpZ's secondary shards live then) and after zero_grad."""
    import infinity

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(spec.get("model", "gpt"))
    model, opt = infinity.initialize(model, config_for(spec))
    engine = infinity.engine_of(model)
    counters = engine.coll.counters
    ids = global_batch(0, 2 * world).chunk(world)[rank]
    phases = {}

    def take(name):
        snap = counters.snapshot()
        phases[name] = {k: snap[k] for k in ("bytes", "intra_node_bytes", "cross_node_bytes", "calls", "sent_bytes")}
        counters.reset()

    counters.reset()
    loss = _loss(model, ids)
    take("forward")
    after_forward = engine.resident_bytes()
    loss.backward()
    take("backward")
    opt.step()
    take("step")
    opt.zero_grad()
    units = [(u.padded_numel, u.is_root) for u in engine.units]
    from infinity.zero.units import TensorClass
    with engine.gathered():   # exact even with qwZ: this rank's slice is its stored shard, bit for bit
        exact = all(torch.equal(u.full_param[rank * u.shard_numel:(rank + 1) * u.shard_numel],
                                u.shard.get(TensorClass.PARAM)) for u in engine.units)
    out = {"phases": phases, "after_forward": after_forward, "after_step": engine.resident_bytes(),
           "units": units, "shard_world": engine.shard_world, "gathered_exact": exact}
    engine.close()
    return out


def train_case(spec: dict) -> dict:
    """zero_cases.train_case with the spec's zeropp section; losses per step (averaged over ranks)."""
    import infinity

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(spec["model"], spec.get("seed", 0))
    model, opt = infinity.initialize(model, config_for(spec))
    engine = infinity.engine_of(model)
    losses = []
    cycle = spec.get("cycle", spec["steps"])   # a few batches seen again and again: a loss that really falls
    for step in range(spec["steps"]):
        losses.append(backward_on_share(model, global_batch(step % cycle, spec["batch"]), rank, world))
        opt.step()
        opt.zero_grad()
    with engine.gathered():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
    engine.close()
    return {"losses": losses, "params": params, "norms": []}


def reduce_error_case(spec: dict) -> dict:
    """qgZ's reduce-scatter of random per-rank gradients against the exact mean: the max error and the
    largest input magnitude over all ranks."""
    from infinity.config import ZeroPPConfig
    from infinity.comm.collectives import Collectives
    from infinity.comm.zeropp import ZeroPlusPlus

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ZeroPPConfig(quantize_grads=True, grad_bits=spec["bits"], ranks_per_node=2)
    pp = ZeroPlusPlus(cfg, Collectives(), shard_params=False, sharded=True)   # stage 2
    shard = 4096
    g = torch.Generator().manual_seed(100 + rank)
    # heavy-tailed, with a different scale per rank: blocks whose ranks disagree in magnitude
    full = torch.randn(world * shard, generator=g) * torch.exp(torch.randn(world * shard, generator=g)) * (rank + 1)
    out = torch.empty(shard)

    class Unit:
        name = "test"
    pp.reduce_scatter(Unit(), out, full, then=None).wait()
    exact = full.clone()
    dist.all_reduce(exact)
    exact = exact[rank * shard:(rank + 1) * shard] / world
    biggest = full.abs().max().reshape(1)
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    return {"err": float((out - exact).abs().max()), "biggest": float(biggest), "qmax": pp.grads_q.qmax}


def error_case(spec: dict) -> str:
    """initialize with the spec's zeropp layout; the error message, or "no error"."""
    import infinity

    try:
        infinity.initialize(build_model("gpt"), config_for(dict(BF16_SPEC, **spec)))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


BF16_SPEC = dict(stage=3, lr=1e-3, dtype="bf16", reduce="bf16")
