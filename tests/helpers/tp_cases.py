"""Rank-side cases for ZeRO x tensor parallelism (tests/parallel/test_tensor_parallel.py).

Each dp row (the ``tp`` ranks sharing a dp rank) trains on the same share of
the global batch: micro-batch ``dp_rank`` of ``dp`` chunks, so the dp rows
together see the whole batch the single-process reference trains on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_cases import _loss, build_model, config_for, global_batch, param_groups


class _UpDown(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class MLPStack(torch.nn.Module):
    """A model no default plan knows: a user plan splits its up / down layers."""

    def __init__(self, width: int = 32):
        super().__init__()
        from zero_cases import VOCAB
        self.emb = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(_UpDown(width) for _ in range(2))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels=None):
        from zero_cases import VOCAB, Out
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return Out(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits)


def build_tp_model(kind: str, seed: int = 0):
    if kind == "mlp_stack":
        torch.manual_seed(seed)
        return MLPStack()
    return build_model(kind, seed)


def tp_config(spec: dict) -> dict:
    cfg = config_for(spec)
    cfg["parallel"] = {"tensor": spec["tp"], "sequence": bool(spec.get("sp"))}
    if "initial_loss_scale" in spec:
        cfg["precision"]["initial_loss_scale"] = spec["initial_loss_scale"]
    if spec.get("nvme"):
        cfg["offload"] = {"optimizer": "nvme", "params": "nvme"}
        cfg["tiers"] = {"nvme_path": spec["nvme"]}
    if spec.get("host"):
        cfg["offload"] = {"optimizer": "host"}
        cfg["optimizer"]["update_at"] = "auto" if spec.get("overlap") else "step"
    if spec.get("activations"):   # {"activation_checkpointing": ..., "activation_offload": ..., "nvme_path": ...}
        act = dict(spec["activations"])
        cfg.setdefault("tiers", {})["nvme_path"] = act.pop("nvme_path")
        cfg["zero"].update(act)
    return cfg


def full_params(model, engine) -> dict | None:
    """Every parameter whole (tp slices assembled), on world rank 0; None elsewhere."""
    from infinity.parallel.tensor_parallel import assemble
    with engine.gathered():
        local = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    tp = engine.tp
    if tp is None:
        return local if engine.world_rank == 0 else None
    every = [None] * tp.size
    dist.all_gather_object(every, local, group=tp.coll.group)
    if engine.world_rank != 0:
        return None
    return {n: (assemble([e[n] for e in every], tp.spec(n)) if tp.spec(n) else local[n]) for n in local}


def train_tp_case(spec: dict) -> dict:
    """Train the spec; world rank 0 returns losses, norms, full params, and per-step stats."""
    import infinity
    from infinity.zero import activations

    if "activation_min_bytes" in spec:   # the test's activations are small: let every one of them move
        before, activations.MIN_BYTES = activations.MIN_BYTES, spec["activation_min_bytes"]
        try:
            return train_tp_case({k: v for k, v in spec.items() if k != "activation_min_bytes"})
        finally:
            activations.MIN_BYTES = before

    model = build_tp_model(spec["model"], spec.get("seed", 0))
    model, opt = infinity.initialize(model, tp_config(spec), params=param_groups(model, spec),
                                     tp_plan=spec.get("plan"))
    engine = infinity.engine_of(model)
    dp, dp_rank = engine.world_size, engine.rank
    losses, norms, stats = [], [], []
    for step in range(spec["steps"]):
        ids = global_batch(step, spec["batch"]).chunk(dp)[dp_rank]
        loss = _loss(model, ids)
        loss.backward()
        total = loss.detach().float().clone()
        if dp > 1:   # mean over dp rows (not through the engine's collectives: they count its bytes)
            dist.all_reduce(total, group=engine.coll.group)
            total /= dp
        losses.append(total.item())
        if spec.get("clip"):
            norms.append(float(opt.clip_grad_norm_(spec["clip"])))
        opt.step()
        opt.zero_grad()
        stats.append(engine.stats.last_step)
    params = full_params(model, engine)
    # replicated parameters must stay bitwise equal on every tp rank (their gradients are equal)
    replicated_equal = True
    if engine.tp is not None:
        with engine.gathered():
            rep = {n: p.detach().clone() for n, p in model.named_parameters() if engine.tp.spec(n) is None}
        every = [None] * engine.tp.size
        dist.all_gather_object(every, rep, group=engine.tp.coll.group)
        replicated_equal = all(torch.equal(e[n], rep[n]) for e in every for n in rep)
    resident = engine.resident_bytes()
    out = {"losses": losses, "norms": norms, "params": params, "stats": stats, "replicated_equal": replicated_equal,
           "activations": dict(engine.activations.stats) if engine.activations is not None else None,
           "resident": resident, "psi": engine.padded_numel, "dp": dp, "tp": engine.tp.size if engine.tp else 1,
           "root_psi": sum(u.padded_numel for u in engine.units if u.is_root), "skipped": opt.skipped_steps}
    engine.close()
    return out


def many_tp(specs: list) -> list:
    return [train_tp_case(s) for s in specs]


def error_tp_case(spec: dict) -> str:
    import infinity
    try:
        model = build_model(spec["model"])
        infinity.initialize(model, tp_config(spec), tp_plan=spec.get("plan"))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def tp_segment(spec: dict, load_dir: str | None, save_dir: str, start: int, stop: int) -> dict:
    """Build at the spec's tp (and this world's dp), load ``load_dir`` if given, train steps [start, stop),
    save into ``save_dir``; world rank 0 returns the losses, the saved path and the full parameters."""
    import infinity
    from infinity.checkpoint import load_checkpoint, save_checkpoint

    # a load starts from another init: everything must come from the checkpoint
    model = build_model(spec["model"], seed=123 if load_dir else spec.get("seed", 0))
    model, opt = infinity.initialize(model, tp_config(spec))
    engine = infinity.engine_of(model)
    if load_dir is not None:
        load_checkpoint(load_dir, model, opt)
    dp, dp_rank = engine.world_size, engine.rank
    losses = []
    for step in range(start, stop):
        loss = _loss(model, global_batch(step, spec["batch"]).chunk(dp)[dp_rank])
        loss.backward()
        total = loss.detach().float().clone()
        if dp > 1:
            dist.all_reduce(total, group=engine.coll.group)
            total /= dp
        losses.append(total.item())
        opt.step()
        opt.zero_grad()
    path = save_checkpoint(save_dir, model, opt)
    params = full_params(model, engine)
    engine.close()
    return {"losses": losses, "path": str(path), "params": params}
