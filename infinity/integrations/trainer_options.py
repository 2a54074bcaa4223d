"""Which ``TrainingArguments`` and infinity config keys go together, and a one-line error for those that do not.

Who owns what, as in transformers' DeepSpeed integration (where ``"auto"`` config
values are filled from ``TrainingArguments`` and explicit ones that disagree are
an error):

- ``TrainingArguments`` own the optimizer's hyper-parameters (``learning_rate``,
  ``adam_beta1`` / ``adam_beta2``, ``adam_epsilon``, ``weight_decay``), the
  schedule (``lr_scheduler_type``, ``warmup_steps``, ...) and clipping
  (``max_grad_norm``) and accumulation (``gradient_accumulation_steps``: the config's
  ``schedule.clip_grad_norm`` / ``accum_steps`` are set from them, for the overlapped update). The config's ``optimizer.lr`` / ``betas`` / ``eps`` /
  ``weight_decay`` are overwritten with them where they are left at the
  config's defaults; a value set to something else that disagrees is refused,
  naming both. Any ``schedule`` key off its default is refused (the Trainer
  builds the schedule).
- The infinity config owns everything else: stage, offload, tiers, precision.
  So the Trainer's own precision (``fp16`` / ``bf16``, accelerate's
  ``mixed_precision``), activation checkpointing, ``torch_compile``, DeepSpeed,
  FSDP and ``DataParallel`` are refused, each naming what to use instead.
- A DeepSpeed config (:mod:`infinity.deepspeed_config`) is read as transformers
  reads one for its DeepSpeed integration: ``"auto"`` values come from the
  arguments (an explicit one that disagrees is refused), ``bf16`` / ``fp16`` and
  gradient checkpointing are taken over by the config (``"auto"`` precision
  follows them; checkpointing becomes ``zero.activation_checkpointing``), and a
  ``scheduler`` in it is the run's schedule instead of ``lr_scheduler_type``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from infinity.config import Config, ConfigError, OptimizerConfig, ScheduleConfig
from infinity.deepspeed_config import TrainerValues, is_deepspeed, read_deepspeed

__all__ = ["TrainerSetup", "load_trainer_config", "trainer_config", "check_arguments", "check_trainer_kwargs",
           "check_accelerator", "TORCH_ADAMW"]

# the Trainer's optim names that are torch.optim.AdamW, whose math ZeroAdamW reproduces
TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")


# TrainingArguments a DeepSpeed config takes over, as the Trainer's DeepSpeed integration does: its "auto"
# precision follows them and the engine computes in it (accelerate must not autocast), and gradient
# checkpointing becomes infinity's per-unit activation checkpointing (the model's own would run inside the units)
_TAKEN_BY_DEEPSPEED = {"bf16": False, "fp16": False, "bf16_full_eval": False, "fp16_full_eval": False,
                       "mixed_precision": "no", "gradient_checkpointing": False, "activation_checkpointing": False}


@dataclass(frozen=True)
class TrainerSetup:
    """The config a trainer runs with, the ``TrainingArguments`` the Trainer itself is given, and, for a DeepSpeed
    config with a ``scheduler``, that the config's schedule replaces ``lr_scheduler_type`` (its warmup
    ``"auto"``: the Trainer's warmup steps, known once the run's steps are)."""

    config: Config
    args: object
    deepspeed: bool = False
    schedule_from_config: bool = False
    auto_warmup: bool = False


def load_trainer_config(source, args) -> TrainerSetup:
    """``source`` (path, dict or Config) as a Trainer reads it. A DeepSpeed config's ``"auto"`` values are filled
    from ``args`` (an explicit value that disagrees is refused), and the Trainer is given a copy of ``args``
    without the flags the config took over (``bf16`` / ``fp16``, gradient checkpointing)."""
    raw = _raw(source)
    if not is_deepspeed(raw):
        return TrainerSetup(Config.load(source), args)
    where = f"{source}: " if isinstance(source, (str, Path)) else ""
    try:
        reading = read_deepspeed(raw, TrainerValues.from_training_arguments(args))
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None
    taken = {k: v for k, v in _TAKEN_BY_DEEPSPEED.items() if getattr(args, k, v) != v}
    if taken:
        args = copy.copy(args)
        for key, value in taken.items():
            setattr(args, key, value)
    # clipping and accumulation were checked against args above; trainer_config sets them from args
    config = reading.config.replace(schedule={"clip_grad_norm": None, "accum_steps": 1})
    return TrainerSetup(config, args, True, reading.scheduler, reading.auto_warmup)


def _raw(source):
    """The mapping behind ``source``: a dict, or a file's (JSON by its suffix, else YAML); None for a Config."""
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, Path)):
        return None
    path = Path(source)
    try:
        text = path.read_text()
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return None   # Config.load reports it, naming the file


def trainer_config(config: Config, args, schedule_from_config: bool = False) -> Config:
    """``config`` with its optimizer section taken from ``args``; raises on a value that disagrees.
    ``schedule_from_config``: the config's schedule is the run's (a DeepSpeed ``scheduler``), not refused."""
    defaults, ours = OptimizerConfig(), config.optimizer
    wanted = {"lr": ("learning_rate", float(args.learning_rate)),
              "betas": ("adam_beta1, adam_beta2", (float(args.adam_beta1), float(args.adam_beta2))),
              "eps": ("adam_epsilon", float(args.adam_epsilon)),
              "weight_decay": ("weight_decay", float(args.weight_decay))}
    for key, (arg, value) in wanted.items():
        mine = getattr(ours, key)
        if mine != getattr(defaults, key) and mine != value:
            raise ValueError(f"InfinityTrainer: infinity config optimizer.{key}={_show(mine)} disagrees with "
                             f"TrainingArguments {arg}={_show(value)}; the Trainer's arguments set it, so remove "
                             f"optimizer.{key} from the config or make the two equal")
    schedule_defaults = ScheduleConfig()
    owned = ("clip_grad_norm", "accum_steps") if schedule_from_config else \
        ("lr_schedule", "warmup_steps", "min_lr", "total_steps", "clip_grad_norm", "accum_steps")
    for key in owned:
        if getattr(config.schedule, key) != getattr(schedule_defaults, key):
            owner = {"clip_grad_norm": "max_grad_norm", "accum_steps": "gradient_accumulation_steps"}.get(
                key, "lr_scheduler_type, warmup_steps and max_steps")
            raise ValueError(f"InfinityTrainer: infinity config schedule.{key} is set, but the Trainer owns the "
                             f"schedule and clipping ({owner}); remove schedule.{key} from the config")
    if config.parallel.tensor > 1:
        raise ValueError(f"InfinityTrainer: infinity config parallel.tensor={config.parallel.tensor} is not "
                         "supported: the Trainer's data loader gives every rank its own batch, tensor-parallel "
                         "ranks need the same one; use parallel.tensor 1 (ZeRO only)")
    # clipping and accumulation as the Trainer runs them: the overlapped update reads both
    # (update_at auto updates during the next forward when the Trainer clips)
    clip = float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None
    if clip is not None and config.optimizer.update_at == "backward":
        raise ValueError(f"InfinityTrainer: TrainingArguments max_grad_norm={clip:g} conflicts "
                         "with optimizer.update_at backward (units are updated during backward, before the "
                         "global norm is known); set update_at auto, next_forward or speculative, or max_grad_norm=0")
    return config.replace(optimizer={"lr": wanted["lr"][1], "betas": list(wanted["betas"][1]),
                                     "eps": wanted["eps"][1], "weight_decay": wanted["weight_decay"][1]},
                          schedule={"clip_grad_norm": clip, "accum_steps": int(args.gradient_accumulation_steps)})


def check_arguments(args, config: Config) -> None:
    """``TrainingArguments`` that conflict with infinity, each refused naming the option."""
    if args.fp16 or args.bf16:
        flag = "fp16" if args.fp16 else "bf16"
        raise ValueError(f"InfinityTrainer: TrainingArguments {flag}=True conflicts with infinity's own precision; "
                         f"set precision.param_dtype: {flag} in the infinity config and leave {flag} off")
    for flag in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(args, flag, None):
            raise ValueError(f"InfinityTrainer: TrainingArguments {flag}=True is not supported (the units' gathers "
                             "run in infinity's hooks); set zero.activation_checkpointing: true in the infinity config")
    if args.torch_compile:
        raise ValueError("InfinityTrainer: TrainingArguments torch_compile=True is not supported (infinity drives "
                         "the forward through module hooks); leave torch_compile off")
    if args.auto_find_batch_size:
        raise ValueError("InfinityTrainer: TrainingArguments auto_find_batch_size=True is not supported (it rebuilds "
                         "the model's wrapping after an out-of-memory error); set per_device_train_batch_size")
    if args.load_best_model_at_end and args.save_only_model:
        raise ValueError("InfinityTrainer: TrainingArguments load_best_model_at_end=True with save_only_model=True: "
                         "the best model is loaded from its checkpoint's sharded state, which save_only_model does "
                         "not keep; drop one of them")
    if str(getattr(args.optim, "value", args.optim)) not in TORCH_ADAMW:
        raise ValueError(f"InfinityTrainer: TrainingArguments optim={getattr(args.optim, 'value', args.optim)!r} "
                         f"is not infinity's optimizer (AdamW over the shards); use optim in {TORCH_ADAMW}")
    if args.fsdp:
        raise ValueError("InfinityTrainer: TrainingArguments fsdp is set; infinity shards the model itself, "
                         "leave fsdp empty")


def check_trainer_kwargs(kwargs: dict) -> None:
    """``Trainer(...)`` arguments that would build a second optimizer or model."""
    if kwargs.get("model_init") is not None:
        raise ValueError("InfinityTrainer: model_init is not supported (infinity shards one model, built before the "
                         "trainer); pass model=")
    optimizer, scheduler = kwargs.get("optimizers") or (None, None)
    if optimizer is not None or scheduler is not None:
        raise ValueError("InfinityTrainer: optimizers=(optimizer, scheduler) is not supported: the optimizer is the "
                         "one infinity.initialize returns (hyper-parameters from TrainingArguments) and the "
                         "scheduler is built on it from lr_scheduler_type; leave optimizers unset")
    if kwargs.get("optimizer_cls_and_kwargs") is not None:
        raise ValueError("InfinityTrainer: optimizer_cls_and_kwargs is not supported: the optimizer is infinity's "
                         "AdamW; set its hyper-parameters in TrainingArguments")


def check_accelerator(trainer) -> None:
    """What the accelerator was told outside ``TrainingArguments`` (``accelerate launch`` flags, env vars)."""
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        which = "DeepSpeed" if trainer.is_deepspeed_enabled else "FSDP"
        raise ValueError(f"InfinityTrainer: accelerate has {which} enabled (accelerate launch / ACCELERATE_USE_"
                         f"{which.upper()}); infinity shards the model itself, launch without it")
    if trainer.accelerator.mixed_precision != "no":
        raise ValueError(f"InfinityTrainer: accelerate mixed_precision={trainer.accelerator.mixed_precision!r} "
                         "(accelerate launch --mixed_precision / ACCELERATE_MIXED_PRECISION) conflicts with "
                         "infinity's own precision; set precision.param_dtype in the infinity config instead")
    if trainer.args.n_gpu > 1:
        raise ValueError(f"InfinityTrainer: this process sees {trainer.args.n_gpu} GPUs and the Trainer would use "
                         "DataParallel; start one process per GPU (torchrun / accelerate launch)")


def _show(value) -> str:
    return ", ".join(f"{v:g}" for v in value) if isinstance(value, tuple) else f"{value:g}"
