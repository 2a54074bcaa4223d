"""A DeepSpeed ``ds_config.json`` read as an infinity :class:`~infinity.config.Config` (DESIGN §1).

``Config.from_deepspeed(path | dict)`` reads one explicitly; ``Config.from_dict``,
``from_file`` and ``load`` (so ``infinity.initialize``, ``infinity train --config``,
``infinity plan --config`` and ``InfinityTrainer``) recognise one by its top-level keys
(``zero_optimization``, ``bf16``, ``aio``, ``train_batch_size``, an ``optimizer`` with
``type``/``params``, ...) and read it here. This module only builds a ``Config``.

Every key DeepSpeed documents for ZeRO-Infinity has one of three fates, listed in
:data:`KEYS` (the migration table of docs/migrating-from-deepspeed.md is rendered from it, :func:`mapping_table`):

- **maps**: it becomes the infinity key that means the same (``offload_param.device: nvme``
  is ``offload.params: nvme``). A key left out keeps DeepSpeed's default inside a section
  the file has (``initial_scale_power`` 16), and infinity's where the whole section is absent.
- **sized here**: a tuning knob of DeepSpeed's own machinery (bucket sizes, pinned buffer
  counts, ``overlap_comm``) whose job infinity does its own way, sized from its own config:
  one log line per process names it and why, then it is ignored.
- **refused**: a value whose meaning infinity cannot honour (a partial optimizer offload
  ``ratio``, an optimizer other than Adam/AdamW): a :class:`ConfigError`
  naming the key. The value that is infinity's own behaviour (``ratio: 1``) is accepted.

An unknown key is a ``ConfigError`` naming it and listing the keys its section takes.

``"auto"`` values are what transformers' DeepSpeed integration fills from the
``Trainer``'s arguments: given :class:`TrainerValues` (``InfinityTrainer`` passes them)
they are filled the same way, and an explicit value that disagrees with the argument is
an error naming both; without them (``initialize``, ``infinity train``) ``"auto"`` keeps
infinity's own value for that key (for ``bf16``/``fp16.enabled``: ``precision.param_dtype:
auto``, measured on the machine).

The key table itself, with each key's fate and note, is :mod:`infinity.deepspeed_keys`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infinity.config import Config, ConfigError
from infinity.deepspeed_keys import KEYS, REFUSED, SECTION, SIZED, DeepSpeedKey, mapping_table

__all__ = ["DeepSpeedKey", "DeepSpeedReading", "KEYS", "TrainerValues", "is_deepspeed", "read_deepspeed",
           "mapping_table"]

log = logging.getLogger(__name__)

AUTO = "auto"

# DeepSpeed's defaults for keys a section it has leaves out (its config reference and optimizer/scheduler code)
_DS_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_DS_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000, "warmup_min_ratio": 0.0,
              "cos_min_ratio": 1e-4}
_DS_FP16 = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000}
_DS_AIO = {"queue_depth": 8, "intra_op_parallelism": 1}
_SCHEDULES = {"warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
_TIERS = {"none": "none", "cpu": "host", "nvme": "nvme"}


# top-level keys only DeepSpeed has ("optimizer" is both's: a DeepSpeed one has "type"/"params")
_DS_TOP = {p for p in KEYS if "." not in p and p != "optimizer"}


@dataclass(frozen=True)
class TrainerValues:
    """What transformers fills a DeepSpeed config's ``"auto"`` values from: ``TrainingArguments``' values."""

    learning_rate: float
    betas: tuple
    eps: float
    weight_decay: float
    max_grad_norm: float
    accum_steps: int
    micro_batch: int
    world_size: int
    bf16: bool
    fp16: bool
    gradient_checkpointing: bool = False

    @classmethod
    def from_training_arguments(cls, args) -> "TrainerValues":
        return cls(float(args.learning_rate), (float(args.adam_beta1), float(args.adam_beta2)),
                   float(args.adam_epsilon), float(args.weight_decay), float(args.max_grad_norm or 0.0),
                   int(args.gradient_accumulation_steps), int(args.per_device_train_batch_size),
                   int(args.world_size), bool(args.bf16 or getattr(args, "bf16_full_eval", False)),
                   bool(args.fp16 or getattr(args, "fp16_full_eval", False)),
                   bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing",
                                                                                    False)))


@dataclass(frozen=True)
class DeepSpeedReading:
    """The config, and what the Trainer finishes later: whether the file has a ``scheduler`` (the Trainer then
    builds infinity's schedule) and whether its warmup is ``"auto"`` (known once the run's steps are)."""

    config: Config
    scheduler: bool = False
    auto_warmup: bool = False


def is_deepspeed(raw: Any) -> bool:
    """Whether the mapping ``raw`` is a DeepSpeed config (by its top-level keys)."""
    if not isinstance(raw, dict):
        return False
    opt = raw.get("optimizer")
    return bool(_DS_TOP & set(raw)) or (isinstance(opt, dict) and bool({"type", "params"} & set(opt)))


def read_deepspeed(source, trainer: TrainerValues | None = None) -> DeepSpeedReading:
    """Read ``source`` (a JSON file's path or a dict) into a :class:`DeepSpeedReading`; see the module doc."""
    raw, where = _load(source)
    try:
        return _Reader(raw, trainer).read()
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None


def _load(source) -> tuple:
    if isinstance(source, dict):
        return copy.deepcopy(source), ""
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read DeepSpeed config {path}: {e.strerror or e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"DeepSpeed config {path}: expected a JSON object of keys, got {type(raw).__name__}")
    return raw, f"{path}: "


_said: set = set()


def _say_ignored(key: DeepSpeedKey) -> None:
    """One log line per process for each DeepSpeed knob that infinity sizes itself."""
    if key.path not in _said:
        _said.add(key.path)
        log.warning("infinity: DeepSpeed %s is not used: %s", key.path, key.note)


class _Reader:
    """One reading: checks every key against :data:`KEYS`, then builds the infinity sections."""

    def __init__(self, raw: dict, trainer: TrainerValues | None):
        self.raw, self.trainer = raw, trainer
        self.out: dict = {}

    # ---------------------------------------------------------------- keys

    def _check(self, mapping: dict, prefix: str = "") -> None:
        for name, value in mapping.items():
            path = f"{prefix}{name}"
            key = KEYS.get(path)
            if key is None:
                siblings = [p[len(prefix):] for p in KEYS if p.startswith(prefix) and "." not in p[len(prefix):]]
                where = f"in {prefix[:-1]}" if prefix else "at the top level"
                raise ConfigError(f"unknown DeepSpeed key {path}; valid keys {where}: {', '.join(siblings)}")
            if key.fate == SECTION:
                if value is None:
                    continue
                if not isinstance(value, dict):
                    raise ConfigError(f"DeepSpeed {path}: expected an object of keys, got {value!r}")
                self._check(value, path + ".")
            elif key.fate == SIZED:
                _say_ignored(key)
            elif key.fate == REFUSED and value not in key.accepted and value is not None:
                raise ConfigError(f"DeepSpeed {path}: {value!r} cannot be honoured: {key.note}")

    def get(self, path: str, default=None):
        node = self.raw
        for part in path.split("."):
            if not isinstance(node, dict) or node.get(part) is None:
                return default
            node = node[part]
        return node

    def has(self, path: str) -> bool:
        return self.get(path) is not None

    def number(self, path: str, default=None, integer: bool = False, lo: float | None = None):
        value = self.get(path, default)
        if value is None or value == AUTO:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"DeepSpeed {path}: expected a number, got {value!r}")
        if integer:
            if float(value) != int(value):
                raise ConfigError(f"DeepSpeed {path}: expected a whole number, got {value!r}")
            value = int(value)
        if lo is not None and value < lo:
            raise ConfigError(f"DeepSpeed {path}: expected a number >= {lo:g}, got {value!r}")
        return value

    def flag(self, path: str, default=None):
        value = self.get(path, default)
        if value is not None and value != AUTO and not isinstance(value, bool):
            raise ConfigError(f"DeepSpeed {path}: expected true or false, got {value!r}")
        return value

    def fill(self, path: str, value, trainer_value, trainer_name: str):
        """``"auto"``: the Trainer's value (None without a Trainer: infinity's own); an explicit value must equal
        the Trainer's argument, as transformers requires."""
        if value == AUTO:
            return trainer_value if self.trainer is not None else None
        if self.trainer is not None and value is not None and trainer_value is not None and value != trainer_value:
            raise ConfigError(f"DeepSpeed {path}={_show(value)} disagrees with TrainingArguments "
                              f"{trainer_name}={_show(trainer_value)}; set it to \"auto\" or make the two equal")
        return value

    def put(self, section: str, key: str, value) -> None:
        if value is not None:
            self.out.setdefault(section, {})[key] = value

    # ---------------------------------------------------------------- sections

    def read(self) -> DeepSpeedReading:
        sections = {f.name for f in dataclasses.fields(Config)}
        mixed = sorted(set(self.raw) & sections - {"optimizer"})
        if mixed:
            raise ConfigError(f"the config mixes DeepSpeed keys ({', '.join(sorted(_DS_TOP & set(self.raw)))}) with "
                              f"infinity's section '{mixed[0]}'; write one or the other")
        self._check(self.raw)
        self._precision()
        self._zero()
        self._aio()
        self._optimizer()
        scheduler, auto_warmup = self._scheduler()
        self._steps()
        try:
            config = Config.from_dict(self.out)
        except ConfigError as e:
            raise ConfigError(f"the DeepSpeed config read as infinity's: {e}") from None
        return DeepSpeedReading(config, scheduler, auto_warmup)

    def _precision(self) -> None:
        t = self.trainer
        # under a Trainer an absent bf16 / fp16 section follows its flag, as accelerate adds the section for it
        missing = AUTO if t is not None else None
        bf16 = self.fill("bf16.enabled", self.flag("bf16.enabled", missing), t and t.bf16, "bf16")
        fp16 = self.fill("fp16.enabled", self.flag("fp16.enabled", missing), t and t.fp16, "fp16")
        if bf16 is True and fp16 is True:
            raise ConfigError("DeepSpeed bf16.enabled and fp16.enabled are both true; enable one")
        auto = AUTO in (self.get("bf16.enabled"), self.get("fp16.enabled")) and t is None
        dtype = "bf16" if bf16 is True else "fp16" if fp16 is True else "auto" if auto else "fp32"
        self.put("precision", "param_dtype", dtype)
        self.itemsize = 4 if dtype == "fp32" else 2
        if dtype == "fp16":
            scale = self.number("fp16.loss_scale", _DS_FP16["loss_scale"], lo=0)
            self.put("precision", "loss_scale", "dynamic" if scale == 0 else float(scale))
            power = self.number("fp16.initial_scale_power", _DS_FP16["initial_scale_power"], lo=0)
            self.put("precision", "initial_loss_scale", float(2.0 ** power))
            self.put("precision", "loss_scale_window",
                     self.number("fp16.loss_scale_window", _DS_FP16["loss_scale_window"], integer=True, lo=1))
        reduce = self.get("communication_data_type")
        if reduce is not None:
            names = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
                     "bfloat16": "bf16"}
            if reduce not in names:
                raise ConfigError(f"DeepSpeed communication_data_type: expected fp32, fp16 or bf16, got {reduce!r}")
            self.put("precision", "reduce_dtype", names[reduce])

    def _zero(self) -> None:
        z = "zero_optimization"
        stage = self.number(f"{z}.stage", 0, integer=True)
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"DeepSpeed {z}.stage: expected 0, 1, 2 or 3, got {stage!r}")
        self.put("zero", "stage", stage)
        if self.trainer is not None and self.trainer.gradient_checkpointing:
            self.put("zero", "activation_checkpointing", True)
        if self.flag("activation_checkpointing.cpu_checkpointing", False) is True:
            if self.trainer is not None and not self.trainer.gradient_checkpointing:
                raise ConfigError("DeepSpeed activation_checkpointing.cpu_checkpointing: true moves checkpointed "
                                  "activations, and TrainingArguments gradient_checkpointing is off; turn it on, "
                                  "or set cpu_checkpointing false")
            self.put("zero", "activation_checkpointing", True)
            self.put("zero", "activation_offload", "host")
        params = self._device(f"{z}.offload_param")
        optimizer = self._device(f"{z}.offload_optimizer")
        if params != "none" and stage != 3:
            raise ConfigError(f"DeepSpeed {z}.offload_param: device {self.get(f'{z}.offload_param.device')!r} needs "
                              f"stage 3 (parameters are only sharded at stage 3), got stage {stage}")
        if optimizer != "none" and stage == 0:
            raise ConfigError(f"DeepSpeed {z}.offload_optimizer: needs stage >= 1, got stage 0")
        self.put("offload", "params", params)
        self.put("offload", "optimizer", optimizer)
        if optimizer != "none" and stage >= 2:
            self.put("offload", "grads", optimizer)
            self.put("optimizer", "update_at", "auto")
        paths = {p: self.get(f"{z}.{p}.nvme_path") for p in ("offload_param", "offload_optimizer")
                 if self.get(f"{z}.{p}.device") == "nvme"}
        for p, path in paths.items():
            if not path:
                raise ConfigError(f"DeepSpeed {z}.{p}.nvme_path: required with device nvme; set it to a directory on "
                                  "a fast local disk")
        if len(set(paths.values())) > 1:
            raise ConfigError(f"DeepSpeed {z}.offload_optimizer.nvme_path: {paths['offload_optimizer']!r} differs from "
                              f"offload_param.nvme_path {paths['offload_param']!r}; infinity keeps every NVMe-homed "
                              "shard under one swap directory (tiers.nvme_path): give both the same")
        if paths:
            self.put("tiers", "nvme_path", str(next(iter(paths.values()))))
        for ds, ours in (("stage3_prefetch_bucket_size", "bytes"), ("stage3_max_live_parameters", "max_live_bytes")):
            n = self.number(f"{z}.{ds}", integer=True, lo=0)
            if n is None or n == AUTO:
                continue
            if n == 0 and ours == "max_live_bytes":
                raise ConfigError(f"DeepSpeed {z}.{ds}: 0 cannot be honoured: the unit in use and the root unit "
                                  "stay gathered (prefetch.max_live_bytes >= root + largest unit); set \"auto\" or "
                                  "a count of elements")
            self.put("prefetch", ours, n * self.itemsize)
        hpz = self.number(f"{z}.zero_hpz_partition_size", integer=True, lo=1)
        if hpz not in (None, AUTO) and hpz > 1:
            self.put("zeropp", "hierarchical_partition", True)
            self.put("zeropp", "ranks_per_node", hpz)
        for ds, ours in (("zero_quantized_weights", "quantize_weights"), ("zero_quantized_gradients", "quantize_grads")):
            value = self.flag(f"{z}.{ds}")
            if value not in (None, AUTO):
                self.put("zeropp", ours, value)

    def _device(self, section: str) -> str:
        device = self.get(f"{section}.device", "none")
        if device not in _TIERS:
            raise ConfigError(f"DeepSpeed {section}.device: expected none, cpu or nvme, got {device!r}")
        return _TIERS[device]

    def _aio(self) -> None:
        block = self.number("aio.block_size", integer=True, lo=1)
        if block is not None:
            if block % 4096:
                raise ConfigError(f"DeepSpeed aio.block_size: {block} must be a multiple of 4096 (direct I/O's "
                                  "alignment; io.block_bytes)")
            self.put("io", "block_bytes", block)
        old, new = self.get("aio.thread_count"), self.get("aio.intra_op_parallelism")
        if old is not None and new is not None and old != new:
            raise ConfigError(f"DeepSpeed aio.thread_count {old!r} and aio.intra_op_parallelism {new!r} disagree; "
                              "they are one setting (intra_op_parallelism is its newer name): keep one")
        if not any(self.has(f"aio.{k}") for k in ("queue_depth", "intra_op_parallelism", "thread_count")):
            return
        depth = self.number("aio.queue_depth", _DS_AIO["queue_depth"], integer=True, lo=1)
        threads = self.number("aio.intra_op_parallelism" if new is not None else "aio.thread_count",
                              _DS_AIO["intra_op_parallelism"], integer=True, lo=1)
        self.put("io", "queue_depth", depth * threads)
        self.put("io", "threads", depth * threads)

    def _optimizer(self) -> None:
        if not self.has("optimizer"):
            return
        kind = self.get("optimizer.type")
        if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
            raise ConfigError(f"DeepSpeed optimizer.type: {kind!r} cannot be honoured: infinity's optimizer is AdamW "
                              "(type Adam or AdamW)")
        t = self.trainer
        p = "optimizer.params"
        lr = self.fill(f"{p}.lr", self.number(f"{p}.lr", _DS_ADAM["lr"], lo=0), t and t.learning_rate,
                       "learning_rate")
        betas = self.get(f"{p}.betas", _DS_ADAM["betas"])
        if betas != AUTO:
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise ConfigError(f"DeepSpeed {p}.betas: expected [beta1, beta2], got {betas!r}")
            betas = tuple(float(b) for b in betas)
        betas = self.fill(f"{p}.betas", betas, t and t.betas, "adam_beta1, adam_beta2")
        eps = self.fill(f"{p}.eps", self.number(f"{p}.eps", _DS_ADAM["eps"]), t and t.eps, "adam_epsilon")
        decay = self.fill(f"{p}.weight_decay", self.number(f"{p}.weight_decay", _DS_ADAM["weight_decay"], lo=0),
                          t and t.weight_decay, "weight_decay")
        self.put("optimizer", "lr", None if lr is None else float(lr))
        self.put("optimizer", "betas", None if betas is None else list(betas))
        self.put("optimizer", "eps", None if eps is None else float(eps))
        self.put("optimizer", "weight_decay", None if decay is None else float(decay))

    def _scheduler(self) -> tuple:
        if not self.has("scheduler"):
            return False, False
        kind = self.get("scheduler.type")
        if not isinstance(kind, str) or kind.lower() not in _SCHEDULES:
            raise ConfigError(f"DeepSpeed scheduler.type: {kind!r} cannot be honoured: infinity's schedules are "
                              "WarmupLR, WarmupDecayLR and WarmupCosineLR (linear warmup, then constant, linear or "
                              "cosine)")
        kind = kind.lower()
        p, t = "scheduler.params", self.trainer
        self.put("schedule", "lr_schedule", _SCHEDULES[kind])
        warmup = self.get(f"{p}.warmup_num_steps", _DS_WARMUP["warmup_num_steps"])
        auto_warmup = warmup == AUTO
        if not auto_warmup:
            self.put("schedule", "warmup_steps", self.number(f"{p}.warmup_num_steps", integer=True, lo=0))
        total = self.number(f"{p}.total_num_steps", integer=True, lo=1)
        if kind != "warmuplr" and total is not None and total != AUTO:
            self.put("schedule", "total_steps", total)
        if kind in ("warmuplr", "warmupdecaylr"):
            peak = self.number(f"{p}.warmup_max_lr", _DS_WARMUP["warmup_max_lr"], lo=0)
            peak = self.fill(f"{p}.warmup_max_lr", peak, t and t.learning_rate, "learning_rate")
            mine = self.out.get("optimizer", {}).get("lr")
            if peak is not None and mine is not None and peak != mine:
                raise ConfigError(f"DeepSpeed {p}.warmup_max_lr={peak:g} disagrees with optimizer.params.lr={mine:g}; "
                                  "the schedule's peak is infinity's optimizer.lr: make the two equal")
            self.put("optimizer", "lr", None if peak is None else float(peak))
        if kind == "warmupdecaylr":
            floor = self.number(f"{p}.warmup_min_lr", _DS_WARMUP["warmup_min_lr"], lo=0)
            self.put("schedule", "min_lr", 0.0 if floor == AUTO else float(floor))
        if kind == "warmupcosinelr":
            ratio = self.number(f"{p}.cos_min_ratio", _DS_WARMUP["cos_min_ratio"], lo=0)
            lr = self.out.get("optimizer", {}).get("lr", self.trainer.learning_rate if t else Config().optimizer.lr)
            self.put("schedule", "min_lr", float(ratio) * lr)
        return True, auto_warmup and t is not None

    def _steps(self) -> None:
        t = self.trainer
        clip = self.fill("gradient_clipping", self.number("gradient_clipping", lo=0), t and t.max_grad_norm,
                         "max_grad_norm")
        if clip is not None:
            self.put("schedule", "clip_grad_norm", float(clip) if clip > 0 else "none")
        accum = self.fill("gradient_accumulation_steps", self.number("gradient_accumulation_steps", integer=True, lo=1),
                          t and t.accum_steps, "gradient_accumulation_steps")
        self.put("schedule", "accum_steps", accum)
        micro = self.number("train_micro_batch_size_per_gpu", integer=True, lo=1)
        self.fill("train_micro_batch_size_per_gpu", micro, t and t.micro_batch, "per_device_train_batch_size")
        batch = self.number("train_batch_size", integer=True, lo=1)
        self.fill("train_batch_size", batch, t and t.world_size * t.micro_batch * t.accum_steps,
                  "world size x per_device_train_batch_size x gradient_accumulation_steps")


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)



if __name__ == "__main__":   # python -m infinity.deepspeed_config: the table for docs/migrating-from-deepspeed.md
    print(mapping_table())
