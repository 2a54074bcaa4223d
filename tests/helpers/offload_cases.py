"""Rank-side cases for the offload tests (importable by tests/helpers/world.py ranks and by pytest)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_cases
from zero_cases import SEQ, VOCAB, Out, global_batch, param_groups


def offload_config(spec: dict, rank: int, world: int = 1) -> dict:
    """Budgets in the spec are for world size 1; shards shrink with the world, so do the budgets, but
    padding to 4096-byte shards does not: 64 KiB of slack per rank covers it at world size 2."""
    cfg = zero_cases.config_for(spec)
    # the disk path under test: nothing kept host-resident unless the spec says so
    cfg["offload"] = {"host_resident_bytes": 0, **spec["offload"]}

    def per_rank(n):
        return n if world == 1 else -(-n // world // 4096) * 4096 + 64 * 1024

    cfg["tiers"] = {"device_bytes": per_rank(spec.get("device_bytes", 1 << 22)),
                    "host_bytes": per_rank(spec.get("host_bytes", 1 << 22)),
                    "nvme_path": os.path.join(spec["tmp"], f"rank{rank}")}
    os.makedirs(cfg["tiers"]["nvme_path"], exist_ok=True)
    cfg["prefetch"] = {"bytes": spec.get("prefetch_bytes", 1 << 16), "max_live_bytes": spec.get("max_live", 1 << 20)}
    cfg["optimizer"]["threads"] = 1
    if "schedule" in spec:   # schedule.clip_grad_norm / accum_steps: what the engine is told to expect
        cfg["schedule"] = spec["schedule"]
    return cfg


class Reorder(nn.Module):
    """Blocks run in an order the caller sets per step (``route``): data-dependent control flow."""

    def __init__(self, width: int = 32, n: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(zero_cases.TiedBlock(width) for _ in range(n))
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.route = list(range(n))

    def forward(self, input_ids, labels=None):
        x = self.emb(input_ids)
        for i in self.route:
            x = self.blocks[i](x)
        logits = self.head(x)
        return Out(F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1)), logits)


def route_for(step: int, n: int = 4) -> list:
    """Steps 0-1 in order, 2 permuted, 3 in order again, 4 with a block run twice (every block runs:
    torch.optim.AdamW skips a parameter without a gradient, the sharded step does not)."""
    return [list(range(n)), list(range(n)), [3, 1, 0, 2], list(range(n)), [0, 2, 2, 1, 3]][step % 5]


def build(kind: str, seed: int = 0) -> nn.Module:
    if kind == "reorder":
        torch.manual_seed(seed)
        return Reorder()
    if kind == "many":   # 24 tiny units: compute is nothing, transfers are everything
        torch.manual_seed(seed)
        model = Reorder(width=8, n=24)
        model.route = list(range(24))
        return model
    return zero_cases.build_model(kind, seed)


def reference_run(spec: dict) -> dict:
    """Single-process fp32 torch.optim.AdamW over the full global batch (zero_cases.reference_run on our models)."""
    def route(model, step):
        if spec["model"] == "reorder":
            model.route = route_for(step)
    return zero_cases.reference_run(spec, build=build, before_step=route)


def train_case(spec: dict) -> dict:
    """Train with offload on this rank's share of each global batch; rank 0 returns the full params."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = build(spec["model"], spec.get("seed", 0))
    model, opt = infinity.initialize(model, offload_config(spec, rank, world), params=param_groups(model, spec))
    engine = infinity.engine_of(model)
    losses, norms, stats = [], [], []
    if spec.get("trace_step") is not None:
        engine.tracer.record_step(spec["trace_step"])
    try:
        for step in range(spec["steps"]):
            if spec["model"] == "reorder":
                model.route = route_for(step)
            losses.append(zero_cases.backward_on_share(model, global_batch(step, spec["batch"]), rank, world,
                                                       spec.get("accum", 1)))
            if spec.get("clip"):
                norms.append(float(opt.clip_grad_norm_(spec["clip"])))
            opt.step()
            opt.zero_grad()
            stats.append(engine.stats.last_step)
        with engine.gathered():
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
        store = engine.store.stats()
        chunks = max(len(u.shard.chunks()) for u in engine.units)
        pl = engine.placement
        itemsizes = pl.stored_itemsizes()
        accounting = {"shard_numel": sum(u.shard_numel for u in engine.units),   # what the placement says it stores
                      "itemsizes": {c.value: n for c, n in itemsizes.items()},
                      "homes": {c.value: pl.home(c).value for c in itemsizes},
                      # NVMe-homed states streamed through host memory (else kept there between steps)
                      "streamed": any(getattr(u.shard, "stream_states", False) for u in engine.units)}
        if spec.get("trace_step") is not None:
            engine.tracer.dump(os.path.join(spec["tmp"], f"trace_rank{rank}.json"))
    finally:
        engine.close()
    return {"losses": losses, "norms": norms, "params": params, "stats": stats, "store": store,
            "diverged": engine.prefetcher.steps_diverged, "accounting": accounting,
            "norm_reads": engine.grads.norm_reads, "most_chunks": chunks}


def many(specs: list) -> list:
    return [train_case(s) for s in specs]


def fp16_case(spec: dict) -> dict:
    """zero_cases.fp16_case with the spec's offload placement."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = offload_config(dict(spec, dtype="fp16", reduce=spec.get("reduce", "fp32")), rank, world)
    return zero_cases.fp16_run(spec, cfg)


def meta_init_case(spec: dict) -> dict:
    """Build the test GPT on the meta device, initialize with offload; rank 0 returns the weights."""
    import infinity
    from infinity.models import GPT, GPTConfig, gpt_init_

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    gcfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ)
    torch.manual_seed(spec.get("seed", 0))
    with torch.device("meta"):
        model = GPT(gcfg)
    model, opt = infinity.initialize(model, offload_config(spec, rank, world),
                                     init_fn=lambda m: gpt_init_(m, gcfg))
    engine = infinity.engine_of(model)
    try:
        with engine.gathered():
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
        tied = model.lm_head.weight is model.transformer.wte.weight
        ids = global_batch(0, spec["batch"]).chunk(world)[rank]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    finally:
        engine.close()
    return {"params": params, "tied": tied}


def meta_reference(seed: int = 0) -> dict:
    from infinity.models import GPT, GPTConfig
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ))
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}
