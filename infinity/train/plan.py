"""Validating :class:`TrainOptions` into the :class:`Plan` every rank runs.

Everything a user can get wrong is checked here, in the launching process,
before any rank starts: numbers, sizes, the model's shape (built on the meta
device), the config and its overrides, the data file, output paths and the
swap directory. Each error is one :class:`TrainError` naming the flag.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from infinity.config import Config, ConfigError, parse_size
from infinity.train.errors import TrainError
from infinity.train.models import ModelSpec, build_model, parse_model_spec
from infinity.train.options import DEFAULT_SWAP_DIR, TrainOptions, default_config

__all__ = ["Plan", "resolve", "prepare_swap_dir", "with_swap_dir", "under_torchrun", "check_int"]


@dataclass(frozen=True)
class Plan:
    """Validated options, picklable, sent to every rank."""

    config: dict
    model: "ModelSpec"
    steps: int
    batch_size: int
    seq_len: int
    accum: int
    seed: int
    data: str | None
    corpus_bytes: int | None
    metrics: str | None
    trace: str | None
    trace_step: int
    progress: bool
    swap_dir: str | None


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def check_int(flag: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TrainError(f"{flag} must be an integer >= {least}, got {value!r}")
    return value


def _check_output(flag: str, path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise TrainError(f"{flag} {p}: is a directory; give a file name")
    if not p.parent.is_dir():
        raise TrainError(f"{flag} {p}: directory {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise TrainError(f"{flag} {p}: directory {p.parent} is not writable")
    return str(p)


def prepare_swap_dir(swap_dir: str) -> None:
    """Create ``swap_dir`` and prove a file can be written there, before any rank starts."""
    p = Path(swap_dir)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".infinity-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        probe.unlink()
    except OSError as e:
        raise TrainError(f"swap directory {p}: cannot create or write files there "
                         f"({e.strerror or e}); set --swap-dir to a writable directory on a local disk") from None


def resolve(options: TrainOptions, world_size: int) -> Plan:
    o = options
    steps = check_int("--steps", o.steps, 1)
    batch_size = check_int("--batch-size", o.batch_size, 1)
    seq_len = check_int("--seq-len", o.seq_len, 1)
    accum = check_int("--accum", o.accum, 1)
    seed = check_int("--seed", o.seed, 0)
    trace_step = check_int("--trace-step", o.trace_step, 0)
    if o.trace is not None and trace_step >= steps:
        raise TrainError(f"--trace-step {trace_step} is past the last step ({steps - 1}, 0-based); "
                         f"lower it or raise --steps")
    if batch_size % (world_size * accum):
        raise TrainError(f"--batch-size {batch_size} does not split evenly over {world_size} rank(s) x "
                         f"--accum {accum}; use a multiple of {world_size * accum}")
    if o.lr is not None and (isinstance(o.lr, bool) or not isinstance(o.lr, (int, float)) or not o.lr >= 0):
        raise TrainError(f"--lr must be a number >= 0, got {o.lr!r}")
    if o.stage is not None and o.stage not in (0, 1, 2, 3):
        raise TrainError(f"--stage must be 0, 1, 2 or 3, got {o.stage!r}")

    try:
        config = Config.load(o.config) if o.config is not None else default_config(
            o.swap_dir or DEFAULT_SWAP_DIR, 3 if o.stage is None else o.stage)
        changes = {}
        if o.stage is not None:
            changes["zero"] = {"stage": o.stage}
        if o.lr is not None:
            changes["optimizer"] = {"lr": float(o.lr)}
        tiers = {}
        if o.swap_dir is not None:
            tiers["nvme_path"] = o.swap_dir
        if o.device_bytes is not None:
            tiers["device_bytes"] = parse_size(o.device_bytes, "--device-bytes")
        if o.host_bytes is not None:
            tiers["host_bytes"] = parse_size(o.host_bytes, "--host-bytes")
        if tiers:
            changes["tiers"] = tiers
        config = config.replace(**changes)
        corpus_bytes = None if o.corpus_bytes is None else parse_size(o.corpus_bytes, "--corpus-bytes")
    except ConfigError as e:
        raise TrainError(str(e)) from None
    if config.optimizer.overlap_backward and accum > 1:
        raise TrainError(f"--accum {accum} with optimizer.overlap_backward: the update runs in backward, one "
                         "backward per step; use --accum 1 or overlap_backward: false")
    if corpus_bytes is not None and corpus_bytes < seq_len + 1:
        raise TrainError(f"--corpus-bytes {corpus_bytes} is too small for --seq-len {seq_len} "
                         f"(needs at least {seq_len + 1} bytes)")
    if corpus_bytes is not None and o.data is not None:
        raise TrainError("--corpus-bytes sizes the default corpus; it cannot be used with --data")

    spec = parse_model_spec(o.model)
    with torch.device("meta"):   # check the shape without allocating it
        build_model(spec, seq_len)

    if o.data is not None:
        data = Path(o.data)
        if not data.is_file() or not os.access(data, os.R_OK):
            raise TrainError(f"--data {data}: not a readable file")
        if data.stat().st_size < seq_len + 1:
            raise TrainError(f"--data {data}: {data.stat().st_size} bytes is too short for --seq-len {seq_len}")

    off = config.offload
    on_nvme = any(getattr(off, k) == "nvme" for k in ("optimizer", "params", "grads"))
    swap_dir = config.tiers.nvme_path if (on_nvme or o.swap_dir is not None) else None
    return Plan(config=config.to_dict(), model=spec, steps=steps, batch_size=batch_size, seq_len=seq_len,
                 accum=accum, seed=seed, data=o.data, corpus_bytes=corpus_bytes,
                 metrics=_check_output("--metrics", o.metrics), trace=_check_output("--trace", o.trace),
                 trace_step=trace_step, progress=bool(o.progress), swap_dir=swap_dir)


def with_swap_dir(plan: Plan, swap_dir: str | None) -> Plan:
    config = dict(plan.config, tiers=dict(plan.config["tiers"], nvme_path=swap_dir))
    return dataclasses.replace(plan, config=config)
