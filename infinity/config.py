"""The typed config tree (DESIGN §1).

One dataclass per section, each field parsed and checked by the function in its
``metadata["parse"]``. Load with :meth:`Config.from_file` (YAML or JSON) or
:meth:`Config.from_dict`; both reject unknown keys, naming the section and the
valid keys, and wrong types or impossible values, naming the key and what was
expected. Sizes are bytes: an int, or a string such as ``"512MiB"``/``"8GiB"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

__all__ = [
    "Config",
    "ConfigError",
    "ZeroConfig",
    "PrecisionConfig",
    "OptimizerConfig",
    "OffloadConfig",
    "TiersConfig",
    "PrefetchConfig",
    "IOConfig",
    "ScheduleConfig",
    "ParallelConfig",
    "ZeroPPConfig",
    "DistConfig",
    "LR_SCHEDULES",
    "parse_size",
    "format_size",
]

TIERS = ("none", "host", "nvme")
LR_SCHEDULES = ("constant", "linear", "cosine")
DTYPES = ("fp32", "bf16", "fp16")
MASTER_FORMATS = ("fp32", "remainder")
MOMENT_FORMATS = ("fp32", "bf16", "int8")   # infinity.optim.moment_codes has each one's layout
UPDATE_AT = ("step", "backward", "next_forward", "speculative", "auto")
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


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or an impossible value."""


# ---------------------------------------------------------------- sizes

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any, what: str = "size") -> int:
    """``"512MiB"`` -> 536870912; ints pass through. Raises ConfigError naming ``what``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size in bytes or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(
                f"{what}: cannot read {value!r} as a size; use bytes or a number with one of "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '512MiB')"
            )
        number = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(number):   # "1e400" reads as inf, and int(inf) raises OverflowError
            raise ConfigError(f"{what}: {value!r} is not a finite size")
        n = int(number)
    else:
        raise ConfigError(f"{what}: expected a size in bytes or a string like '512MiB', got {value!r}")
    if n < 0:
        raise ConfigError(f"{what}: size must be >= 0, got {value!r}")
    return n


def format_size(n_bytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.5KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n_bytes) < 1024 or unit == "TiB":
            return f"{n_bytes:.0f}{unit}" if unit == "B" else f"{n_bytes:.1f}{unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- field parsers

def _size(v, key):
    return parse_size(v, key)


def _size_or_auto(v, key):
    return "auto" if v == "auto" else parse_size(v, key)


def _size_or_off_or_auto(v, key):
    if v in ("auto", "off"):
        return v
    n = parse_size(v, key)
    if not 0 < n <= 32 * 2**20:
        raise ConfigError(f"{key}: {v!r} must be 'auto', 'off' or a size in (0, 32MiB] (glibc's limit)")
    return n


def _choice(*options):
    def parse(v, key):
        if v not in options:
            raise ConfigError(f"{key}: expected one of {list(options)}, got {v!r}")
        return v
    return parse


def _int(lo=None, hi=None):
    def parse(v, key):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{key}: expected an integer, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"{key}: expected an integer {rng}, got {v}")
        return v
    return parse


def _multiple_of(k, lo, hi):
    inner = _int(lo, hi)

    def parse(v, key):
        v = inner(v, key)
        if v % k:
            raise ConfigError(f"{key}: expected a multiple of {k}, got {v}")
        return v
    return parse


def _int_or_auto(lo):
    inner = _int(lo)
    return lambda v, key: "auto" if v == "auto" else inner(v, key)


def _float(lo=None, lo_open=False):
    def parse(v, key):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {v!r}")
        v = float(v)
        if not math.isfinite(v):   # NaN fails no comparison below, and inf makes every update inf
            raise ConfigError(f"{key}: expected a finite number, got {v}")
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise ConfigError(f"{key}: expected a number {'>' if lo_open else '>='} {lo}, got {v}")
        return v
    return parse


def _bool(v, key):
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false, got {v!r}")
    return v


def _bool_or_auto(v, key):
    return "auto" if v == "auto" else _bool(v, key)


def _bool_or_count(v, key):
    """true, false, or a count >= 0 (0 reads as false)."""
    if isinstance(v, bool):
        return v
    if not isinstance(v, int) or v < 0:
        raise ConfigError(f"{key}: expected true, false or a count of units >= 0, got {v!r}")
    return v if v else False


def _betas(v, key):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{key}: expected two numbers [beta1, beta2], got {v!r}")
    b = tuple(_float(0.0)(x, key) for x in v)
    if not all(0.0 <= x < 1.0 for x in b):
        raise ConfigError(f"{key}: each beta must be in [0, 1), got {list(b)}")
    return b


def _str_list(v, key):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{key}: expected a list of class names, got {v!r}")
    return tuple(v)


def _optional_path(v, key):
    if v is None:
        return None
    if not isinstance(v, (str, Path)) or str(v) == "":
        raise ConfigError(f"{key}: expected a directory path, got {v!r}")
    return str(v)


def _optional_positive(v, key):
    return None if v in (None, "none") else _float(0.0, lo_open=True)(v, key)


def _loss_scale(v, key):
    if v in ("dynamic", "none"):
        return v
    return _float(0.0, lo_open=True)(v, key)


def _f(default, parse: Callable, doc: str):
    """A config field: its default, its parser, one line on what it trades."""
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults")
    return field(default=default, metadata={"parse": parse, "doc": doc})


# ---------------------------------------------------------------- sections

@dataclass(frozen=True)
class ZeroConfig:
    stage: int = _f(3, _int(0, 3), "0 = DDP, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters")
    reshard_after_forward: bool = _f(
        True, _bool, "stage 3: free a unit's gathered params after forward (saves memory, one more all-gather)")
    unit_classes: tuple = _f(
        (), _str_list, "module class names that each become a unit; empty = children of the largest ModuleList")
    bucket_bytes: int = _f(
        25 * 2**20, _size, "stage 0: gradient all-reduce bucket size (bigger = fewer calls, later overlap)")
    activation_checkpointing: Any = _f(
        False, _bool_or_count, "recompute each unit's activations in backward instead of keeping them from "
        "forward: activation memory falls to the units' inputs, at the cost of one more forward per unit. "
        "true = every unit; a count N = the first N units only (the rest keep theirs: less memory saved, "
        "less recomputed)")

    activation_offload: str = _f(
        "none", _choice(*TIERS), "where each unit's saved activations wait between its forward and its backward: "
        "host or nvme (tiers.nvme_path), through the store's budgets and I/O, brought back in backward up to "
        "prefetch.bytes ahead; bitwise the same training. A checkpointed unit (activation_checkpointing) saves "
        "only its input, any other unit every tensor its backward needs (parameters and tensors under 64KiB "
        "stay). none = kept in device memory")

    def checkpointed_units(self, blocks: int) -> int:
        """How many of ``blocks`` units (the root excluded) ``activation_checkpointing`` recomputes."""
        ckpt = self.activation_checkpointing
        return blocks if ckpt is True else min(int(ckpt), blocks)


@dataclass(frozen=True)
class PrecisionConfig:
    param_dtype: str = _f(
        "fp32", _choice("auto", *DTYPES), "dtype of the stored parameters (every tier, every gather) and, unless "
        "compute_dtype says otherwise, of forward/backward. auto = bf16 where the hardware computes it natively "
        "(CUDA 8.0+; a CPU where a short matmul probe finds bf16 faster than fp32), fp16 with loss scaling on "
        "older CUDA devices, else fp32 compute (stored in bf16 where the parameters are offloaded)")
    compute_dtype: str = _f(
        "auto", _choice("auto", *DTYPES), "dtype forward/backward run in. auto = param_dtype (or, with param_dtype "
        "auto, what its measurement chose). fp32 with bf16 parameters: stored and moved in bf16 (half the NVMe "
        "reads and gathers), each gathered unit upcast once per use (stage 3 only; a CPU without fast bf16)")
    reduce_dtype: str = _f("fp32", _choice(*DTYPES), "dtype gradients are reduced in")
    loss_scale: Any = _f("dynamic", _loss_scale, "fp16 only: 'dynamic', 'none' or a fixed scale")
    initial_loss_scale: float = _f(2.0**16, _float(0.0, lo_open=True), "fp16 dynamic scaling: starting scale")
    loss_scale_window: int = _f(1000, _int(1), "fp16 dynamic scaling: good steps before the scale doubles")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = _f(3.0e-4, _float(0.0), "AdamW learning rate")
    betas: tuple = _f((0.9, 0.95), _betas, "AdamW (beta1, beta2)")
    eps: float = _f(1.0e-8, _float(0.0, lo_open=True), "AdamW epsilon")
    weight_decay: float = _f(0.1, _float(0.0), "decoupled weight decay")
    threads: Any = _f("auto", _int_or_auto(1), "CPU Adam threads; auto = cores / local ranks")
    update_at: str = _f(
        "step", _choice(*UPDATE_AT), "when each unit's Adam update (swap-in, CPU Adam, write-back) runs. step = "
        "every unit at optimizer.step(). The others overlap the offloaded update with compute, hiding the step's "
        "I/O (zero.stage >= 2 and offload.optimizer host or nvme): backward = each unit updated during the step's "
        "last backward (schedule.accum_steps says which) as soon as its gradient shard is final (hides ~2/3 of "
        "the step's compute; no clip_grad_norm_, no fp16; the lr is read when the first unit's update starts); "
        "next_forward = step() computes the clip coefficient "
        "or fp16 overflow, then launches the updates in forward order and the next forward waits for each unit's "
        "before using it (exact with clipping and fp16, hides ~1/3); speculative = updated during the last "
        "backward into spare copies before the clip norm is known, committed by step() when nothing clipped or "
        "overflowed, else redone from the untouched state (exact; a run that keeps clipping falls back to "
        "next_forward; costs disk or host memory for a second copy of the parameters and optimizer states); "
        "auto = step unless the optimizer is offloaded at stage >= 2, then next_forward when "
        "schedule.clip_grad_norm is set or precision.param_dtype is fp16 or auto, else backward")
    master: str = _f(
        "fp32", _choice(*MASTER_FORMATS), "stored format of the fp32 master weights. remainder (bf16 parameters "
        "only): the master is kept as a signed 16-bit remainder beside the bf16 parameter, exactly (training is "
        "bitwise the fp32 run's), 2 instead of 4 B/element stored and moved; the optimizer then reads the stored "
        "parameter as well as writing it")
    moments: str = _f(
        "fp32", _choice(*MOMENT_FORMATS), "stored format of Adam's two moments; the update math stays fp32 (each "
        "chunk widened, updated and rounded back to nearest while in cache). bf16: 2 instead of 4 B/element each, "
        "stored and moved. int8: 8-bit codes in blocks of 256 with one fp32 scale each (an fp8 e4m3 code per "
        "element; the second moment coded as its square root), 65/64 B/element each. Both lossy (see "
        "docs/benchmarks.md's convergence figures)")


@dataclass(frozen=True)
class OffloadConfig:
    optimizer: str = _f("none", _choice(*TIERS), "where fp32 master weights and Adam moments live")
    params: str = _f("none", _choice(*TIERS), "where stage-3 parameter shards live between uses")
    grads: str = _f("none", _choice(*TIERS), "where reduced gradient shards wait for the optimizer")
    chunk_bytes: int = _f(
        256 * 2**20, _size, "cap on the host bytes one optimizer job brings in: a stored unit shard is split into "
        "chunks whose stored classes together (master, moments, gradient, parameter: ~16-18 B/element) fit in it, "
        "each updated as its own job. Smaller bounds the optimizer's host working set (the pipeline holds up to 3 "
        "jobs) independently of unit size, e.g. a 128M-element embedding; larger makes fewer, bigger disk requests")
    host_resident_bytes: Any = _f(
        "auto", _size_or_auto, "host memory in which chunks homed on nvme stay for good, never read from or "
        "written to the disk again (parameters first: 3 transfers a step per byte, then optimizer states: 2); "
        "counted in tiers.host_bytes. auto = what tiers.host_bytes holds beyond the step's working room (the "
        "larger of half the budget and the minimum initialize enforces plus 3 more optimizer jobs); 0 = everything "
        "placed on nvme stays there")


@dataclass(frozen=True)
class TiersConfig:
    device_bytes: Any = _f("auto", _size_or_auto, "device tier budget; auto = free device memory at start-up less "
                           "the gathered working set, 1/4 of the device for activations and a slack of "
                           "max(1GiB, 5%) (CPU: 1/4 of RAM per local rank; with host_bytes auto too, carved out "
                           "of the host tier's half, at most half of it)")
    host_bytes: Any = _f("auto", _size_or_auto, "host tier budget; auto = 1/2 of (available RAM less an OS reserve "
                         "of max(2GiB, 10% of RAM)), divided by the ranks on this machine (LOCAL_WORLD_SIZE)")
    nvme_path: Any = _f(None, _optional_path, "swap directory for the nvme tier (needed when anything lives there)")
    malloc_mmap_threshold: Any = _f(
        "auto", _size_or_off_or_auto, "glibc's mmap threshold, fixed so that freed blocks above it return to the OS "
        "and RSS stays near the budgets (process-wide mallopt); smaller returns more at more page faults; "
        "auto = 4MiB when anything is offloaded and the environment sets no MALLOC_MMAP_THRESHOLD_, else untouched; "
        "off = glibc's default (raised as blocks are freed)")
    host_cache_bytes: Any = _f(
        "auto", _size_or_auto, "freed host blocks at or above the mmap threshold kept for reuse, up to this many "
        "bytes, instead of unmapped (process-wide: torch's CPU allocator; a step makes the same big temporaries "
        "every layer, and a fresh block's pages fault and are zeroed on first write); counted in RSS beside the "
        "budgets; auto = 512MiB when tiers.malloc_mmap_threshold fixes a threshold, else 0; 0 = off")


@dataclass(frozen=True)
class PrefetchConfig:
    bytes: int = _f(256 * 2**20, _size, "how far ahead along the recorded order units are fetched")
    max_live_bytes: Any = _f(
        "auto", _size_or_auto, "stage 3: cap on full parameter bytes of units being gathered or gathered, for "
        "prefetch and on-demand gathers alike (units gathered ahead or kept for backward are released to make "
        "room); at least the root unit + the largest other unit; more lets the next all-gather overlap compute; "
        "auto = 1GiB, or root + 2 x the largest unit if more")


@dataclass(frozen=True)
class IOConfig:
    block_bytes: int = _f(8 * 2**20, _size, "each request is split into pieces of this size")
    queue_depth: int = _f(8, _int(1), "pieces in flight at once per engine")
    threads: int = _f(4, _int(1), "worker threads issuing pread/pwrite (they block in the syscall, so more than cores is fine)")
    direct: Any = _f("auto", _bool_or_auto, "O_DIRECT: auto = probe the file system, fall back to buffered")
    phase_bytes: int = _f(0, _size, "0: reads and writes go to the disk mixed, in submission order; > 0: "
                          "in phases, one kind at a time, switching once this many bytes of it were served while "
                          "the other kind waits (or none of it is left): for disks where reads and writes slow "
                          "each other down")
    checksum: bool = _f(True, _bool, "checksum each stored extent, verified on read")


@dataclass(frozen=True)
class ScheduleConfig:
    """The learning-rate schedule and gradient clipping of a training run.

    ``infinity.initialize`` does not act on it: ``infinity train`` does, and a
    library user builds the same schedule with
    :func:`infinity.train.schedule.build_lr_scheduler` and clips with
    ``optimizer.clip_grad_norm_(config.schedule.clip_grad_norm)``.
    """

    lr_schedule: str = _f("constant", _choice(*LR_SCHEDULES),
                          "after warmup: constant, linear or cosine decay from optimizer.lr to min_lr")
    warmup_steps: int = _f(0, _int(0), "steps of linear warmup, lr * (step + 1) / warmup_steps")
    min_lr: float = _f(0.0, _float(0.0), "learning rate at the end of a linear or cosine decay")
    total_steps: Any = _f("auto", _int_or_auto(1),
                          "steps from the start to the end of the decay (then min_lr holds); auto = the run's steps")
    clip_grad_norm: Any = _f(None, _optional_positive,
                             "clip the global gradient norm to this before each step; none = no clipping (costs "
                             "one pass over the gradients and one all-reduce)")
    accum_steps: int = _f(1, _int(1), "backward passes (micro-batches) per optimizer step; infinity train's --accum "
                          "and the Trainer's gradient_accumulation_steps set it. Only the overlapped update reads it: "
                          "the accum_steps-th backward since the last step updates each unit as its gradient is final "
                          "(engine.no_sync() marks a backward as not the last explicitly)")


@dataclass(frozen=True)
class ZeroPPConfig:
    """ZeRO++ (Wang et al. 2023): three independent ways to cut stage 3's cross-node traffic.

    Each trades exactness or memory for fewer bytes on the slow links between
    nodes (see :mod:`infinity.comm.zeropp` and docs/parallelism.md). The
    node layout (``ranks_per_node``) also splits the byte counters into
    intra-node and cross-node bytes, whether or not a technique is on.
    """

    quantize_weights: bool = _f(
        False, _bool, "qwZ, stage 3: all-gather parameter shards as int8 with one fp32 scale per block and "
        "dequantize into the compute dtype (about half of bf16's bytes, a quarter of fp32's); only the gathered "
        "copy is approximate, master weights and the optimizer stay exact")
    hierarchical_partition: bool = _f(
        False, _bool, "hpZ, stage 3: keep a secondary shard of each unit's parameters, sharded over the ranks of "
        "one node, from its forward to its backward, so the backward all-gather never leaves the node; costs "
        "2 x params / ranks_per_node bytes (compute dtype) per rank while held")
    quantize_grads: bool = _f(
        False, _bool, "qgZ, stages 1-3: reduce-scatter gradients as all-to-alls of block-quantized values "
        "(grad_bits), intra-node first then across nodes, dequantized before every sum so the error does not "
        "grow with the ranks; gradients are still accumulated and stored in precision.reduce_dtype")
    grad_bits: int = _f(8, _choice(8, 4), "qgZ: 8 (int8) or 4 (int4, two values a byte: half the bytes, 16x "
                        "the rounding error)")
    block_numel: int = _f(256, _multiple_of(8, 8, 2**20), "values sharing one fp32 scale (qwZ and qgZ), a "
                          "multiple of 8: smaller = less rounding error, more scale bytes (4 / block_numel a value)")
    ranks_per_node: Any = _f("auto", _int_or_auto(1), "ranks on one node, consecutive ranks sharing a node: "
                             "the hpZ/qgZ groups and the intra/cross-node byte split; auto = the ranks the launcher put on "
                             "one node (torchrun's GROUP_RANK, SLURM_NODEID, else the host name); a number must "
                             "divide that (smaller: one node stands in for several)")

    @property
    def enabled(self) -> bool:
        """Any technique on."""
        return self.quantize_weights or self.hierarchical_partition or self.quantize_grads


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is cut into a 2-D ``("dp", "tp")`` mesh (:mod:`infinity.parallel.mesh`).

    Tensor parallelism splits each attention / MLP matrix ``tensor`` ways (Megatron column / row
    split): model state per rank falls by ``tensor`` on top of ZeRO's data-parallel sharding, at the
    cost of two all-reduces of the activations per layer in forward and two in backward, which only
    pay on fast links (inside a node). Data parallel is the rest of the world: ``world / tensor``.
    """

    tensor: int = _f(1, _int(1), "tensor-parallel ways (adjacent ranks); data parallel = world size / tensor")
    sequence: bool = _f(False, _bool, "with tensor > 1, sequence parallelism: norms and residual stream run on "
                        "1 / tensor of the sequence (their activations / tensor, same tp bytes); the default plan "
                        "of the built-in GPT; the sequence length must divide by tensor")


@dataclass(frozen=True)
class DistConfig:
    """How long a rank waits for the others before saying so, and before giving up.

    A rank that hangs (stopped, swapping, stuck in a driver) or dies without
    its sockets closing leaves the others blocked in a collective. torch's
    default timeout is 30 minutes of silence; a shorter one fails the job
    sooner, but too short a one fails a healthy job whose ranks are merely
    uneven (a slow disk, a long checkpoint write on one rank, a big first
    compile). See :mod:`infinity.comm.watchdog`.
    """

    timeout_s: float = _f(600.0, _float(0.0, lo_open=True), "seconds a collective may wait for every rank before "
                          "every waiting rank fails with an error naming it (init_process_group's timeout when "
                          "initialize creates the group); longer than any legitimate wait, e.g. a checkpoint save")
    warn_after_s: float = _f(60.0, _float(0.0, lo_open=True), "seconds of waiting in one collective after which "
                             "a rank logs which collective it waits in and which ranks have not arrived")


_SECTIONS = {
    "zero": ZeroConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "offload": OffloadConfig,
    "tiers": TiersConfig,
    "prefetch": PrefetchConfig,
    "io": IOConfig,
    "schedule": ScheduleConfig,
    "parallel": ParallelConfig,
    "zeropp": ZeroPPConfig,
    "dist": DistConfig,
}


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
