"""The memory and communication model (ZeRO paper, Rajbhandari et al. 2020, §5 and §7).

For Ψ parameters trained with Adam on N data-parallel ranks, each parameter
carries three classes of model state:

==========  =======================================  =======  ======
class       holds                                    mixed    fp32
==========  =======================================  =======  ======
param       the compute copy used in forward/back    2 B      4 B
grad        its gradient, same dtype as the param    2 B      4 B
optimizer   fp32 master copy + Adam m + Adam v       12 B     8 B
==========  =======================================  =======  ======

Mixed precision (fp16/bf16 compute, fp32 master) is the paper's case: 16Ψ
bytes. In fp32 the compute copy *is* the master copy, so the optimizer holds
only m and v: also 16Ψ. A ZeRO stage decides which classes are sharded
(each rank keeps ``ceil(Ψ/N)`` elements of a sharded class, the padding the
flat shards really carry): stage 1 the optimizer state, stage 2 also the
gradients, stage 3 also the parameters. An offload placement decides which
tier each class lives in between uses: device, host (page-locked RAM) or
NVMe. So, per rank, in mixed precision:

- DDP (stage 0): device 16Ψ.
- ZeRO-1: device 4Ψ + 12Ψ/N.
- ZeRO-2: device 2Ψ + 14Ψ/N.
- ZeRO-3: device 16Ψ/N.
- ZeRO-Infinity (host): stage 3, param shard on device 2Ψ/N; grad and
  optimizer shards on host 14Ψ/N.
- ZeRO-Infinity (NVMe): stage 3, param and optimizer shards on NVMe 14Ψ/N;
  grad shards on host 2Ψ/N (they wait there for the CPU optimizer step);
  nothing persistent on device.

Stored formats (``optimizer.master`` / ``optimizer.moments``, :func:`state_bytes`) shrink the optimizer
class: a remainder master is 2 B instead of 4, bf16 moments 2 B each instead of 4, so mixed
precision's 12 B of optimizer state becomes 10, 8 or 6 (:func:`format_rows`: per tier, and the disk
bytes an offloaded step moves).

Every figure is *model state at rest, per rank*. Not counted: activations,
the working set of gathered full parameters at stage 3 (the live units,
bounded by ``prefetch.max_live_bytes``), communication buckets, host staging
buffers for NVMe I/O. Host bytes are per rank; ranks on one node share its RAM
and disks, so multiply by ranks per node for a node's total.

Communication per step, in elements (the paper's volume per rank, ring
algorithms): DDP all-reduces the gradients, 2Ψ (a reduce-scatter Ψ plus an
all-gather Ψ); ZeRO-1/2 reduce-scatter the gradients Ψ and all-gather the
updated parameters Ψ, 2Ψ; ZeRO-3 all-gathers parameters for forward Ψ and
again for backward Ψ and reduce-scatters gradients Ψ, 3Ψ. Gathers move
param-dtype elements, reductions move reduce-dtype elements. Offload changes
no collective volume.

ZeRO++ (:func:`zeropp_comm`, :func:`zeropp_rows`) splits stage 3's bytes into
what stays inside a node and what crosses to other nodes, per technique (qwZ,
hpZ, qgZ), counted pairwise as the engine's byte counters count them; hpZ's
secondary shard adds Ψ·param bytes / ranks per node to a rank's device bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn as nn

from infinity.precision import nominal_dtypes
from infinity.optim.moment_codes import MOMENT_FORMATS

__all__ = [
    "StateBytes", "MIXED", "FP32", "Placement", "STRATEGIES", "MemoryEstimate", "CommEstimate", "Estimate",
    "estimate", "estimate_all", "estimate_config", "parse_param_count", "count_params", "state_bytes",
    "format_rows", "MASTER_BYTES", "MOMENT_BYTES",
    "ZeroPPSwitches", "ZEROPP_ROWS", "zeropp_comm", "zeropp_rows",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TIER_NAMES = ("device", "host", "nvme")


@dataclass(frozen=True)
class StateBytes:
    """Bytes of each model-state class per parameter."""

    param: int
    grad: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


MIXED = StateBytes(param=2, grad=2, optimizer=12)   # fp16/bf16 param + grad; fp32 master, m, v
FP32 = StateBytes(param=4, grad=4, optimizer=8)     # fp32 param (= master) + grad; fp32 m, v
_PRECISIONS = {"mixed": MIXED, "fp32": FP32}
MASTER_BYTES = {"fp32": 4, "remainder": 2}   # optimizer.master: bytes per parameter stored
# optimizer.moments: bytes per parameter, each moment (int8: 65/64, a block of 256 codes and its fp32 scale)
MOMENT_BYTES = {name: f.itemsize for name, f in MOMENT_FORMATS.items()}


def state_bytes(precision: str = "mixed", master: str = "fp32", moments: str = "fp32") -> StateBytes:
    """Bytes per parameter of each state class with the stored formats ``optimizer.master`` / ``moments``:
    the optimizer class holds the master (none in fp32, where the parameter is the master; 2 B as a
    remainder beside a bf16 parameter) and the two moments."""
    if precision not in _PRECISIONS:
        raise ValueError(f"state_bytes: precision must be one of {list(_PRECISIONS)}, got {precision!r}")
    if master not in MASTER_BYTES or moments not in MOMENT_BYTES:
        raise ValueError(f"state_bytes: master must be one of {list(MASTER_BYTES)} and moments one of "
                         f"{list(MOMENT_BYTES)}, got {master!r}, {moments!r}")
    if master == "remainder" and precision != "mixed":
        raise ValueError("state_bytes: a remainder master needs mixed (bf16) precision")
    base = _PRECISIONS[precision]
    master_bytes = 0 if precision == "fp32" else MASTER_BYTES[master]
    return StateBytes(base.param, base.grad, master_bytes + 2 * MOMENT_BYTES[moments])


def format_rows(precision: str = "mixed") -> list:
    """Per stored format (master x moments): bytes per parameter at rest in each tier with ZeRO-Infinity
    on NVMe (parameters and optimizer states on NVMe, gradients on host), and the disk bytes per parameter
    a step moves for the optimizer: its states read and written once; a remainder master also reads the
    bf16 parameter, which the fp32 master's update only writes."""
    rows = []
    masters = ("fp32", "remainder") if precision == "mixed" else ("fp32",)
    for master in masters:
        for moments in MOMENT_BYTES:
            b = state_bytes(precision, master, moments)
            read = b.optimizer + (b.param if master == "remainder" else 0)
            rows.append({"master": master, "moments": moments, "device": 0, "host": b.grad,
                         "nvme": b.param + b.optimizer, "total": b.total,
                         "optimizer_read": read, "optimizer_write": b.optimizer + b.param})
    return rows


@dataclass(frozen=True)
class Placement:
    """A ZeRO stage plus the home tier of each state class (device, host or nvme)."""

    name: str
    stage: int
    param: str = "device"
    grad: str = "device"
    optimizer: str = "device"

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"placement {self.name}: stage must be 0..3, got {self.stage}")
        for cls, min_stage in (("optimizer", 1), ("grad", 2), ("param", 3)):
            tier = getattr(self, cls)
            if tier not in TIER_NAMES:
                raise ValueError(f"placement {self.name}: {cls} tier must be one of {TIER_NAMES}, got {tier!r}")
            # an unsharded class is the whole state on every rank: offloading it is not a ZeRO placement
            if tier != "device" and self.stage < min_stage:
                raise ValueError(f"placement {self.name}: {cls} on {tier} needs stage >= {min_stage}")

    def sharded(self, cls: str) -> bool:
        return self.stage >= {"optimizer": 1, "grad": 2, "param": 3}[cls]


STRATEGIES: tuple[Placement, ...] = (
    Placement("ddp", 0),
    Placement("zero1", 1),
    Placement("zero2", 2),
    Placement("zero3", 3),
    Placement("zero-infinity-host", 3, param="device", grad="host", optimizer="host"),
    Placement("zero-infinity-nvme", 3, param="nvme", grad="host", optimizer="nvme"),
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes per rank in each tier, and which class sits where."""

    device_bytes: int
    host_bytes: int
    nvme_bytes: int
    param_bytes: int        # this rank's param (shard), wherever it lives
    grad_bytes: int
    optimizer_bytes: int
    # optimizer.update_at speculative: a spare copy of this rank's parameter shard and optimizer states,
    # beside each in its tier (included in the tier totals)
    spare_bytes: int = 0


@dataclass(frozen=True)
class CommEstimate:
    """Collective volume per rank per step (paper convention, ring algorithms)."""

    all_gather_numel: int       # parameters gathered (param dtype)
    reduce_scatter_numel: int   # gradients reduce-scattered (reduce dtype)
    all_reduce_numel: int       # DDP: gradients all-reduced, counted as 2Ψ (reduce dtype)
    total_numel: int
    total_bytes: int


@dataclass(frozen=True)
class Estimate:
    placement: Placement
    num_params: int
    world_size: int
    precision: str
    memory: MemoryEstimate
    comm: CommEstimate

    def to_dict(self) -> dict:
        return {
            "name": self.placement.name,
            "stage": self.placement.stage,
            "placement": {"param": self.placement.param, "grad": self.placement.grad,
                          "optimizer": self.placement.optimizer},
            "num_params": self.num_params,
            "world_size": self.world_size,
            "precision": self.precision,
            "memory": asdict(self.memory),
            "comm": asdict(self.comm),
        }


def estimate(num_params: int, world_size: int, placement: Placement, precision: str = "mixed",
             param_dtype: str | None = None, reduce_dtype: str | None = None,
             state: StateBytes | None = None, spares: bool = False) -> Estimate:
    """Memory per rank and communication per step for one placement.

    ``precision`` ("mixed" or "fp32") sets the state bytes per parameter (``state`` overrides them:
    :func:`state_bytes` with the stored formats). ``param_dtype``/``reduce_dtype`` set the bytes per
    communicated element; by default 2 for mixed, 4 for fp32. ``spares`` (``optimizer.update_at``
    speculative): a spare copy of what Adam writes, this rank's parameter shard and optimizer states, in
    the tier of each (an fp32 parameter that is the master counts once).
    """
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
        raise ValueError(f"estimate: num_params must be a positive integer, got {num_params!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"estimate: world_size must be a positive integer, got {world_size!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"estimate: precision must be one of {list(_PRECISIONS)}, got {precision!r}")
    default_dtype = "fp32" if precision == "fp32" else "bf16"
    gather_bytes = _dtype_bytes(param_dtype or default_dtype, "param_dtype")
    reduce_bytes = _dtype_bytes(reduce_dtype or default_dtype, "reduce_dtype")

    state = state or _PRECISIONS[precision]
    shard_numel = math.ceil(num_params / world_size)
    per_class = {}
    tiers = dict.fromkeys(TIER_NAMES, 0)
    for cls in ("param", "grad", "optimizer"):
        numel = shard_numel if placement.sharded(cls) else num_params
        per_class[cls] = numel * getattr(state, cls)
        tiers[getattr(placement, cls)] += per_class[cls]
    spare = 0
    if spares:
        for cls in ("param", "optimizer"):
            tiers[getattr(placement, cls)] += shard_numel * getattr(state, cls)
            spare += shard_numel * getattr(state, cls)
    memory = MemoryEstimate(
        device_bytes=tiers["device"], host_bytes=tiers["host"], nvme_bytes=tiers["nvme"],
        param_bytes=per_class["param"], grad_bytes=per_class["grad"], optimizer_bytes=per_class["optimizer"],
        spare_bytes=spare)

    if placement.stage == 0:
        gather, scatter, allreduce = 0, 0, 2 * num_params
    elif placement.stage in (1, 2):
        gather, scatter, allreduce = num_params, num_params, 0
    else:
        gather, scatter, allreduce = 2 * num_params, num_params, 0
    comm = CommEstimate(
        all_gather_numel=gather, reduce_scatter_numel=scatter, all_reduce_numel=allreduce,
        total_numel=gather + scatter + allreduce,
        total_bytes=gather * gather_bytes + (scatter + allreduce) * reduce_bytes)
    return Estimate(placement, num_params, world_size, precision, memory, comm)


def estimate_all(num_params: int, world_size: int, precision: str = "mixed") -> list[Estimate]:
    """One :class:`Estimate` per entry of :data:`STRATEGIES`, in order."""
    return [estimate(num_params, world_size, p, precision) for p in STRATEGIES]


def estimate_config(config, num_params: int, world_size: int) -> Estimate:
    """The estimate for an :class:`infinity.Config`: its stage, offload tiers, dtypes, the optimizer's
    stored formats (``optimizer.master`` / ``moments``) and a speculative update's spares.

    ``precision.param_dtype`` fp32 is the fp32 case; bf16/fp16 the mixed case; ``auto`` is counted as
    bf16 (:func:`~infinity.precision.nominal_dtypes`).
    """
    off = config.offload

    def tier(t: str) -> str:
        return "device" if t == "none" else t

    placement = Placement("config", config.zero.stage, param=tier(off.params), grad=tier(off.grads),
                          optimizer=tier(off.optimizer))
    stored, _ = nominal_dtypes(config.precision)   # auto: counted as bf16 (its answer wherever it offloads)
    precision = "fp32" if stored == "fp32" else "mixed"
    state = state_bytes(precision, config.optimizer.master, config.optimizer.moments)
    return estimate(num_params, world_size, placement, precision, stored, config.precision.reduce_dtype, state,
                    spares=config.update_schedule().spares)


def _dtype_bytes(dtype: str, what: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"estimate: {what} must be one of {list(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]?)\s*$")
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_param_count(text: str) -> int:
    """``"7B"`` -> 7_000_000_000; also ``125M``, ``1.5b``, ``350k``, ``1T``, ``7e9``, ``1000``."""
    m = _COUNT_RE.match(str(text))
    suffix = m.group(2).lower() if m else None
    if not m or suffix not in _COUNT_SUFFIX:
        raise ValueError(f"cannot read {text!r} as a parameter count; use a number with an optional "
                         "K, M, B (or G) or T suffix, e.g. 7B or 125M")
    number = float(m.group(1)) * _COUNT_SUFFIX[suffix]
    if not math.isfinite(number):   # "1e400" reads as inf, which round() cannot make an int
        raise ValueError(f"parameter count {text!r} is not a finite number")
    n = round(number)
    if n < 1:
        raise ValueError(f"parameter count {text!r} is less than 1")
    return n


def count_params(model: nn.Module | Callable[[], nn.Module]) -> int:
    """Distinct parameters of a model (a tied weight counts once).

    Pass a zero-argument builder to have it built on the meta device, which
    costs no memory whatever the model's size.
    """
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            model = model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"count_params: the builder returned {type(model).__name__}, not an nn.Module")
    return sum(p.numel() for p in model.parameters())  # parameters() yields each shared tensor once


# ---------------------------------------------------------------- ZeRO++ (cross-node volume)

@dataclass(frozen=True)
class ZeroPPSwitches:
    """Which ZeRO++ techniques are on (``zeropp`` config section), for :func:`zeropp_comm`."""

    quantize_weights: bool = False
    hierarchical: bool = False
    quantize_grads: bool = False
    grad_bits: int = 8
    block_numel: int = 256

    @classmethod
    def from_config(cls, zeropp) -> "ZeroPPSwitches":
        """The switches of a config's ``zeropp`` section."""
        return cls(zeropp.quantize_weights, zeropp.hierarchical_partition, zeropp.quantize_grads,
                   zeropp.grad_bits, zeropp.block_numel)

    @property
    def label(self) -> str:
        on = [n for n, v in (("qwZ", self.quantize_weights), ("hpZ", self.hierarchical),
                             ("qgZ", self.quantize_grads)) if v]
        int4 = " int4" if self.quantize_grads and self.grad_bits == 4 else ""
        return "+".join(on) + int4 if on else "plain stage 3"


ZEROPP_ROWS: tuple[ZeroPPSwitches, ...] = (
    ZeroPPSwitches(),
    ZeroPPSwitches(quantize_weights=True),
    ZeroPPSwitches(hierarchical=True),
    ZeroPPSwitches(quantize_grads=True),
    ZeroPPSwitches(quantize_grads=True, grad_bits=4),
    ZeroPPSwitches(True, True, True),
    ZeroPPSwitches(True, True, True, grad_bits=4),
)


def zeropp_comm(num_params: int, world_size: int, ranks_per_node: int, switches: ZeroPPSwitches,
                param_bytes: int = 2, reduce_bytes: int = 2, backward_numel: int | None = None) -> dict:
    """Bytes one stage-3 rank delivers per step to ranks on its own node and on other nodes.

    ``{"forward_gather" | "backward_gather" | "grad_reduce": {"intra": B, "cross": B}}``, counted
    pairwise as :class:`infinity.comm.collectives.CommCounters` counts them: an all-gather delivers
    this rank's shard (or its quantized wire row) to every other member; a reduce-scatter one slice
    to each. With n ranks, k a node, m = n / k nodes and shards of S = Ψ / n elements:

    - forward gather: (k-1) and (n-k) copies of S·param_bytes, or of S int8 values + a 4-byte scale
      per block with qwZ;
    - backward gather: the same over ``backward_numel`` (default Ψ; the engine keeps its root unit
      gathered through backward, so it passes Ψ − Ψ_root); with hpZ it runs over the node's k
      ranks from slices of Ψ/k, so it moves (k-1)·Ψ/k·param_bytes inside the node and nothing across;
    - gradient reduce-scatter: (k-1) and (n-k) slices of S·reduce_bytes; with qgZ an intra-node
      all-to-all of m·S quantized values to each of k-1 node-mates, then one of S quantized node sums
      to each of m-1 other nodes: the cross-node part shrinks by k (node sums) and by the quantization.
    """
    from infinity.comm.quantize import payload_bytes

    n, k = world_size, ranks_per_node
    if k < 1 or n % k:
        raise ValueError(f"zeropp_comm: ranks_per_node {k} must divide the world size {n}")
    m = n // k
    sw = switches

    def gather(numel: int) -> dict:
        shard = math.ceil(numel / n)
        row = payload_bytes(shard, 8, sw.block_numel) if sw.quantize_weights else shard * param_bytes
        return {"intra": (k - 1) * row, "cross": (n - k) * row}

    bwd = num_params if backward_numel is None else backward_numel
    if sw.hierarchical:
        backward = {"intra": (k - 1) * math.ceil(bwd / k) * param_bytes, "cross": 0}
    else:
        backward = gather(bwd)
    shard = math.ceil(num_params / n)
    if sw.quantize_grads:
        grads = {"intra": (k - 1) * payload_bytes(m * shard, sw.grad_bits, sw.block_numel) if k > 1 else 0,
                 "cross": (m - 1) * payload_bytes(shard, sw.grad_bits, sw.block_numel)}
    else:
        grads = {"intra": (k - 1) * shard * reduce_bytes, "cross": (n - k) * shard * reduce_bytes}
    return {"forward_gather": gather(num_params), "backward_gather": backward, "grad_reduce": grads}


def zeropp_rows(num_params: int, world_size: int, ranks_per_node: int, precision: str = "mixed",
                rows: tuple = ZEROPP_ROWS) -> list[dict]:
    """``infinity estimate``'s ZeRO++ table: per technique, device bytes per rank (hpZ's secondary shard
    included: held from forward to the end of backward), bytes per step inside and across nodes, and the
    cross-node volume against plain ZeRO-3's."""
    state = _PRECISIONS[precision]
    comm_bytes = 4 if precision == "fp32" else 2
    base = estimate(num_params, world_size, Placement("zero3", 3), precision)
    out, plain_cross = [], None
    for sw in rows:
        comm = zeropp_comm(num_params, world_size, ranks_per_node, sw, comm_bytes, comm_bytes)
        intra = sum(c["intra"] for c in comm.values())
        cross = sum(c["cross"] for c in comm.values())
        plain_cross = cross if plain_cross is None else plain_cross
        secondary = math.ceil(num_params / ranks_per_node) * state.param if sw.hierarchical else 0
        out.append({"name": sw.label,
                    "switches": asdict(sw), "device_bytes": base.memory.device_bytes + secondary,
                    "secondary_param_bytes": secondary, "intra_node_bytes": intra, "cross_node_bytes": cross,
                    "cross_vs_zero3": cross / plain_cross if plain_cross else 0.0, "phases": comm})
    return out
