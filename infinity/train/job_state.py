"""What a training job keeps in its checkpoints beside the model: where to save, and what ``--resume`` restores.

A job checkpoint is an ordinary :func:`infinity.save_checkpoint` directory
whose ``client_state`` holds :data:`JOB_KEY`::

    {"infinity_train": {"version": 1, "next_step": 12, "steps": 50, "model": "tiny", "seed": 0,
                        "batch_size": 8, "seq_len": 64, "accum": 1, "data": null, "corpus_bytes": null,
                        "tokenizer": null, "val_fraction": 0.05, "schedule": {...}, "lr_scheduler": {...}}}

The model, optimizer (moments, step counts, hyper-parameters), loss scaler
and each rank's RNG are in the checkpoint itself. Batches are a pure
function of ``(seed, step)``, so ``next_step`` is the data position.

Save directories: ``--save-dir DIR`` saves ``DIR/step_N`` and ``DIR/latest``.
Without it, each run gets ``checkpoints/run-<time>-<pid>`` (so two runs never
collide), and a resumed run keeps saving where it resumed from. A fresh run
refuses a save directory that already holds checkpoints (``--resume`` it, or
pick another).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from infinity.checkpoint.manifest import STEP_DIR_RE, Checkpoint, resolve_checkpoint_dir
from infinity.checkpoint.tensor_file import CheckpointError
from infinity.train.errors import TrainError
from infinity.train.options import DEFAULT_SAVE_ROOT
from infinity.optim.moment_codes import moment_format

__all__ = ["JOB_KEY", "JOB_VERSION", "RESUME_IF_SAVED", "read_job", "resume_path", "new_run_dir",
           "check_fresh_save_dir", "save_dir_of", "checkpoint_bytes", "check_save_room", "check_no_later_checkpoints"]

JOB_KEY = "infinity_train"
JOB_VERSION = 1
# --resume if-saved: the save dir's latest checkpoint if it has one, else a fresh run. The one command a
# launcher that restarts failed ranks (torchrun --max-restarts) can run unchanged the first time and after.
RESUME_IF_SAVED = "if-saved"


def _has_checkpoints(d: Path) -> bool:
    return d.is_dir() and any(STEP_DIR_RE.match(p.name) and (p / "manifest.json").is_file() for p in d.iterdir())


def resume_path(resume: str, save_dir: str | None) -> Path | None:
    """The step directory ``--resume`` names: a checkpoint path, or (``"auto"``) the save dir's latest;
    without ``--save-dir``, the newest run under :data:`DEFAULT_SAVE_ROOT`. ``"if-saved"``: the save dir's
    latest, None when it has none (a fresh run)."""
    if resume == RESUME_IF_SAVED:
        if save_dir is None:
            raise TrainError(f"--resume {RESUME_IF_SAVED}: give --save-dir, the directory a restarted run finds its "
                             "checkpoints in")
        if not _has_checkpoints(Path(save_dir)):
            return None
        root = Path(save_dir)
    elif resume == "auto":
        if save_dir is not None:
            root = Path(save_dir)
        else:
            runs = sorted(p for p in Path(DEFAULT_SAVE_ROOT).glob("run-*") if _has_checkpoints(p)) \
                if Path(DEFAULT_SAVE_ROOT).is_dir() else []
            if not runs:
                raise TrainError(f"--resume: no run with a checkpoint under ./{DEFAULT_SAVE_ROOT}; give a "
                                 "checkpoint path (--resume DIR) or the run's --save-dir")
            root = runs[-1]
    else:
        root = Path(resume)
    try:
        return resolve_checkpoint_dir(root)
    except CheckpointError as e:
        raise TrainError(f"--resume: {e}") from None


def read_job(step_dir: Path) -> dict:
    """The job state saved in ``step_dir``'s manifest (checked enough to resume from)."""
    try:
        manifest = Checkpoint(step_dir).manifest
    except CheckpointError as e:
        raise TrainError(f"--resume: {e}") from None
    job = (manifest.get("client_state") or {}).get(JOB_KEY)
    if not isinstance(job, dict):
        raise TrainError(f"--resume {step_dir}: not saved by infinity train (no {JOB_KEY!r} in its client_state); "
                         "load it with infinity.load_checkpoint in your own loop")
    if job.get("version") != JOB_VERSION:
        raise TrainError(f"--resume {step_dir}: job state version {job.get('version')!r}, this infinity reads "
                         f"{JOB_VERSION}")
    missing = [k for k in ("next_step", "steps", "model", "seed", "batch_size", "seq_len", "schedule",
                           "lr_scheduler") if k not in job]
    if missing:
        raise TrainError(f"--resume {step_dir}: job state lacks {missing[0]!r}")
    return job


def save_dir_of(step_dir: Path) -> str:
    """Where a resumed run keeps saving: the directory holding the step it resumed from."""
    return str(step_dir.parent)


def new_run_dir() -> str:
    """``checkpoints/run-YYYYmmdd-HHMMSS-<pid>``: a fresh run's own save directory."""
    return os.path.join(DEFAULT_SAVE_ROOT, time.strftime("run-%Y%m%d-%H%M%S") + f"-{os.getpid()}")


def check_fresh_save_dir(save_dir: str) -> None:
    """A fresh run must not write ``step_N`` beside another run's checkpoints (``latest`` would mix them)."""
    d = Path(save_dir)
    if d.exists() and not d.is_dir():
        raise TrainError(f"--save-dir {d}: exists and is not a directory")
    if _has_checkpoints(d):
        raise TrainError(f"--save-dir {d}: already holds checkpoints of another run; continue it with --resume "
                         f"(or --resume {d}), or give a new --save-dir")
    parent = d.parent if not d.exists() else d
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise TrainError(f"--save-dir {d}: {parent} is not writable")


def checkpoint_bytes(num_params: int, moments: str = "fp32") -> int:
    """About what one checkpoint of ``num_params`` parameters takes on disk: fp32 master weights and both
    Adam moments as they are stored (``optimizer.moments``: 12 bytes a parameter with fp32 moments, 8 with
    bf16, 6.03 with int8, over all ranks together), plus 1% and 1 MiB for padding, buffers and the JSON files."""
    per_param = 4 + 2 * moment_format(moments).itemsize
    return int(per_param * num_params * 1.01) + 2**20


def _existing_ancestor(d: Path) -> Path:
    while not d.exists():
        d = d.parent
    return d


def check_save_room(save_dir: str, needed_bytes: int) -> None:
    """Refuse, before training, a save directory whose file system cannot hold one more checkpoint: found at
    the end, a full disk would cost the whole run's training."""
    where = _existing_ancestor(Path(save_dir).absolute())
    if not os.access(where, os.W_OK):
        raise TrainError(f"--save-dir {save_dir}: {where} is not writable")
    try:
        st = os.statvfs(where)
    except OSError:
        return   # no answer (some network file systems): the save itself will tell
    free = st.f_bavail * st.f_frsize
    if free < needed_bytes:
        raise TrainError(f"--save-dir {save_dir}: {free / 2**20:.1f} MiB free on its file system ({where}), one "
                         f"checkpoint needs about {needed_bytes / 2**20:.1f} MiB; free space, pick another "
                         "--save-dir, or train without saving (--no-save)")


def check_no_later_checkpoints(save_dir: str, start_step: int, resume: Path) -> None:
    """A resumed run must not write its ``step_N`` beside checkpoints saved after its resume point: they come
    from the run it forks from, and one of them would collide with (or be mistaken for) its own."""
    d = Path(save_dir)
    later = sorted(int(m.group(1)) for p in d.iterdir() if (m := STEP_DIR_RE.match(p.name))
                   and int(m.group(1)) > start_step) if d.is_dir() else []
    if later:
        raise TrainError(f"--resume {resume}: {d} already holds step_{later[0]:08d}, saved after this checkpoint "
                         f"(step {start_step}); resume from the newest (--resume {d}), move the later "
                         "checkpoints away, or give a new --save-dir")
