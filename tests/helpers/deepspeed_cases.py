"""DeepSpeed configs as people write them, each with the infinity YAML that means the same, and a rank-side
training run that takes either.

The four configs are written here from DeepSpeed's documented keys: the ZeRO-3 + NVMe
(ZeRO-Infinity) and ZeRO-3 + CPU offload examples of its tutorials and config reference, and
the ``"auto"`` ZeRO-2 and ZeRO-3 templates of transformers' DeepSpeed docs. ``SWAP`` in a config
or a YAML text stands for the test's swap directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from zero_cases import backward_on_share, build_model, global_batch

SWAP = "@SWAP@"

_AUTO_FP16 = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
              "hysteresis": 2, "min_loss_scale": 1}
_AUTO_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
_AUTO_WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                               "warmup_num_steps": "auto"}}
_AUTO_BATCH = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
               "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}

DEEPSPEED = {
    # ZeRO-Infinity: parameters and optimizer states on NVMe, aio tuned for the disk
    "zero3-nvme": {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7, "sub_group_size": 1e9,
            "offload_optimizer": {"device": "nvme", "nvme_path": SWAP, "pin_memory": True, "buffer_count": 4,
                                  "fast_init": False},
            "offload_param": {"device": "nvme", "nvme_path": SWAP, "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 1e8, "max_in_cpu": 1e9}},
        "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    },
    # ZeRO-3 Offload: parameters and optimizer states in host memory, fp16 with dynamic loss scaling
    "zero3-cpu": {
        "train_batch_size": 8,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                 "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 2, "total_num_steps": 6}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 1e6,
            "stage3_prefetch_bucket_size": 1e6, "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True},
    },
    # transformers' "auto" ZeRO-2 template: optimizer states offloaded to the CPU
    "trainer-zero2": {
        "fp16": _AUTO_FP16, "optimizer": _AUTO_ADAMW, "scheduler": _AUTO_WARMUP,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
        **_AUTO_BATCH,
    },
    # transformers' "auto" ZeRO-3 template: parameters and optimizer states offloaded to the CPU
    "trainer-zero3": {
        "fp16": _AUTO_FP16, "bf16": {"enabled": "auto"}, "optimizer": _AUTO_ADAMW, "scheduler": _AUTO_WARMUP,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                              "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True},
        **_AUTO_BATCH,
    },
}

# What each means, written as an infinity user would (outside a Trainer "auto" keeps infinity's own values)
EQUIVALENT_YAML = {
    "zero3-nvme": """
zero: {stage: 3}
precision: {param_dtype: bf16}
optimizer: {lr: 1.0e-3, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.01, update_at: auto}
offload: {optimizer: nvme, params: nvme, grads: nvme}
tiers: {nvme_path: "@SWAP@"}
prefetch: {bytes: 20000000, max_live_bytes: 2000000000}   # elements x 2 bytes (bf16)
io: {block_bytes: 256KiB, queue_depth: 32, threads: 32}
schedule: {clip_grad_norm: 1.0, accum_steps: 1}
""",
    "zero3-cpu": """
zero: {stage: 3}
precision: {param_dtype: fp16, loss_scale: dynamic, initial_loss_scale: 4096, loss_scale_window: 500}
optimizer: {lr: 1.0e-3, betas: [0.8, 0.999], eps: 1.0e-8, weight_decay: 3.0e-7, update_at: auto}
offload: {optimizer: host, params: host, grads: host}
prefetch: {bytes: 2000000, max_live_bytes: 2000000000}
schedule: {lr_schedule: linear, warmup_steps: 2, min_lr: 0.0, total_steps: 6, clip_grad_norm: 1.0}
""",
    "trainer-zero2": """
zero: {stage: 2}
precision: {param_dtype: auto}
optimizer: {update_at: auto}
offload: {optimizer: host, grads: host}
schedule: {lr_schedule: constant}
""",
    "trainer-zero3": """
zero: {stage: 3}
precision: {param_dtype: auto}
optimizer: {update_at: auto}
offload: {optimizer: host, params: host, grads: host}
prefetch: {max_live_bytes: 2000000000}
schedule: {lr_schedule: constant}
""",
}


def _swap(value, swap_dir: str):
    if isinstance(value, dict):
        return {k: _swap(v, swap_dir) for k, v in value.items()}
    return swap_dir if value == SWAP else value


def deepspeed_config(name: str, swap_dir: str) -> dict:
    return _swap(DEEPSPEED[name], swap_dir)


def write_pair(name: str, directory: Path, swap_dir: str) -> tuple:
    """``(ds_config.json, equivalent.yaml)`` written into ``directory``."""
    ds = directory / f"{name}.json"
    ds.write_text(json.dumps(deepspeed_config(name, swap_dir), indent=2))
    yml = directory / f"{name}.yaml"
    yml.write_text(EQUIVALENT_YAML[name].replace(SWAP, swap_dir))
    return ds, yml


def train_run(config_path: str, steps: int = 4, batch: int = 8) -> dict:
    """Train the tests' small GPT on this rank's share of each global batch, with the config's schedule,
    clipping and accumulation; every rank returns its losses and rank 0 the trained parameters."""
    import infinity
    from infinity.config import Config
    from infinity.train.schedule import build_lr_scheduler

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    config = Config.load(config_path)
    model = build_model("gpt")
    model, optimizer = infinity.initialize(model, config_path)
    engine = infinity.engine_of(model)
    try:
        scheduler = build_lr_scheduler(optimizer, config.schedule, total_steps=steps)
        losses, lrs = [], []
        for step in range(steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            losses.append(backward_on_share(model, global_batch(step, batch), rank, world,
                                            config.schedule.accum_steps))
            if config.schedule.clip_grad_norm is not None:
                optimizer.clip_grad_norm_(config.schedule.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        with engine.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None
        return {"losses": losses, "lrs": lrs, "params": params}
    finally:
        engine.close()
