"""Rank-side cases for tests/zero/test_stored_formats.py: train a spec with or without offload.

A spec with an ``offload`` entry runs through :func:`offload_cases.train_case` (budgets, swap
directory), one without through :func:`zero_cases.train_case`; ``spec["optimizer"]`` carries the
stored formats (``master``, ``moments``) and ``update_at``. Each result also carries the
element count of this rank's unit shards, for byte accounting.
"""

from __future__ import annotations

import offload_cases
import zero_cases


def train(spec: dict) -> dict:
    return offload_cases.train_case(spec) if spec.get("offload") else zero_cases.train_case(spec)


def many(specs: list) -> list:
    return [train(s) for s in specs]


def resumed(spec: dict) -> dict:
    """Train ``spec["save_at"]`` steps with ``spec["optimizer"]``, save a checkpoint, load it into a new
    engine with ``spec["load_optimizer"]`` (another stored format) and train to ``spec["steps"]``; rank 0
    returns the losses of every step and the final parameters."""
    import os

    import torch.distributed as dist

    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    ckpt = os.path.join(spec["tmp"], "ckpt")
    losses = []

    def engine_for(optimizer: dict):
        s = dict(spec, optimizer=optimizer)
        model = zero_cases.build_model(s["model"], s.get("seed", 0))
        cfg = offload_cases.offload_config(s, rank, world) if s.get("offload") else zero_cases.config_for(s)
        return (model, *infinity.initialize(model, cfg, params=zero_cases.param_groups(model, s))[1:])

    def steps(model, opt, first, last):
        for step in range(first, last):
            losses.append(zero_cases.backward_on_share(model, zero_cases.global_batch(step, spec["batch"]),
                                                       rank, world))
            opt.step()
            opt.zero_grad()

    def moments(model) -> list:
        from infinity.zero.units import TensorClass
        return [u.shard.read(TensorClass.EXP_AVG_SQ).clone() for u in infinity.engine_of(model).units]

    model, opt = engine_for(spec["optimizer"])
    steps(model, opt, 0, spec["save_at"])
    saved = moments(model)
    infinity.save_checkpoint(ckpt, model, opt)
    infinity.engine_of(model).close()
    model, opt = engine_for(spec["load_optimizer"])
    infinity.load_checkpoint(ckpt, model, opt)
    loaded = moments(model)
    steps(model, opt, spec["save_at"], spec["steps"])
    engine = infinity.engine_of(model)
    with engine.gathered():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
    engine.close()
    # this rank's second moments as the first engine kept them at the save, and as the second loaded them
    return {"losses": losses, "params": params, "saved_moments": saved, "loaded_moments": loaded}


def many_resumed(specs: list) -> list:
    return [resumed(s) for s in specs]
