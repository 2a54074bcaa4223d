"""The config's sections: one frozen dataclass per section, every field with its default, parser and doc.

``_SECTIONS`` names them in the order the tree (:class:`infinity.config.Config`), the
generated reference and ``to_dict`` list them. The value sets of the choice fields
(:data:`TIERS`, :data:`DTYPES`, ...) are here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infinity.config.fields import (_betas, _bool, _bool_or_auto, _bool_or_count, _choice, _f, _float, _int,
                                    _int_or_auto, _loss_scale, _multiple_of, _optional_path, _optional_positive,
                                    _size, _size_or_auto, _size_or_off_or_auto, _str_list)

__all__ = [
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
    "TIERS",
    "LR_SCHEDULES",
    "DTYPES",
    "MASTER_FORMATS",
    "MOMENT_FORMATS",
    "UPDATE_AT",
]

TIERS = ("none", "host", "nvme")
LR_SCHEDULES = ("constant", "linear", "cosine")
DTYPES = ("fp32", "bf16", "fp16")
MASTER_FORMATS = ("fp32", "remainder")
MOMENT_FORMATS = ("fp32", "bf16", "int8")   # infinity.optim.moment_codes has each one's layout
UPDATE_AT = ("step", "backward", "next_forward", "speculative", "auto")


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
