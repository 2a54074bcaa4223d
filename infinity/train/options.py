"""What ``infinity train`` does by default, what it can be asked (:class:`TrainOptions`), what it returns.

Light on purpose (no torch): the command line reads these defaults to build
its help text for every sub-command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from infinity.config import Config

__all__ = ["TrainOptions", "TrainResult", "default_config", "DEFAULT_MODEL", "DEFAULT_STEPS",
           "DEFAULT_BATCH_SIZE", "DEFAULT_SEQ_LEN", "DEFAULT_LR", "DEFAULT_SWAP_DIR", "DEFAULT_OFFLOAD",
           "DEFAULT_PARAM_DTYPE", "DEFAULT_SAVE_ROOT", "DEFAULT_EVAL_EVERY", "DEFAULT_EVAL_BATCHES",
           "DEFAULT_VAL_FRACTION", "DEFAULT_SCHEDULE"]

# The default run: a 10.8M-parameter GPT, 8 x 256 byte tokens a step, 50 steps, optimizer and
# parameters on NVMe. On this 2-core machine, shared with other jobs, the whole run took 31 s at load
# ~2 and 62 s at load ~5 (0.45-1.1 s a step); the loss fell from 5.24 to 3.19 (bytes of Python source).
DEFAULT_MODEL = "tiny:n_layer=6,n_head=6,n_embd=384,block_size=256"
DEFAULT_STEPS = 50
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 256               # or the model's own limit, when that is shorter
DEFAULT_LR = 1.0e-3
DEFAULT_SWAP_DIR = "infinity_swap"
# Where the default config keeps the optimizer state and stage-3 parameter shards: NVMe files
# (ZeRO-Infinity), with host memory as the cache in front of them.
DEFAULT_OFFLOAD = {"optimizer": "nvme", "params": "nvme"}
# Precision of the default config: measured where it runs (infinity.precision; see default_config).
DEFAULT_PARAM_DTYPE = "auto"
# Without --save-dir each run saves under its own DEFAULT_SAVE_ROOT/run-<time> (gitignored); --resume with no
# path continues the newest of them.
DEFAULT_SAVE_ROOT = "checkpoints"
# Validation: the last 5% of the data is held out; every 25 steps (and at the last step) 2 batches of it.
DEFAULT_EVAL_EVERY = 25
DEFAULT_EVAL_BATCHES = 2
DEFAULT_VAL_FRACTION = 0.05
# The default run's schedule section: a short warmup, cosine decay to a tenth, clipping at 1.0 (the usual
# GPT recipe, scaled to 50 steps).
DEFAULT_SCHEDULE = {"lr_schedule": "cosine", "warmup_steps": 5, "min_lr": DEFAULT_LR / 10, "clip_grad_norm": 1.0}


def default_config(swap_dir: str | os.PathLike = DEFAULT_SWAP_DIR, stage: int = 3) -> Config:
    """The config ``infinity train`` uses without ``--config``: ZeRO-3, state in NVMe files under ``swap_dir``.

    Precision: ``auto`` (fp32 master weights, Adam moments and gradient
    reduction): bf16 where this machine computes it natively (a CUDA device
    of compute capability 8.0+; a CPU whose short matmul probe at the model's
    shapes finds bf16 faster than fp32, as with ``avx512_bf16`` or AMX), else
    fp32 compute over bf16-stored parameters (the stage-3 parameters are
    offloaded: half the bytes each gather and NVMe read moves). The choice is
    one log line. Use a config with ``precision.param_dtype: fp32`` for runs
    that must match plain PyTorch exactly. ``stage`` < 3 drops the parameter offload (only
    stage 3 shards parameters), stage 0 the optimizer offload too.

    From stage 2 the offloaded update overlaps compute (``optimizer.update_at`` auto; the schedule
    clips, so it runs exactly during the next forward, each unit's update waited
    for just before that unit runs): the step's optimizer I/O is hidden behind forward instead of
    waited for at ``step()``, with the same results bitwise.
    """
    offload = dict(DEFAULT_OFFLOAD)
    if stage < 3:
        offload["params"] = "none"
    if stage < 1:
        offload["optimizer"] = "none"
    return Config.from_dict({
        "zero": {"stage": stage},
        "precision": {"param_dtype": DEFAULT_PARAM_DTYPE, "reduce_dtype": "fp32"},
        "optimizer": {"lr": DEFAULT_LR, "update_at": "auto"},
        "offload": offload,
        "tiers": {"nvme_path": str(swap_dir)},
        "schedule": DEFAULT_SCHEDULE,
    })


# ---------------------------------------------------------------- options

@dataclass
class TrainOptions:
    """What ``infinity train`` was asked for; :func:`train` validates every field before starting anything."""

    # None for a field marked "resumable" means: the checkpoint's value under --resume, else the default
    config: str | None = None          # YAML/JSON config file; None = default_config()
    nproc: int = 1                     # local ranks to start (1 = this process); ignored under torchrun
    steps: int | None = None           # resumable; default DEFAULT_STEPS (the total, resumed steps included)
    model: str | None = None           # resumable; default DEFAULT_MODEL; grammar in infinity/train/models.py
    batch_size: int | None = None      # resumable; global sequences per optimizer step (all ranks, micro-batches)
    seq_len: int | None = None         # resumable; default min(DEFAULT_SEQ_LEN, what the model allows)
    accum: int | None = None           # micro-batches per rank per step; None = the config's schedule.accum_steps
    lr: float | None = None            # overrides optimizer.lr
    seed: int | None = None            # resumable; model init and batch order (default 0)
    stage: int | None = None           # overrides zero.stage
    swap_dir: str | None = None        # overrides tiers.nvme_path
    device_bytes: str | int | None = None  # overrides tiers.device_bytes (a size: bytes or "512MiB")
    host_bytes: str | int | None = None    # overrides tiers.host_bytes
    data: str | None = None            # resumable; train on this file (bytes, or tokenized) instead of the default
    corpus_bytes: str | int | None = None  # resumable; how much of the default corpus to use (a size)
    tokenizer: str | None = None       # resumable; a local transformers tokenizer directory (default: the hf: model's)
    val_fraction: float | None = None  # resumable; held-out tail of the data (default DEFAULT_VAL_FRACTION)
    eval_every: int = DEFAULT_EVAL_EVERY   # validation every N steps and at the last step; 0 = never
    eval_batches: int = DEFAULT_EVAL_BATCHES   # global batches of held-out data per evaluation
    # schedule: None = the config's schedule section (or the checkpoint's, under --resume)
    warmup_steps: int | None = None
    lr_schedule: str | None = None     # constant, linear or cosine
    min_lr: float | None = None
    clip_grad_norm: float | None = None    # 0 = no clipping
    save: bool = True                  # False: never save (no checkpoint at the end either)
    save_dir: str | None = None        # None: DEFAULT_SAVE_ROOT/run-<time>, or the resumed run's directory
    save_every: int = 0                # also save every N steps; 0 = only at the end and on Ctrl-C
    keep_last: int | None = None       # keep the newest K checkpoints of this save dir; None = all
    resume: str | None = None          # a checkpoint (step dir or save dir); "auto" = the save dir's latest;
                                       # "if-saved" = the save dir's latest if it has one, else a fresh run
    save_node_local: bool | None = None    # resumable; each node saves its own ranks' files into its own
                                           # --save-dir (nodes without a shared file system); default False
    sample_every: int = 0              # print a sample of sample_tokens tokens every N steps; 0 = never
    sample_tokens: int = 64
    metrics: str | None = None         # one JSON line per step (rank 0)
    trace: str | None = None           # Perfetto trace of step trace_step (all ranks in one file)
    trace_step: int = 1                # 0-based; the default skips step 0, which records the gather order
    progress: bool = True              # tqdm bar on stderr (rank 0)


@dataclass
class TrainResult:
    """How a rank's run ended. ``summary`` (steps, losses, tokens/s, ...) is filled on rank 0 only."""

    rank: int
    world_size: int
    interrupted: bool
    summary: dict = field(default_factory=dict)
    stop_signal: int | None = None     # the signal that stopped the run (SIGINT, SIGTERM), if one did
