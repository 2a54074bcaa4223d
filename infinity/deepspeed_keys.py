"""Every DeepSpeed ``ds_config.json`` key infinity knows, and its fate here: :data:`KEYS`.

One :class:`DeepSpeedKey` a key: it **maps** to the infinity key that means the same, is
**sized here** (a knob of DeepSpeed's own machinery that infinity sizes from its own config),
is **refused** unless its value is infinity's behaviour already, or is a **section** of other
keys. :mod:`infinity.deepspeed_config` checks a file against the table and reads it;
:func:`mapping_table` renders the table as the migration table of
docs/migrating-from-deepspeed.md (``python -m infinity.deepspeed_config`` prints it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["DeepSpeedKey", "KEYS", "MAPS", "SIZED", "REFUSED", "SECTION", "mapping_table"]

MAPS, SIZED, REFUSED, SECTION = "maps", "sized here", "refused", "section"


@dataclass(frozen=True)
class DeepSpeedKey:
    """One DeepSpeed key: its fate (maps / sized here / refused / section), the infinity key it becomes,
    how (or why not), and for a refused key the values that are infinity's behaviour already."""

    path: str
    fate: str
    infinity: str = ""
    note: str = ""
    accepted: tuple = ()


def _k(path, fate, infinity="", note="", accepted=()):
    return DeepSpeedKey(path, fate, infinity, note, accepted)


_STAGE3_SIZE = "elements x the parameter dtype's bytes (2 for bf16/fp16/auto, 4 for fp32); auto: infinity's"
_SAVE_WEIGHTS = ("InfinityTrainer.save_model always writes the consolidated weights, streamed unit by unit "
                 "(never gathered whole)")

KEYS: dict = {k.path: k for k in (
    # ---- ZeRO
    _k("zero_optimization", SECTION, note="absent: stage 0 (DDP), as DeepSpeed"),
    _k("zero_optimization.stage", MAPS, "zero.stage", "the same stages 0-3"),
    _k("zero_optimization.offload_param", SECTION, note="stage 3"),
    _k("zero_optimization.offload_param.device", MAPS, "offload.params", "none / cpu / nvme -> none / host / nvme"),
    _k("zero_optimization.offload_param.nvme_path", MAPS, "tiers.nvme_path",
       "one swap directory for every NVMe-homed shard (offload_optimizer's must be the same)"),
    _k("zero_optimization.offload_param.pin_memory", SIZED, note="the host tier's buffers are page-locked whenever "
       "a CUDA device computes, at exactly their size; nothing is pinned on a CPU"),
    _k("zero_optimization.offload_param.buffer_count", SIZED, note="staging for parameter reads is sized by "
       "prefetch.bytes and tiers.host_bytes"),
    _k("zero_optimization.offload_param.buffer_size", SIZED, note="staging for parameter reads is sized by "
       "prefetch.bytes and tiers.host_bytes"),
    _k("zero_optimization.offload_param.max_in_cpu", SIZED, note="NVMe-homed chunks kept in host memory are "
       "offload.host_resident_bytes (auto: what tiers.host_bytes holds beyond the step's working room)"),
    _k("zero_optimization.offload_optimizer", SECTION, note="stages 1-3"),
    _k("zero_optimization.offload_optimizer.device", MAPS, "offload.optimizer, offload.grads, "
       "optimizer.update_at", "none / cpu / nvme -> none / host / nvme, for the optimizer states and (stage "
       ">= 2) the reduced gradients the CPU Adam reads, as DeepSpeed keeps them beside the states; stage >= 2 also "
       "overlaps each unit's update with compute (exact: bitwise the update after backward)"),
    _k("zero_optimization.offload_optimizer.nvme_path", MAPS, "tiers.nvme_path", "as offload_param.nvme_path"),
    _k("zero_optimization.offload_optimizer.pin_memory", SIZED, note="the host tier's buffers are page-locked "
       "whenever a CUDA device computes, at exactly their size; nothing is pinned on a CPU"),
    _k("zero_optimization.offload_optimizer.buffer_count", SIZED, note="the update pipeline holds at most 3 jobs of "
       "offload.chunk_bytes each"),
    _k("zero_optimization.offload_optimizer.pipeline_read", SIZED, note="the optimizer's reads, update and "
       "write-backs are always pipelined, one job ahead"),
    _k("zero_optimization.offload_optimizer.pipeline_write", SIZED, note="the optimizer's reads, update and "
       "write-backs are always pipelined, one job ahead"),
    _k("zero_optimization.offload_optimizer.fast_init", SIZED, note="the optimizer states are created in their "
       "home tier, unit by unit, at initialize"),
    _k("zero_optimization.offload_optimizer.ratio", REFUSED, note="each tensor class has one home tier; a partial "
       "optimizer offload is not supported (set 1.0)", accepted=(1, 1.0)),
    _k("zero_optimization.overlap_comm", SIZED, note="each unit's gradients are reduced as its backward ends, and the "
       "offloaded update overlaps compute (optimizer.update_at auto)"),
    _k("zero_optimization.contiguous_gradients", SIZED, note="gradients always live in one flat shard per unit"),
    _k("zero_optimization.reduce_scatter", SIZED, note="stages 2-3 reduce-scatter each unit's gradients"),
    _k("zero_optimization.allgather_partitions", SIZED, note="parameters are all-gathered one unit at a time"),
    _k("zero_optimization.reduce_bucket_size", SIZED, note="one collective per unit (stage 0: zero.bucket_bytes)"),
    _k("zero_optimization.allgather_bucket_size", SIZED, note="one collective per unit"),
    _k("zero_optimization.round_robin_gradients", SIZED, note="one collective per unit"),
    _k("zero_optimization.sub_group_size", SIZED, note="each unit's optimizer work is cut into jobs of "
       "offload.chunk_bytes"),
    _k("zero_optimization.stage3_prefetch_bucket_size", MAPS, "prefetch.bytes", _STAGE3_SIZE),
    _k("zero_optimization.stage3_max_live_parameters", MAPS, "prefetch.max_live_bytes",
       _STAGE3_SIZE + "; 0 is refused (the unit in use and the root stay gathered)"),
    _k("zero_optimization.stage3_max_reuse_distance", SIZED, note="units gathered ahead follow the recorded order "
       "within prefetch.max_live_bytes"),
    _k("zero_optimization.stage3_param_persistence_threshold", SIZED, note="small parameters are flattened into "
       "their unit's shard; the root unit stays gathered through backward"),
    _k("zero_optimization.stage3_gather_16bit_weights_on_model_save", SIZED, note=_SAVE_WEIGHTS),
    _k("zero_optimization.stage3_gather_fp16_weights_on_model_save", SIZED, note=_SAVE_WEIGHTS),
    _k("zero_optimization.stage3_module_granularity_threshold", SIZED, note="units are zero.unit_classes (default: "
       "the children of the largest ModuleList)"),
    _k("zero_optimization.elastic_checkpoint", SIZED, note="checkpoints load at any world size and stage"),
    _k("zero_optimization.load_from_fp32_weights", SIZED, note="checkpoints always hold the fp32 master"),
    _k("zero_optimization.ignore_unused_parameters", SIZED, note="a parameter without a gradient keeps a zero one"),
    _k("zero_optimization.memory_efficient_linear", SIZED, note="no linear layer is replaced"),
    _k("zero_optimization.zero_hpz_partition_size", MAPS, "zeropp.hierarchical_partition, zeropp.ranks_per_node",
       "n > 1: hpZ with secondary shards over n ranks"),
    _k("zero_optimization.zero_quantized_weights", MAPS, "zeropp.quantize_weights", "qwZ"),
    _k("zero_optimization.zero_quantized_gradients", MAPS, "zeropp.quantize_grads", "qgZ"),
    _k("zero_optimization.zero_quantized_nontrainable_weights", REFUSED, note="frozen parameters are kept in their "
       "own dtype", accepted=(False,)),
    _k("zero_optimization.mics_shard_size", REFUSED, note="MiCS shard groups are not supported; parameters shard "
       "over every data-parallel rank", accepted=(-1,)),
    # ---- async I/O
    _k("aio", SECTION, note="NVMe reads and writes"),
    _k("aio.block_size", MAPS, "io.block_bytes", "bytes per request piece (a multiple of 4096)"),
    _k("aio.queue_depth", MAPS, "io.queue_depth, io.threads", "queue_depth x intra_op_parallelism: the requests "
       "in flight the disk sees; infinity's workers block in pread/pwrite, one thread per request in flight"),
    _k("aio.intra_op_parallelism", MAPS, "io.queue_depth, io.threads", "see aio.queue_depth"),
    _k("aio.thread_count", MAPS, "io.queue_depth, io.threads", "DeepSpeed's older name of intra_op_parallelism"),
    _k("aio.single_submit", SIZED, note="each worker submits its own pieces"),
    _k("aio.overlap_events", SIZED, note="completions are futures, waited for only where needed"),
    _k("aio.use_gds", REFUSED, note="NVMe data moves through host memory (no GPUDirect Storage)", accepted=(False,)),
    # ---- precision
    _k("bf16", SECTION),
    _k("bf16.enabled", MAPS, "precision.param_dtype", "true: bf16 (fp32 master); auto (or no bf16 section under a "
       "Trainer): the Trainer's bf16 argument; auto without a Trainer: param_dtype auto (measured); neither bf16 "
       "nor fp16: fp32"),
    _k("bf16.immediate_grad_update", SIZED, note="gradients are folded into their shard as each unit's backward ends"),
    _k("fp16", SECTION),
    _k("fp16.enabled", MAPS, "precision.param_dtype", "true: fp16 with loss scaling (fp32 master); auto: as "
       "bf16.enabled"),
    _k("fp16.loss_scale", MAPS, "precision.loss_scale", "0: dynamic; > 0: that fixed scale"),
    _k("fp16.initial_scale_power", MAPS, "precision.initial_loss_scale", "p: 2**p"),
    _k("fp16.loss_scale_window", MAPS, "precision.loss_scale_window", "the same: good steps before the scale "
       "doubles"),
    _k("fp16.hysteresis", SIZED, note="the dynamic scale halves at every overflowing step (hysteresis 1); a delayed "
       "halving only changes how soon the scale falls, each overflowing step is skipped either way"),
    _k("fp16.consecutive_hysteresis", SIZED, note="the dynamic scale halves at every overflowing step"),
    _k("fp16.min_loss_scale", REFUSED, note="the dynamic scale floors at 1 (set 1)", accepted=(1, 1.0)),
    _k("fp16.auto_cast", SIZED, note="forward runs in the parameters' dtype; inputs are the model's business"),
    _k("fp16.fp16_master_weights_and_grads", REFUSED, note="the master is fp32 (or its exact 16-bit remainder, "
       "optimizer.master)", accepted=(False,)),
    _k("communication_data_type", MAPS, "precision.reduce_dtype", "fp32 / fp16 / bf16; absent: fp32 (DeepSpeed "
       "reduces in the 16-bit dtype by default)"),
    _k("amp", REFUSED, note="apex AMP is not supported; use bf16 or fp16", accepted=({"enabled": False},)),
    # ---- optimizer, schedule, clipping, batch
    _k("optimizer", SECTION, note="absent: infinity's AdamW defaults (or your param groups')"),
    _k("optimizer.type", MAPS, "(infinity's AdamW)", "Adam or AdamW (decoupled weight decay, DeepSpeed's adam_w_mode "
       "default); any other optimizer is refused"),
    _k("optimizer.params", SECTION),
    _k("optimizer.params.lr", MAPS, "optimizer.lr", "auto: the Trainer's learning_rate"),
    _k("optimizer.params.betas", MAPS, "optimizer.betas", "auto: the Trainer's adam_beta1, adam_beta2"),
    _k("optimizer.params.eps", MAPS, "optimizer.eps", "auto: the Trainer's adam_epsilon"),
    _k("optimizer.params.weight_decay", MAPS, "optimizer.weight_decay", "auto: the Trainer's weight_decay"),
    _k("optimizer.params.adam_w_mode", REFUSED, note="weight decay is decoupled (AdamW); L2-coupled Adam is not "
       "supported", accepted=(True,)),
    _k("optimizer.params.bias_correction", REFUSED, note="Adam's bias correction is always applied",
       accepted=(True,)),
    _k("optimizer.params.amsgrad", REFUSED, note="AMSGrad is not supported", accepted=(False,)),
    _k("optimizer.params.torch_adam", SIZED, note="the update is infinity's CPU/device AdamW over flat shards"),
    _k("optimizer.params.fused", SIZED, note="the update is infinity's CPU/device AdamW over flat shards"),
    _k("scheduler", SECTION, note="the Trainer then builds infinity's schedule instead of lr_scheduler_type"),
    _k("scheduler.type", MAPS, "schedule.lr_schedule", "WarmupLR -> constant, WarmupDecayLR -> linear, "
       "WarmupCosineLR -> cosine, each after warmup_num_steps of warmup; the warmup ramp is infinity's, linear "
       "from lr/N at the first step (DeepSpeed's starts at warmup_min_lr along a log or linear curve; "
       "WarmupCosineLR's decay is one step ahead of infinity's); others are refused"),
    _k("scheduler.params", SECTION),
    _k("scheduler.params.warmup_num_steps", MAPS, "schedule.warmup_steps", "auto: the Trainer's warmup steps"),
    _k("scheduler.params.warmup_max_lr", MAPS, "optimizer.lr", "the peak lr (WarmupLR, WarmupDecayLR); auto: the "
       "Trainer's learning_rate"),
    _k("scheduler.params.warmup_min_lr", MAPS, "schedule.min_lr", "WarmupDecayLR's end; the ramp's start is "
       "infinity's"),
    _k("scheduler.params.total_num_steps", MAPS, "schedule.total_steps", "auto: the run's steps"),
    _k("scheduler.params.cos_min_ratio", MAPS, "schedule.min_lr", "WarmupCosineLR: cos_min_ratio x lr"),
    _k("scheduler.params.warmup_min_ratio", SIZED, note="the warmup ramp is infinity's (see scheduler.type)"),
    _k("scheduler.params.warmup_type", SIZED, note="the warmup ramp is infinity's (see scheduler.type)"),
    _k("scheduler.params.last_batch_iteration", REFUSED, note="a resumed run's schedule comes from its checkpoint",
       accepted=(-1,)),
    _k("gradient_clipping", MAPS, "schedule.clip_grad_norm", "0: none; auto: the Trainer's max_grad_norm"),
    _k("gradient_accumulation_steps", MAPS, "schedule.accum_steps", "auto: the Trainer's gradient_accumulation_steps"),
    _k("train_micro_batch_size_per_gpu", MAPS, "(the data loader's batch)", "checked against the Trainer's "
       "per_device_train_batch_size; infinity train: --batch-size"),
    _k("train_batch_size", MAPS, "(the data loader's batch)", "checked against the Trainer's world size x "
       "per-device batch x gradient_accumulation_steps; infinity train: --batch-size"),
    _k("activation_checkpointing", SECTION, note="configures DeepSpeed's checkpointing API; infinity checkpoints "
       "units by zero.activation_checkpointing, which the Trainer's gradient_checkpointing sets"),
    _k("activation_checkpointing.partition_activations", SIZED, note="activations are not split over "
       "tensor-parallel ranks"),
    _k("activation_checkpointing.cpu_checkpointing", MAPS, "zero.activation_offload",
       "true -> host (with zero.activation_checkpointing: each checkpointed unit's input waits in host memory "
       "until its backward); under a Trainer it needs gradient_checkpointing, as DeepSpeed's does"),
    _k("activation_checkpointing.contiguous_memory_optimization", SIZED, note="torch's allocator holds them"),
    _k("activation_checkpointing.number_checkpoints", SIZED, note="one checkpoint per unit"),
    _k("activation_checkpointing.synchronize_checkpoint_boundary", SIZED, note="no synchronization is needed"),
    _k("activation_checkpointing.profile", SIZED, note="engine.stats times the step's phases"),
    # ---- DeepSpeed's own logging and plumbing
    _k("steps_per_print", SIZED, note="infinity train's --metrics and engine.stats report each step"),
    _k("wall_clock_breakdown", SIZED, note="engine.stats times the step's phases"),
    _k("memory_breakdown", SIZED, note="engine.stats has the step's memory"),
    _k("dump_state", SIZED, note="infinity train --print-config shows the config"),
    _k("flops_profiler", SIZED, note="DeepSpeed's profiler"),
    _k("tensorboard", SIZED, note="DeepSpeed's monitor"),
    _k("wandb", SIZED, note="DeepSpeed's monitor"),
    _k("csv_monitor", SIZED, note="DeepSpeed's monitor"),
    _k("comms_logger", SIZED, note="engine.stats counts the bytes of each collective"),
    _k("checkpoint", SIZED, note="checkpoints are sharded, each rank writing its own shards atomically"),
    _k("prescale_gradients", SIZED, note="gradients are averaged in precision.reduce_dtype"),
    _k("gradient_predivide_factor", SIZED, note="gradients are averaged in precision.reduce_dtype"),
    _k("zero_allow_untested_optimizer", SIZED, note="the optimizer is infinity's AdamW"),
    _k("zero_force_ds_cpu_optimizer", SIZED, note="the optimizer is infinity's AdamW"),
)}


def mapping_table() -> str:
    """The migration table of docs/migrating-from-deepspeed.md (markdown), one row per DeepSpeed key of :data:`KEYS`."""
    rows = ["| DeepSpeed key | fate | infinity | how, or why not |", "|---|---|---|---|"]
    for key in KEYS.values():
        if key.fate == SECTION and not key.note:
            continue
        fate = "section" if key.fate == SECTION else key.fate
        if key.fate == REFUSED:
            shown = [v for i, v in enumerate(key.accepted) if v not in key.accepted[:i]]   # 1 and 1.0 once
            fate += " unless " + " / ".join(json.dumps(v) for v in shown)
        target = key.infinity
        if target and not target.startswith("("):
            target = ", ".join(f"`{name}`" for name in target.split(", "))
        rows.append(f"| `{key.path}` | {fate} | {target} | {key.note} |")
    return "\n".join(rows)
