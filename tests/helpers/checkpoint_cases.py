"""Rank-side cases for tests/checkpoint/test_checkpoint.py (importable by the spawned ranks of :mod:`world`).

A *spec* is a zero_cases spec (model, stage, dtype, lr, batch, groups) plus
``save_at`` (steps before the checkpoint) and ``steps`` (total steps).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zero_cases
from zero_cases import build_model, config_for, global_batch, param_groups

LOGIT_IDS = torch.arange(2 * zero_cases.SEQ).reshape(2, zero_cases.SEQ) % zero_cases.VOCAB


def _rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build(spec: dict, seed: int | None = None):
    """Model and optimizer as the spec says; ``extras`` adds a buffer and a frozen parameter."""
    import infinity

    model = build_model(spec["model"], spec.get("seed", 0) if seed is None else seed)
    if spec.get("extras"):
        add_extras(model, seed or 0)
    groups = param_groups(model, spec)
    if groups:
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in groups]
    cfg = config_for(spec)
    if "offload" in spec:  # shards homed in the store (host / NVMe): the same save and load path must stream them
        from offload_cases import offload_config

        cfg = offload_config(spec, *_rank_world())
    if "loss_scale_window" in spec:  # fp16: a short window moves the scale every step, so its state matters
        cfg["precision"].update(loss_scale_window=spec["loss_scale_window"],
                                initial_loss_scale=spec["initial_loss_scale"])
    model, opt = infinity.initialize(model, cfg, params=groups)
    return model, opt, infinity.engine_of(model)


def add_extras(model, seed: int = 0):
    """A buffer and a frozen parameter on a cross_tied model; returns it."""
    model.register_buffer("position_scale", torch.linspace(0.5, 1.5, 8) + seed)
    model.blocks[1].norm.bias.requires_grad_(False)  # frozen: outside the units, saved with the extras
    return model


def train(model, opt, spec: dict, start: int, stop: int) -> list:
    rank, world = _rank_world()
    losses = []
    for step in range(start, stop):
        losses.append(zero_cases.backward_on_share(model, global_batch(step, spec["batch"]), rank, world))
        opt.step()
        opt.zero_grad()
    return losses


def full_state(model, engine) -> dict | None:
    """Rank 0: the model's whole state_dict (fp32 copies of trainable params); None elsewhere."""
    rank, _ = _rank_world()
    with engine.gathered():
        return {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else None


def logits(model, engine) -> torch.Tensor | None:
    rank, _ = _rank_world()
    was_training = model.training
    model.eval()
    with engine.gathered(), torch.no_grad():
        out = model(input_ids=LOGIT_IDS).logits.detach().clone()
    model.train(was_training)
    return out if rank == 0 else None


def run_and_save(spec: dict, root: str) -> dict:
    """Train ``save_at`` steps, save, draw from the RNG, train on to ``steps``: the uninterrupted run."""
    from infinity.checkpoint import save_checkpoint

    model, opt, engine = build(spec)
    losses = train(model, opt, spec, 0, spec["save_at"])
    at_save = full_state(model, engine)
    at_save_logits = logits(model, engine) if spec.get("logits") else None
    scale_at_save = engine.loss_scaler.scale if engine.loss_scaler else None
    nvme_bytes = engine.resident_bytes()["store"]["nvme"] if "offload" in spec else 0
    path = save_checkpoint(root, model, opt, keep_last=spec.get("keep_last"))
    draw = torch.rand(4)
    losses += train(model, opt, spec, spec["save_at"], spec["steps"])
    return {"path": str(path), "at_save": at_save, "at_save_logits": at_save_logits, "draw": draw,
            "losses": losses, "final": full_state(model, engine), "scale_at_save": scale_at_save,
            "nvme_bytes_at_save": nvme_bytes,
            "scale": engine.loss_scaler.scale if engine.loss_scaler else None}


def load_and_continue(spec: dict, root: str) -> dict:
    """Fresh model (another seed, so nothing is inherited by accident), load, draw, train to ``steps``."""
    from infinity.checkpoint import load_checkpoint

    model, opt, engine = build(spec, seed=99)
    info = load_checkpoint(root, model, opt)
    scale_loaded = engine.loss_scaler.scale if engine.loss_scaler else None
    draw = torch.rand(4)
    loaded = full_state(model, engine)
    losses = train(model, opt, spec, spec["save_at"], spec["steps"])
    return {"info": info, "draw": draw, "loaded": loaded, "losses": losses, "final": full_state(model, engine),
            "group_steps": list(opt.group_steps), "lr": [g["lr"] for g in opt.param_groups],
            "scale_loaded": scale_loaded, "skipped_steps": opt.skipped_steps,
            "scale": engine.loss_scaler.scale if engine.loss_scaler else None}


def many(fn_name: str, jobs: list) -> list:
    """Several (spec, root) jobs in one round trip."""
    fn = globals()[fn_name]
    return [fn(spec, root) for spec, root in jobs]


def load_error(spec: dict, root: str) -> str:
    """load_checkpoint expected to fail: the message (the world stays usable)."""
    from infinity.checkpoint import CheckpointError, load_checkpoint

    model, opt, _ = build(spec)
    try:
        load_checkpoint(root, model, opt)
    except CheckpointError as e:
        return str(e)
    return "no error"
