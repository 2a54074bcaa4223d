"""Validating :class:`TrainOptions` into the :class:`TrainRun` every rank runs.

Everything a user can get wrong is checked here, in the launching process,
before any rank starts: numbers, sizes, the model's shape (built on the meta
device), the config and its overrides, the data file, output paths and the
swap directory. Each error is one :class:`TrainError` naming the flag.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from infinity.config import Config, ConfigError, parse_size
from infinity.io.new_files import create_new, make_private_dir
from infinity.plan.auto import wants_auto
from infinity.train.errors import TrainError
from infinity.train.job_state import (check_fresh_save_dir, check_no_later_checkpoints, check_save_room,
                                      checkpoint_bytes, new_run_dir, read_job, resume_path, save_dir_of)
from infinity.train.models import ModelSpec, build_model, max_positions, parse_model_spec
from infinity.train.options import (DEFAULT_BATCH_SIZE, DEFAULT_MODEL, DEFAULT_SEQ_LEN, DEFAULT_STEPS,
                                    DEFAULT_SWAP_DIR, DEFAULT_VAL_FRACTION, TrainOptions, default_config)
from infinity.train.tokenizer import has_tokenizer_files, load_tokenizer

__all__ = ["TrainRun", "resolve", "effective_config", "prepare_swap_dir", "with_swap_dir", "under_torchrun",
           "check_int"]


@dataclass(frozen=True)
class TrainRun:
    """Validated options, picklable, sent to every rank."""

    config: dict                    # its schedule section has total_steps resolved to a number
    model: "ModelSpec"
    steps: int                      # the last step + 1 (a resumed run counts the steps before it)
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
    tokenizer: str | None = None    # a local tokenizer directory: --data (or the default corpus) is tokenized
    val_fraction: float = 0.0       # held-out tail of the data
    eval_every: int = 0
    eval_batches: int = 1
    save_dir: str | None = None     # None: no checkpoints
    save_every: int = 0
    keep_last: int | None = None
    resume: str | None = None       # the step directory to load before training
    start_step: int = 0
    lr_scheduler_state: dict | None = None
    sample_every: int = 0
    sample_tokens: int = 64
    lr_override: bool = False       # --lr given on --resume: the schedule continues from the new base lr
    save_node_local: bool = False   # each node saves its own ranks' files into its own save_dir


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
    """Create ``swap_dir`` (0700, as the swap files are private) and prove a file can be written there,
    before any rank starts. The probe file is new (O_EXCL | O_NOFOLLOW, an unguessable name): a symlink
    planted in the shared directory is never followed."""
    p = Path(swap_dir)
    try:
        if not p.is_dir():
            if not os.path.lexists(p.parent):   # a file in the way fails below, as 'Not a directory'
                p.parent.mkdir(parents=True, exist_ok=True)
            make_private_dir(p, exist_ok=True)
        probe = p / f".infinity-probe-{os.getpid()}-{secrets.token_hex(4)}"
        fd = create_new(probe)
        try:
            os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as e:
        raise TrainError(f"swap directory {p}: cannot create or write files there "
                         f"({e.strerror or e}); set --swap-dir to a writable directory on a local disk") from None


def _check_number(flag: str, value, least: float, below: float | None = None) -> float:
    """A finite number in [least, below): NaN and inf are refused here, naming the flag, not later as a
    diverged loss blamed on the learning rate."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not value >= least or (below is not None and not value < below):
        where = f"in [{least:g}, {below:g})" if below is not None else f">= {least:g}"
        raise TrainError(f"{flag} must be a finite number {where}, got {value!r}")
    return float(value)


def resolve(options: TrainOptions, world_size: int) -> TrainRun:
    """Check every option (and, with ``--resume``, the checkpoint's job state) into a :class:`TrainRun`."""
    o = options
    job, resume = {}, None
    if o.resume is not None:
        resume = resume_path(o.resume, o.save_dir)
    if resume is not None:
        job = read_job(resume)

    def pick(value, key, default):   # the flag if given, else the resumed run's, else the default
        return value if value is not None else job.get(key, default)

    steps = check_int("--steps", pick(o.steps, "steps", DEFAULT_STEPS), 1)
    batch_size = check_int("--batch-size", pick(o.batch_size, "batch_size", DEFAULT_BATCH_SIZE), 1)
    accum = check_int("--accum", o.accum if o.accum is not None else _config_accum(o.config), 1)
    seed = check_int("--seed", pick(o.seed, "seed", 0), 0)
    trace_step = check_int("--trace-step", o.trace_step, 0)
    eval_every = check_int("--eval-every", o.eval_every, 0)
    eval_batches = check_int("--eval-batches", o.eval_batches, 1)
    save_every = check_int("--save-every", o.save_every, 0)
    keep_last = None if o.keep_last is None else check_int("--keep-last", o.keep_last, 1)
    sample_every = check_int("--sample-every", o.sample_every, 0)
    sample_tokens = check_int("--sample-tokens", o.sample_tokens, 1)
    val_fraction = _check_number("--val-fraction", pick(o.val_fraction, "val_fraction", DEFAULT_VAL_FRACTION),
                                 0.0, 0.5)
    start_step = int(job.get("next_step", 0))
    if start_step >= steps:
        raise TrainError(f"--resume {resume}: the run already did {start_step} of {steps} steps; raise --steps "
                         "to train further")
    if o.trace is not None and not start_step <= trace_step < steps:
        raise TrainError(f"--trace-step {trace_step} is past the last step ({steps - 1}, 0-based); "
                         f"lower it or raise --steps")
    if batch_size % (world_size * accum):
        raise TrainError(f"--batch-size {batch_size} does not split evenly over {world_size} rank(s) x "
                         f"--accum {accum}; use a multiple of {world_size * accum}")
    for flag, value in (("--lr", o.lr), ("--min-lr", o.min_lr), ("--clip-grad-norm", o.clip_grad_norm)):
        if value is not None:
            _check_number(flag, value, 0.0)
    if o.stage is not None and o.stage not in (0, 1, 2, 3):
        raise TrainError(f"--stage must be 0, 1, 2 or 3, got {o.stage!r}")
    if eval_every and val_fraction == 0.0:
        raise TrainError(f"--eval-every {eval_every} needs held-out data: --val-fraction must be > 0 "
                         "(or --eval-every 0)")

    spec = parse_model_spec(pick(o.model, "model", DEFAULT_MODEL))
    with torch.device("meta"):   # check the shape without allocating it
        positions = max_positions(build_model(spec, 1)[0])
        seq_len = pick(o.seq_len, "seq_len", None)
        if seq_len is None:   # what the model allows, up to the default
            seq_len = min(DEFAULT_SEQ_LEN, positions) if positions else DEFAULT_SEQ_LEN
        seq_len = check_int("--seq-len", seq_len, 1)
        num_params = sum(p.numel() for p in build_model(spec, seq_len)[0].parameters())

    planned = _auto_config(o, spec, world_size, batch_size // accum, seq_len) if wants_auto(o.config) else None
    config, corpus_bytes = _config(o, job, steps, accum, planned)
    data = pick(o.data, "data", None)
    if corpus_bytes is not None and corpus_bytes < seq_len + 1:
        raise TrainError(f"--corpus-bytes {corpus_bytes} is too small for --seq-len {seq_len} "
                         f"(needs at least {seq_len + 1} bytes)")
    if corpus_bytes is not None and data is not None:
        raise TrainError("--corpus-bytes sizes the default corpus; it cannot be used with --data")
    tokenizer = _tokenizer(pick(o.tokenizer, "tokenizer", None), spec,
                           "--tokenizer" if o.tokenizer is not None else "the checkpoint's tokenizer")
    if data is not None:
        _check_data(Path(data), seq_len, val_fraction, tokenizer is None)

    save_dir = None
    if not o.save:
        if o.save_dir is not None or save_every or keep_last is not None:
            raise TrainError("--no-save cannot be combined with --save-dir, --save-every or --keep-last")
    else:
        save_dir = o.save_dir or (save_dir_of(resume) if resume is not None else new_run_dir())
        if resume is None:
            check_fresh_save_dir(save_dir)
        else:
            check_no_later_checkpoints(save_dir, start_step, resume)
        check_save_room(save_dir, checkpoint_bytes(num_params, config.optimizer.moments))

    off = config.offload
    on_nvme = any(getattr(off, k) == "nvme" for k in ("optimizer", "params", "grads"))
    swap_dir = config.tiers.nvme_path if (on_nvme or o.swap_dir is not None) else None
    return TrainRun(config=config.to_dict(), model=spec, steps=steps, batch_size=batch_size, seq_len=seq_len,
                accum=accum, seed=seed, data=data, corpus_bytes=corpus_bytes,
                metrics=_check_output("--metrics", o.metrics), trace=_check_output("--trace", o.trace),
                trace_step=trace_step, progress=bool(o.progress), swap_dir=swap_dir, tokenizer=tokenizer,
                val_fraction=val_fraction, eval_every=eval_every, eval_batches=eval_batches, save_dir=save_dir,
                save_every=save_every, keep_last=keep_last, resume=None if resume is None else str(resume),
                start_step=start_step, lr_scheduler_state=job.get("lr_scheduler"), sample_every=sample_every,
                sample_tokens=sample_tokens, lr_override=o.lr is not None and resume is not None,
                save_node_local=bool(pick(o.save_node_local, "save_node_local", False)) and save_dir is not None)


def _config_accum(config) -> int:
    """Without ``--accum``: the config's ``schedule.accum_steps`` (a DeepSpeed config's
    ``gradient_accumulation_steps``), else 1."""
    if config is None or wants_auto(config):
        return 1
    try:
        return Config.load(config).schedule.accum_steps
    except ConfigError as e:
        raise TrainError(str(e)) from None


def effective_config(options: TrainOptions) -> Config:
    """The config ``infinity train`` would run with ``options`` (its flags applied, ``auto`` planned, a DeepSpeed
    config read), checked as a run checks it but starting nothing and saving nothing: ``--print-config``."""
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else check_int("--nproc", options.nproc, 1)
    quiet = dataclasses.replace(options, save=False, save_dir=None, save_every=0, keep_last=None, metrics=None,
                                trace=None)
    return Config.from_dict(resolve(quiet, world).config)


def _auto_config(o: TrainOptions, spec, world_size: int, micro_batch: int, seq_len: int) -> dict:
    """``--config auto`` (or a file with ``offload: auto``): the planner's config for this job's model and
    micro-batch, logged on stderr (what was chosen, its predicted step, the next best and why they lost)."""
    from infinity.plan import InfeasiblePlan, PlanInputError
    from infinity.plan.auto import log_plan
    from infinity.train.auto import plan_train_config

    source = o.config
    if o.config == "auto":   # the default job (its dtype, schedule, optimizer), with the engine's knobs planned
        defaults = default_config(o.swap_dir or DEFAULT_SWAP_DIR).to_dict()
        source = {**{k: v for k, v in defaults.items() if k not in ("offload", "tiers")}, "offload": "auto"}
    try:
        sizes = {flag: None if value is None else parse_size(value, flag)
                 for flag, value in (("--host-bytes", o.host_bytes), ("--device-bytes", o.device_bytes))}
        chosen, plan = plan_train_config(source, spec.text, world_size, micro_batch * world_size, seq_len,
                                         o.swap_dir or DEFAULT_SWAP_DIR, sizes["--host-bytes"],
                                         sizes["--device-bytes"], say=lambda m: print(m, file=sys.stderr))
    except (ConfigError, InfeasiblePlan, PlanInputError) as e:
        raise TrainError(f"--config {o.config}: {e}") from None
    log_plan(plan)
    return chosen


def _config(o: TrainOptions, job: dict, steps: int, accum: int, planned: dict | None = None) -> tuple:
    """The config with the flags applied (and a resumed run's schedule); and --corpus-bytes. The
    schedule's ``accum_steps`` is ``--accum`` (the overlapped update reads it). ``planned``: the
    planner's config for ``--config auto``."""
    try:
        if planned is not None:
            config = Config.from_dict(planned)
        else:
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
        schedule = dict(job.get("schedule") or dataclasses.asdict(config.schedule))   # a resumed run keeps its schedule
        for key, value in (("warmup_steps", o.warmup_steps), ("lr_schedule", o.lr_schedule),
                           ("min_lr", o.min_lr), ("clip_grad_norm", o.clip_grad_norm)):
            if value is not None:
                schedule[key] = None if key == "clip_grad_norm" and value == 0 else value
        schedule["accum_steps"] = accum
        if schedule.get("total_steps") == "auto":
            schedule["total_steps"] = steps
        if o.config is None and not job and o.warmup_steps is None and schedule["warmup_steps"] >= steps:
            schedule["warmup_steps"] = steps // 10   # the default warmup, shrunk to fit a short run
        changes["schedule"] = schedule
        config = config.replace(**changes)
        resume_bytes = job.get("corpus_bytes")
        corpus = o.corpus_bytes if o.corpus_bytes is not None else resume_bytes
        corpus_bytes = None if corpus is None else parse_size(corpus, "--corpus-bytes")
    except ConfigError as e:
        raise TrainError(str(e)) from None
    s = config.schedule
    if s.lr_schedule != "constant" and s.total_steps <= s.warmup_steps:
        raise TrainError(f"--warmup-steps {s.warmup_steps} leaves no steps to decay over ({s.total_steps} in all); "
                         "lower it, raise --steps, or use --lr-schedule constant")
    return config, corpus_bytes


def _tokenizer(path: str | None, spec, what: str) -> str | None:
    """The tokenizer directory: --tokenizer, else an hf:PATH model's own (if it has one), else None (bytes)."""
    if path is None and spec.kind == "pretrained" and has_tokenizer_files(spec.name):
        path, what = spec.name, "the model's tokenizer"
    if path is None:
        return None
    tok = load_tokenizer(path, what)
    with torch.device("meta"):
        vocab = getattr(getattr(build_model(spec, 1)[0], "config", None), "vocab_size", None)
    if isinstance(vocab, int) and len(tok) > vocab:
        raise TrainError(f"{what} {path}: {len(tok)} tokens, more than the model's vocab_size {vocab}")
    return str(Path(path).expanduser().resolve())


def _check_data(data: Path, seq_len: int, val_fraction: float, as_bytes: bool) -> None:
    if not data.is_file() or not os.access(data, os.R_OK):
        raise TrainError(f"--data {data}: not a readable file")
    if not as_bytes:
        return   # its length in tokens is known once tokenized; each rank checks it then
    size = data.stat().st_size
    held_out = int(size * val_fraction)
    if size - held_out < seq_len + 1:
        raise TrainError(f"--data {data}: {size} bytes is too short for --seq-len {seq_len}")
    if val_fraction and held_out < seq_len + 1:
        raise TrainError(f"--data {data}: its held-out {val_fraction:g} ({held_out} bytes) is too short for "
                         f"--seq-len {seq_len}; raise --val-fraction, or hold nothing out with --val-fraction 0 "
                         "--eval-every 0")


def with_swap_dir(run: TrainRun, swap_dir: str | None) -> TrainRun:
    config = dict(run.config, tiers=dict(run.config["tiers"], nvme_path=swap_dir))
    return dataclasses.replace(run, config=config)
