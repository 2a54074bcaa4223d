"""Hugging Face ``Trainer`` on infinity: an existing Trainer script changes two or three lines.

.. code-block:: python

    from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments

    args = InfinityTrainingArguments(output_dir="out", infinity_config="configs/zero3-nvme.yaml", ...)
    trainer = InfinityTrainer(model=model, args=args, train_dataset=..., eval_dataset=...)
    trainer.train()                      # resume_from_checkpoint=True works
    trainer.save_model("final")          # AutoModelForCausalLM.from_pretrained("final")

``InfinityTrainingArguments`` is ``TrainingArguments`` plus ``infinity_config``
(``--infinity_config FILE`` through ``HfArgumentParser``, as ``--deepspeed
FILE`` is); ``InfinityTrainer(..., infinity_config=...)`` takes one with plain
``TrainingArguments`` too. It runs under ``python``, ``torchrun`` and
``accelerate launch``.

It follows the Trainer's DeepSpeed integration, one hook at a time:

- the engine is built with the trainer: ``infinity.initialize`` runs in
  ``__init__`` with the Trainer's two param groups (weight decay off for
  biases and norms) and hyper-parameters from ``TrainingArguments``
  (:mod:`infinity.integrations.trainer_options` says who owns what). The
  optimizer it returns is the one the Trainer steps and its LR scheduler
  drives; ``evaluate`` / ``predict`` / ``save_model`` work before ``train``.
- no ``DistributedDataParallel`` or ``DataParallel``: infinity does the
  collectives. accelerate registers the model as the Trainer registers a model
  sharded at load time (``prepare_model(evaluation_mode=True)``), which also
  keeps its later ``prepare`` from wrapping it.
- ``max_grad_norm`` clips through the engine (``param.grad`` is None: the
  gradients live in its shards, so torch's clipping would see nothing). With
  ``max_grad_norm=0`` no norm is computed or logged, since it costs a pass over
  every gradient shard (a read from disk when they are offloaded).
- the Trainer clears gradients with ``model.zero_grad()``, which only touches
  ``.grad``; the shards are cleared right after each optimizer step instead,
  as DeepSpeed's engine does in its ``step``.
- ``gradient_accumulation_steps``: every micro-batch's backward reduces into
  the shards (there is no ``no_sync`` to skip; stage 2-3 keep no full gradient).
  With ``optimizer.update_at`` the last micro-batch's backward updates
  (``schedule.accum_steps`` is set from it), or, when ``max_grad_norm`` clips,
  the update runs during the next forward (``update_at`` auto); exact either way.
- checkpoints (``save_steps``): ``checkpoint-N/`` holds an infinity sharded
  checkpoint in ``infinity/`` (``latest``, ``step_N``; every rank writes its
  shards, atomically), the consolidated model beside it (``model.safetensors``,
  ``config.json``: ``from_pretrained`` loads ``checkpoint-N``), and the
  Trainer's own files (``trainer_state.json``, ``scheduler.pt``,
  ``rng_state*.pth``, ``training_args.bin``). ``resume_from_checkpoint`` loads
  ``infinity/`` (model and optimizer states) where the Trainer
  would load its optimizer, then the scheduler; the Trainer restores the rest.
  ``load_best_model_at_end`` loads the best checkpoint's ``infinity/``. With
  ``save_only_model=True`` the shards are not kept and there is nothing to
  resume from, as with a plain Trainer.
- ``save_model(dir)``: a sharded save to a temporary directory inside ``dir``,
  consolidated by the saving rank into safetensors (bounded memory, whatever
  the model's size; :func:`infinity.checkpoint.consolidate`), then removed.
  It costs writing the whole training state once more than a plain
  ``state_dict`` save, and never gathers the model whole. Checkpoints and
  ``save_model`` need a directory every rank sees (as infinity checkpoints do).

A model larger than host memory: :func:`from_pretrained` builds a local checkpoint's model
on the meta device and the trainer materializes it unit by unit straight into the
config's tiers as it initializes the engine (as ``HfDeepSpeedConfig`` makes
``from_pretrained`` partition while loading)::

    model = from_pretrained("path/to/llama", "ds_config.json")   # nothing is loaded yet
    trainer = InfinityTrainer(model=model, args=args, ...)        # loaded here, one unit at a time

A DeepSpeed ``ds_config.json`` is accepted wherever a config is, read as the
Trainer's DeepSpeed integration reads one (see
:mod:`infinity.integrations.trainer_options`).

Not supported, each refused with an error naming the option: see
:mod:`infinity.integrations.trainer_options`. With ``precision.param_dtype:
fp16`` a step skipped on overflow still advances the Trainer's LR schedule
(accelerate cannot see infinity's loss scaler).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

import infinity
from infinity.checkpoint import consolidate
from infinity.config import Config
from infinity.integrations.trainer_options import (check_accelerator, check_arguments, check_trainer_kwargs,
                                                   load_trainer_config, trainer_config)
from infinity.models.pretrained import PretrainedError, SafetensorsWeights, meta_model_from_pretrained
from infinity.train.schedule import build_lr_scheduler

__all__ = ["InfinityTrainer", "InfinityTrainingArguments", "from_pretrained", "SHARDED_DIR"]

SHARDED_DIR = "infinity"                  # inside checkpoint-N/: the sharded checkpoint that resumes
_SAVE_MODEL_TMP = ".infinity-save_model"  # inside save_model's directory while it is consolidated
_SCHEDULER_NAME = "scheduler.pt"          # the Trainer's file names (transformers.trainer)
_TRAINING_ARGS_NAME = "training_args.bin"
# Trainer hooks overridden here; a transformers without them would train without clipping, silently
_OVERRIDDEN = ("_wrap_model", "_clip_grad_norm", "_get_grad_norm", "_save_optimizer_and_scheduler",
               "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_best_model", "save_model",
               "_move_model_to_device", "create_scheduler")


@dataclass(frozen=True)
class _PendingLoad:
    """A :func:`from_pretrained` model's weights, waiting for the trainer that initializes it."""

    weights: SafetensorsWeights
    config: object   # the infinity_config given to from_pretrained, or None


# model -> its pending load; weak, so a model dropped before any trainer took it takes its entry along
_PENDING: "weakref.WeakKeyDictionary[torch.nn.Module, _PendingLoad]" = weakref.WeakKeyDictionary()


def from_pretrained(path, infinity_config=None, **config_overrides) -> torch.nn.Module:
    """A local ``transformers`` causal-LM checkpoint (``config.json`` and safetensors) as a model for
    :class:`InfinityTrainer`, loaded unit by unit into infinity's tiers when the trainer is built.

    Returns ``AutoModelForCausalLM.from_config`` of the checkpoint's config on the meta device (no weights
    in memory; ``config_overrides`` change that config). Every parameter is checked now to have a tensor
    of its shape in the files. ``InfinityTrainer(model=...)`` then initializes the engine with
    ``init_fn`` reading each unit's tensors from the memory-mapped files straight into its shards' home
    tiers: peak host memory is one unit's buffer plus the config's budgets, whatever the model's size.
    ``infinity_config`` (path, dict, Config or DeepSpeed config) is checked now and is the trainer's config
    unless the trainer is given one (``infinity_config=`` or ``InfinityTrainingArguments.infinity_config``).
    For a loop of your own, :func:`infinity.models.pretrained.initialize_pretrained` does the same with
    ``infinity.initialize``; passing this model to ``infinity.initialize`` without its ``init_fn`` would
    initialize it randomly.
    """
    if infinity_config is not None:
        Config.load(infinity_config)   # a bad config fails here, before the trainer is built
    model = meta_model_from_pretrained(path, **config_overrides)
    _PENDING[model] = _PendingLoad(SafetensorsWeights(path, model), infinity_config)
    return model


@dataclass
class InfinityTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the infinity config (``--infinity_config FILE`` on the command line)."""

    infinity_config: str | None = field(default=None, metadata={
        "help": "infinity config file (YAML or JSON): ZeRO stage, offload, tiers, precision; see infinity.Config. "
                "A DeepSpeed ds_config.json is read as the Trainer's DeepSpeed integration reads one"})

    @property
    def place_model_on_device(self) -> bool:
        # infinity.initialize places the model (a model bigger than the device is never moved there whole)
        return False


class InfinityTrainer(Trainer):
    """A ``transformers.Trainer`` whose model and optimizer are infinity's. Arguments are the Trainer's
    (by keyword after ``args``) plus ``infinity_config``: a path, dict or :class:`infinity.Config`,
    default ``args.infinity_config``."""

    def __init__(self, model=None, args=None, *, infinity_config=None, **kwargs):
        missing = [name for name in _OVERRIDDEN if not hasattr(Trainer, name)]
        if missing:
            import transformers
            raise RuntimeError(f"InfinityTrainer: transformers {transformers.__version__} has no Trainer.{missing[0]}; "
                               "install the version the hf extra names (pip install 'infinity[hf]')")
        check_trainer_kwargs(kwargs)
        if model is None:
            raise ValueError("InfinityTrainer: pass model= (the module infinity shards)")
        if args is None:
            args = InfinityTrainingArguments(output_dir="tmp_trainer")
        pending = _PENDING.get(model)
        source = next((c for c in (infinity_config, getattr(args, "infinity_config", None),
                                   pending.config if pending is not None else None) if c is not None), None)
        if source is None:
            raise ValueError("InfinityTrainer: no infinity config; pass infinity_config= or "
                             "InfinityTrainingArguments(infinity_config=PATH)")
        setup = load_trainer_config(source, args)
        args = setup.args   # a DeepSpeed config took over its precision and checkpointing flags
        config = trainer_config(setup.config, args, schedule_from_config=setup.schedule_from_config)
        check_arguments(args, config)
        super().__init__(model=model, args=args, **kwargs)
        check_accelerator(self)
        self._setup = dataclasses.replace(setup, config=config)
        init_fn = pending.weights if pending is not None else None
        model, optimizer = infinity.initialize(model, config, params=self._param_groups(model), init_fn=init_fn)
        if pending is not None:
            del _PENDING[model]
            left = pending.weights.missing(model)
            if left:
                infinity.engine_of(model).close()
                raise PretrainedError(f"{pending.weights.directory}: parameter {left[0]!r} was never filled "
                                      "(initialize did not pass its module to init_fn)")
        self.infinity_optimizer = optimizer   # ZeroAdamW; self.optimizer is accelerate's wrapper of it
        self.model = self.model_wrapped = self.accelerator.prepare_model(model, device_placement=False,
                                                                         evaluation_mode=True)
        # device_placement False: accelerate would round-trip the optimizer through (load_)state_dict, and
        # torch's load_state_dict replaces the param_groups the engine reads its lr from
        self.optimizer = self.accelerator.prepare(optimizer, device_placement=[False])
        self.callback_handler.optimizer = self.optimizer
        self.add_callback(_ClearGradientsAfterStep(optimizer))
        self._sharded_at = None   # (checkpoint dir, step) of the last sharded save

    # ------------------------------------------------------------ the model and its optimizer

    def _param_groups(self, model) -> list:
        """The Trainer's groups (``create_optimizer``): weight decay on all but biases and norms."""
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return model   # never DDP / DataParallel: the engine reduces the gradients itself

    def _move_model_to_device(self, model, device) -> None:
        # infinity.initialize places the model, each unit's shard made on the device: a model bigger than the
        # device, or one still on meta (from_pretrained), is never moved whole
        return None

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's scheduler (``lr_scheduler_type``), or where a DeepSpeed config has a ``scheduler``,
        infinity's schedule of it, as the Trainer's DeepSpeed integration uses DeepSpeed's."""
        if not self._setup.schedule_from_config:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            schedule = self._setup.config.schedule
            if schedule.total_steps not in ("auto", num_training_steps):
                raise ValueError(f"InfinityTrainer: DeepSpeed scheduler.params.total_num_steps={schedule.total_steps} "
                                 f"disagrees with the run's {num_training_steps} steps; set it to \"auto\"")
            warmup = self.args.get_warmup_steps(num_training_steps) if self._setup.auto_warmup else \
                schedule.warmup_steps
            schedule = dataclasses.replace(schedule, warmup_steps=warmup, total_steps=num_training_steps)
            self.lr_scheduler = build_lr_scheduler(optimizer if optimizer is not None else self.optimizer, schedule,
                                                   num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _clip_grad_norm(self, model):
        return self.infinity_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm   # None without clipping: a norm alone would cost a pass over every gradient shard

    # ------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The consolidated model (``from_pretrained`` loads ``output_dir``); every rank must call it. Inside a
        ``save_steps`` checkpoint the sharded checkpoint it is made from stays in ``SHARDED_DIR``."""
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        keep = _internal_call and not self.args.save_only_model
        root = out / (SHARDED_DIR if keep else _SAVE_MODEL_TMP)
        if not keep and self._is_rank_zero():
            # left by a save_model that died; removed before save_checkpoint's first exchange, so no rank
            # has written into it yet
            shutil.rmtree(root, ignore_errors=True)
        path = infinity.save_checkpoint(root, self.model, self.infinity_optimizer, step=self.state.global_step)
        if keep:
            self._sharded_at = (str(out), self.state.global_step)
        error = None
        if self.args.should_save:
            try:
                self._write_pretrained(path, out)
            except Exception as e:  # every rank must learn of it, or they would wait in the next collective
                error = f"{type(e).__name__}: {e}"
            finally:
                if not keep:
                    shutil.rmtree(root, ignore_errors=True)
        failed = [(r, e) for r, e in enumerate(self._exchange(error)) if e is not None]
        if failed:
            raise RuntimeError(f"InfinityTrainer.save_model: rank {failed[0][0]} could not write {out} "
                               f"({failed[0][1]})")
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _write_pretrained(self, checkpoint: Path, out: Path) -> None:
        """What ``Trainer._save`` writes, the weights consolidated from the sharded checkpoint."""
        consolidate(checkpoint, out)   # model.safetensors (or shards + index) and config.json
        generation = getattr(self.model, "generation_config", None)
        if generation is not None and getattr(self.model, "can_generate", lambda: False)():
            generation.save_pretrained(out)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        torch.save(self.args, out / _TRAINING_ARGS_NAME)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the optimizer's states are in the sharded checkpoint save_model just wrote there (the Trainer saves
        # the model first); written here if it did not
        if self._sharded_at != (str(Path(output_dir)), self.state.global_step):
            infinity.save_checkpoint(Path(output_dir) / SHARDED_DIR, self.model, self.infinity_optimizer,
                                     step=self.state.global_step)
            self._sharded_at = (str(Path(output_dir)), self.state.global_step)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    # ------------------------------------------------------------ resuming

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # called before training starts; the shards are loaded with the optimizer (below), once the scheduler
        # exists, so the learning rate the checkpoint holds is the one the next step uses
        sharded = Path(resume_from_checkpoint) / SHARDED_DIR
        if not (sharded / "latest").is_file():
            raise ValueError(f"InfinityTrainer: {resume_from_checkpoint} has no {SHARDED_DIR}/ sharded checkpoint "
                             "(saved by a plain Trainer, or with save_only_model=True), so there is no optimizer "
                             "state to resume; resume from a checkpoint InfinityTrainer saved")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        # model, optimizer states, steps and hyper-parameters; the RNG streams are the Trainer's (rng_state*.pth)
        infinity.load_checkpoint(Path(checkpoint) / SHARDED_DIR, self.model, self.infinity_optimizer,
                                 load_rng=False)
        scheduler = Path(checkpoint) / _SCHEDULER_NAME
        if not scheduler.is_file():
            raise ValueError(f"InfinityTrainer: {scheduler} is missing; the checkpoint is incomplete")
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        # load_best_model_at_end: the best checkpoint's shards (model and optimizer, as DeepSpeed loads both)
        best = Path(self.state.best_model_checkpoint) / SHARDED_DIR
        if not (best / "latest").is_file():
            raise ValueError(f"InfinityTrainer: the best checkpoint {self.state.best_model_checkpoint} has no "
                             f"{SHARDED_DIR}/ sharded checkpoint to load the best model from")
        infinity.load_checkpoint(best, self.model, self.infinity_optimizer, load_rng=False)

    # ------------------------------------------------------------ ranks

    def _is_rank_zero(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def _exchange(self, value) -> list:
        """Every rank's ``value``, in rank order (one rank: a list of one)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [value]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out


class _ClearGradientsAfterStep(TrainerCallback):
    """Clears the gradient shards after each optimizer step (the Trainer's ``model.zero_grad()`` cannot)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer.zero_grad()
