"""bf16-stored parameters computed in fp32 (``precision.compute_dtype: fp32``): the reference and the rank side.

The reference is plain PyTorch: an fp32 master trained by ``torch.optim.AdamW``, and forward/backward in
fp32 on a copy whose weights are the master rounded to bf16 (the rounding the stored parameter uses,
:func:`~infinity.optim.split_master.round_bf16_`) before every step.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import zero_cases
from zero_cases import RoundingDrift, backward_on_share, build_model, global_batch


def _round_into(master: torch.nn.Module, compute: torch.nn.Module) -> None:
    from infinity.optim.split_master import round_bf16_

    with torch.no_grad():
        for pm, pc in zip(master.parameters(), compute.parameters()):
            pc.copy_(round_bf16_(pm.detach().contiguous(), torch.empty_like(pm, dtype=torch.bfloat16)).float())


def reference_split(spec: dict) -> dict:
    """Losses and final (bf16-rounded) parameters of the plain-PyTorch run above, with ``param_tol``: what
    fp32 rounding alone can move the master (:class:`zero_cases.RoundingDrift`)."""
    torch.set_num_threads(1)
    master = build_model(spec["model"], spec.get("seed", 0))
    compute = copy.deepcopy(master)
    opt = torch.optim.AdamW(master.parameters(), lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    drift = RoundingDrift(master)
    _round_into(master, compute)
    init = {n: p.detach().clone() for n, p in compute.named_parameters()}
    losses = []
    for step in range(spec["steps"]):
        _round_into(master, compute)
        ids = global_batch(step, spec["batch"])
        loss = compute(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        for pm, pc in zip(master.parameters(), compute.parameters()):
            pm.grad, pc.grad = pc.grad, None
        opt.step()
        drift.after_step(opt, tokens=ids.numel())
        opt.zero_grad()
    _round_into(master, compute)
    return {"losses": losses, "norms": [], "init": init, "param_tol": drift.bound,
            "params": {n: p.detach().clone() for n, p in compute.named_parameters()}}


def split_config(spec: dict, rank: int) -> dict:
    cfg = zero_cases.config_for(dict(spec, dtype="bf16"))
    cfg["precision"]["compute_dtype"] = "fp32"
    cfg["optimizer"]["master"] = spec.get("master", "fp32")
    if spec.get("offload"):
        swap = os.path.join(spec["tmp"], f"rank{rank}")
        os.makedirs(swap, exist_ok=True)
        cfg["offload"] = {"params": "nvme", "optimizer": "nvme"}
        cfg["tiers"] = {"nvme_path": swap}
        cfg["optimizer"]["threads"] = 1
    return cfg


def train_split(spec: dict) -> dict:
    """Train with infinity at ``compute_dtype: fp32`` over bf16 parameters; rank 0 returns the parameters
    (fp32 views of the upcast units) and what the engine stores (dtypes)."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = build_model(spec["model"], spec.get("seed", 0))
    model, opt = infinity.initialize(model, split_config(spec, rank))
    engine = infinity.engine_of(model)
    losses = []
    try:
        for step in range(spec["steps"]):
            losses.append(backward_on_share(model, global_batch(step, spec["batch"]), rank, world))
            opt.step()
            opt.zero_grad()
        with engine.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None
        stored = {str(engine.units[0].full_param.dtype), str(engine.param_dtype)}
        compute = str(engine.compute_dtype)
    finally:
        engine.close()
    return {"losses": losses, "norms": [], "params": params, "stored": sorted(stored), "compute": compute,
            "config": engine.config.to_dict()["precision"]}


def auto_on_rank(spec: dict) -> dict:
    """``param_dtype: auto`` where each rank's probe says something else (``spec["rates"][rank]``): the
    dtypes each rank's engine runs in."""
    import infinity
    from infinity import precision

    rank = dist.get_rank()
    precision.cpu_rates = lambda shapes, dtypes=("fp32", "bf16"): (spec["rates"][rank], False)
    model = build_model("gpt", 0)
    model, _ = infinity.initialize(model, {"zero": {"stage": 3}, "precision": {"param_dtype": "auto"}})
    engine = infinity.engine_of(model)
    try:
        return engine.config.to_dict()["precision"]
    finally:
        engine.close()
