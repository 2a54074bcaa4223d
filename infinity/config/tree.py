"""The whole config tree, :class:`Config`: load, dump, and the rules that span sections.

:meth:`Config.from_file` (YAML or JSON), :meth:`Config.from_dict` and :meth:`Config.load`
build each section through its fields' parsers (:mod:`infinity.config.sections`), rejecting
unknown sections and keys with the valid names listed; a DeepSpeed config is handed to
:mod:`infinity.deepspeed_config`. Every construction then checks the combinations no single
field can (an NVMe tier without ``tiers.nvme_path``, ``offload.params`` below stage 3, ...),
and :meth:`Config.update_schedule` decides ``optimizer.update_at`` once.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infinity.config.fields import ConfigError
from infinity.config.sections import (_SECTIONS, UPDATE_AT, DistConfig, IOConfig, OffloadConfig, OptimizerConfig,
                                      ParallelConfig, PrecisionConfig, PrefetchConfig, ScheduleConfig, TiersConfig,
                                      ZeroConfig, ZeroPPConfig)

__all__ = ["Config", "UpdateTiming"]

# keys a newer one replaced: the one-line error names it (a value is not carried over silently)
_REPLACED = {"optimizer.overlap_backward": "optimizer.update_at", "optimizer.overlap_mode": "optimizer.update_at"}


@dataclass(frozen=True)
class UpdateTiming:
    """A resolved ``optimizer.update_at`` (:meth:`Config.update_schedule`) and what it implies for the parts
    that size or price the run, so none of them compares the value again."""

    at: str              # step, backward, next_forward or speculative
    overlapped: bool     # some unit's update runs while compute does (not all at optimizer.step())
    in_backward: bool    # updates run during the step's last backward: its gradients wait in host memory for them
    spares: bool         # each class the update writes has a spare copy (speculative: commit or redo)


def _build_section(cls, name: str, raw: Any):
    if raw is None:
        raw = {}
    if dataclasses.is_dataclass(raw) and isinstance(raw, cls):
        return raw
    if name == "offload" and raw == "auto":
        raise ConfigError("offload: auto asks the planner to choose the config: pass it to infinity.initialize "
                          "or `infinity train --config`, which plan it (infinity/plan/auto.py), or run "
                          "`infinity plan` for a config to load")
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a mapping of keys to values, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    replaced = sorted(k for k in raw if f"{name}.{k}" in _REPLACED)
    if replaced:
        new = _REPLACED[f"{name}.{replaced[0]}"]
        raise ConfigError(f"{name}.{replaced[0]}: replaced by {new}; set {new} to one of "
                          f"{', '.join(UPDATE_AT)} (overlap_backward true with overlap_mode M is update_at M)")
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key {name}.{unknown[0]} in section '{name}'; valid keys: {', '.join(fields)}")
    values = {k: fields[k].metadata["parse"](v, f"{name}.{k}") for k, v in raw.items()}
    return cls(**values)


@dataclass(frozen=True)
class Config:
    """The whole tree. Sections default to their documented defaults."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    io: IOConfig = field(default_factory=IOConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zeropp: ZeroPPConfig = field(default_factory=ZeroPPConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self):
        self._check_cross_fields()

    @classmethod
    def from_dict(cls, d: dict | None) -> "Config":
        """Build from a mapping of sections; a DeepSpeed config (by its top-level keys) is read as one."""
        d = {} if d is None else d
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a mapping of sections, got {type(d).__name__}")
        from infinity.deepspeed_config import is_deepspeed   # beside this module; it builds a Config
        if is_deepspeed(d):
            return cls.from_deepspeed(d)
        unknown = sorted(set(d) - set(_SECTIONS) - ({"plan"} if d.get("offload") == "auto" else set()))
        if unknown:
            raise ConfigError(f"unknown config section '{unknown[0]}'; valid sections: {', '.join(_SECTIONS)}")
        return cls(**{name: _build_section(sec, name, d.get(name)) for name, sec in _SECTIONS.items()})

    @classmethod
    def from_deepspeed(cls, source: "str | Path | dict", trainer=None) -> "Config":
        """A DeepSpeed ``ds_config.json`` (path or dict) read into a Config, each key mapped to its meaning here;
        ``trainer``: :class:`infinity.deepspeed_config.TrainerValues` to fill ``"auto"`` values from (see
        :mod:`infinity.deepspeed_config`)."""
        from infinity.deepspeed_config import read_deepspeed
        return read_deepspeed(source, trainer).config

    @classmethod
    def from_file(cls, path: str | Path) -> "Config":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from e
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from e
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    @classmethod
    def load(cls, config: "str | Path | dict | Config | None") -> "Config":
        """Accept what ``infinity.initialize`` accepts: a path, a dict, a Config, or None."""
        if config is None:
            return cls()
        if isinstance(config, Config):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, Path)):
            return cls.from_file(config)
        raise ConfigError(f"config: expected a path, dict or infinity.Config, got {type(config).__name__}")

    def to_dict(self) -> dict:
        """Plain dict that round-trips through :meth:`from_dict` (and YAML/JSON)."""
        out = {}
        for name in _SECTIONS:
            sec = dataclasses.asdict(getattr(self, name))
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in sec.items()}
        return out

    def replace(self, **sections: dict) -> "Config":
        """A copy with some keys changed: ``cfg.replace(zero={"stage": 2})``."""
        d = self.to_dict()
        for name, changes in sections.items():
            if name not in _SECTIONS:
                raise ConfigError(f"unknown config section '{name}'; valid sections: {', '.join(_SECTIONS)}")
            d[name].update(changes)
        return Config.from_dict(d)

    def update_schedule(self) -> "UpdateTiming":
        """``optimizer.update_at`` with ``auto`` resolved (see its doc), and what it implies: the one place
        a config's update schedule is decided (the engine builds it, :func:`infinity.zero.schedules.make_schedule`)."""
        at = self.optimizer.update_at
        if at == "auto":
            needs_all = self.schedule.clip_grad_norm is not None or self.precision.param_dtype in ("fp16", "auto")
            at = ("step" if self.zero.stage < 2 or self.offload.optimizer == "none" else
                  "next_forward" if needs_all else "backward")
        return UpdateTiming(at, overlapped=at != "step", in_backward=at in ("backward", "speculative"),
                            spares=at == "speculative")

    def _check_finite(self):
        """Sections built directly (not through :meth:`from_dict`'s parsers) still never carry NaN or inf."""
        for name in _SECTIONS:
            for f in dataclasses.fields(getattr(self, name)):
                value = getattr(getattr(self, name), f.name)
                values = value if isinstance(value, tuple) else (value,)
                if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                    raise ConfigError(f"{name}.{f.name}: expected a finite number, got {value}")

    def _check_cross_fields(self):
        self._check_finite()
        off = self.offload
        on_nvme = [f"offload.{k}" for k in ("optimizer", "params", "grads") if getattr(off, k) == "nvme"]
        on_nvme += ["zero.activation_offload"] if self.zero.activation_offload == "nvme" else []
        if on_nvme and not self.tiers.nvme_path:
            raise ConfigError(
                f"tiers.nvme_path: required because {on_nvme[0]} is 'nvme'; "
                "set it to a directory on a fast local disk")
        if off.params != "none" and self.zero.stage != 3:
            raise ConfigError(
                f"offload.params: '{off.params}' needs zero.stage 3 (parameters are only sharded at "
                f"stage 3), got stage {self.zero.stage}")
        if off.grads != "none" and self.zero.stage < 2:
            raise ConfigError(
                f"offload.grads: '{off.grads}' needs zero.stage >= 2 (gradients are only sharded from "
                f"stage 2), got stage {self.zero.stage}")
        if off.optimizer != "none" and self.zero.stage < 1:
            raise ConfigError(
                "offload.optimizer: needs zero.stage >= 1 (stage 0 keeps full optimizer state per rank)")
        if self.optimizer.update_at not in ("step", "auto"):
            self._check_update_at()
        self._check_precision()
        if self.optimizer.master == "remainder" and self.precision.param_dtype not in ("bf16", "auto"):
            raise ConfigError(
                f"optimizer.master: remainder needs precision.param_dtype bf16, got {self.precision.param_dtype} "
                "(the remainder is the fp32 master's low 16 bits beside a bf16 parameter's high 16; an fp16 "
                "parameter has other exponent bits, an fp32 one is the master itself)")
        if self.optimizer.update_at == "backward" and self.schedule.clip_grad_norm is not None:
            raise ConfigError("schedule.clip_grad_norm: not with optimizer.update_at backward (each unit is "
                              "updated during backward, before the global gradient norm is known); use "
                              "update_at next_forward, speculative or auto")
        if self.schedule.min_lr > self.optimizer.lr and self.schedule.lr_schedule != "constant":
            raise ConfigError(f"schedule.min_lr: {self.schedule.min_lr:g} is above optimizer.lr "
                              f"{self.optimizer.lr:g}; a decay goes down to min_lr")
        if self.io.block_bytes % 4096:
            raise ConfigError(f"io.block_bytes: must be a multiple of 4096 for direct I/O, got {self.io.block_bytes}")
        self._check_zeropp()
        if self.dist.warn_after_s > self.dist.timeout_s:
            raise ConfigError(f"dist.warn_after_s: {self.dist.warn_after_s:g} is past dist.timeout_s "
                              f"{self.dist.timeout_s:g}; the warning would never come")
        if self.parallel.tensor > 1 and self.zeropp.enabled:
            raise ConfigError("zeropp: not with parallel.tensor > 1 yet (ZeRO++'s node groups assume consecutive "
                              "data-parallel ranks; with tensor parallelism they are parallel.tensor apart)")

    def _check_precision(self):
        param, compute = self.precision.param_dtype, self.precision.compute_dtype
        if compute in ("auto", param) or param == "auto":
            return
        if compute != "fp32" or param != "bf16":
            raise ConfigError(f"precision.compute_dtype: {compute} with param_dtype {param} is not a pair this "
                              "runs; compute_dtype differs from param_dtype only as fp32 over bf16 parameters "
                              "(for a 16-bit compute dtype set param_dtype to it: the fp32 master is the "
                              "optimizer's anyway)")
        if self.zero.stage != 3:
            raise ConfigError(f"precision.compute_dtype: fp32 over bf16 parameters needs zero.stage 3 (each "
                              f"gathered unit is upcast once per use), got stage {self.zero.stage}; at stages "
                              "0-2 set param_dtype fp32")

    def _check_zeropp(self):
        pp, stage = self.zeropp, self.zero.stage
        for key, what in (("quantize_weights", "the parameter all-gather"),
                          ("hierarchical_partition", "the backward parameter all-gather")):
            if getattr(pp, key) and stage != 3:
                raise ConfigError(f"zeropp.{key}: needs zero.stage 3 ({what} only exists when parameters are "
                                  f"sharded), got stage {stage}")
        if pp.hierarchical_partition and not self.zero.reshard_after_forward:
            raise ConfigError("zeropp.hierarchical_partition: needs zero.reshard_after_forward true (with false "
                              "a unit stays gathered for its backward, so there is no backward all-gather to "
                              "keep inside the node)")
        if pp.quantize_grads and stage == 0:
            raise ConfigError("zeropp.quantize_grads: needs zero.stage >= 1 (it quantizes the gradient "
                              "reduce-scatter; stage 0 all-reduces full gradients)")
        if pp.quantize_grads and self.precision.param_dtype == "fp16":
            raise ConfigError("zeropp.quantize_grads: not with precision.param_dtype fp16: loss scaling finds "
                              "overflow by the inf/nan it leaves in the reduced gradients, which quantization "
                              "cannot carry; use bf16")

    def _check_update_at(self):
        at, why = self.optimizer.update_at, None
        if self.zero.stage < 2:
            why = f"needs zero.stage >= 2 (a unit's gradient shard is final during backward), got {self.zero.stage}"
        elif self.offload.optimizer == "none":
            why = "needs offload.optimizer host or nvme (the update runs as the offloaded CPU Adam)"
        elif self.precision.param_dtype == "fp16" and at == "backward":
            why = ("not for precision.param_dtype fp16: the overflow check needs every gradient before any "
                   "update; use update_at next_forward, speculative or auto")
        if why is not None:
            raise ConfigError(f"optimizer.update_at {at}: {why}")
