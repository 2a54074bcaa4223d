"""Rank-side cases: a DeepSpeed user's Trainer run on infinity, from a local checkpoint.

The checkpoint is the tiny GPT-2 of :mod:`hf_trainer_cases` saved with ``save_pretrained``
(safetensors, nothing downloaded). The plain run loads it with
``AutoModelForCausalLM.from_pretrained`` and trains with ``transformers.Trainer`` (DDP at two
ranks); ours builds it with :func:`infinity.integrations.transformers.from_pretrained` (on meta,
loaded unit by unit into the tiers when the trainer initializes it) and trains with
``InfinityTrainer`` under the DeepSpeed config a ZeRO-Infinity user brings (``"auto"`` values,
parameters and optimizer states on NVMe). Same arguments, same data order.
"""

from __future__ import annotations

import os

import torch

import hf_trainer_cases as hc


def save_checkpoint(directory: str) -> str:
    """The tiny GPT-2 (seeded, dropout off) as a local checkpoint directory."""
    hc.tiny_gpt2().save_pretrained(directory)
    return directory


def deepspeed_nvme(swap_dir: str) -> dict:
    """A ZeRO-Infinity config written for the Trainer: everything it can take from the arguments is "auto"."""
    return {
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True},
            "offload_param": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 1e8, "max_in_cpu": 1e9}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 2000, "wall_clock_breakdown": False,
    }


def fine_tune(kind: str, checkpoint: str, out_dir: str, config=None, steps: int = 4, **overrides) -> dict:
    """Fine-tune ``checkpoint`` with the plain Trainer (``kind`` "plain") or ``InfinityTrainer`` on
    ``from_pretrained(checkpoint, config)``; the per-micro-batch losses, logged lrs and gradient norms, the
    trained model's logits on a probe batch, and (ours) the engine's config and the Trainer's own args."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments, from_pretrained

    if hc.world_size() > 1:   # accelerate reads the launcher's variables even when the group is up
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    arguments = hc.trainer_arguments(out_dir, steps, **overrides)
    data = hc.TokenWindows(96, seed=0)
    if kind == "plain":
        trainer = hc._recording(Trainer)(model=AutoModelForCausalLM.from_pretrained(checkpoint),
                                         args=TrainingArguments(**arguments), train_dataset=data)
    else:
        trainer = hc._recording(InfinityTrainer)(model=from_pretrained(checkpoint, config),
                                                 args=InfinityTrainingArguments(**arguments), train_dataset=data)
    trainer.recorded = []
    try:
        trainer.train()
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(hc.probe_ids()).logits.float()
        out = {"losses": trainer.recorded, "logits": logits,
               "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
               "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}
        if kind != "plain":
            from infinity.initialization import engine_of
            engine = engine_of(trainer.model)
            out.update(config=engine.config.to_dict(), trainer_bf16=trainer.args.bf16,
                       mixed_precision=trainer.accelerator.mixed_precision,
                       moved_bytes=dict(engine.store.stats()["moved_bytes"]) if engine.store is not None else {})
        return out
    finally:
        hc._close(trainer)
