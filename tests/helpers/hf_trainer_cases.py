"""Rank-side cases for the Hugging Face Trainer integration: one tiny GPT-2, plain ``Trainer`` or ``InfinityTrainer``.

Everything a comparison needs is fixed: the model is built from a seeded
``GPT2Config`` (fp32, dropout off, nothing downloaded), the data are seeded
random token windows read in order (``train_sampling_strategy="sequential"``),
and the Trainer's hyper-parameters (linear schedule with warmup, weight decay,
clipping that fires, gradient accumulation 2) are the same for both. Each case
returns plain Python values: the per-micro-batch losses ``training_step``
returned on this rank, the logged gradient norms, the eval loss, and so on.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import TrainerCallback

VOCAB, SEQ = 64, 16


class TokenWindows(Dataset):
    """``n`` seeded random windows of ``SEQ`` tokens; the labels are the inputs (the model shifts them)."""

    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def probe_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def infinity_config(kind: str, swap_dir: str | None) -> dict:
    if kind == "memory":
        return {"zero": {"stage": 3}}
    if kind == "nvme":   # parameters and optimizer states in files; small budgets so they really live there
        path = os.path.join(swap_dir, f"rank{rank()}")
        os.makedirs(path, exist_ok=True)
        # no chunk host-resident and a host budget of about two optimizer jobs: every step reads the files
        return {"zero": {"stage": 3}, "offload": {"params": "nvme", "optimizer": "nvme", "host_resident_bytes": 0},
                "tiers": {"nvme_path": path, "host_bytes": f"{320 // world_size()}KiB"}, "io": {"threads": 1},
                "optimizer": {"threads": 1}}
    if kind == "nvme-overlap":   # the same, the update overlapping compute (clipping: the next forward)
        config = infinity_config("nvme", swap_dir)
        return dict(config, optimizer=dict(config["optimizer"], update_at="auto"))
    raise ValueError(kind)


def trainer_arguments(out_dir: str, steps: int, **overrides) -> dict:
    args = dict(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                per_device_eval_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2,
                weight_decay=0.01, max_grad_norm=0.5, logging_steps=1, report_to="none", disable_tqdm=True,
                use_cpu=True, train_sampling_strategy="sequential", save_strategy="no", seed=0,
                log_level="error", log_level_replica="error")
    args.update(overrides)
    return args


def _recording(base):
    class Recording(base):
        """Keeps what ``training_step`` returned (this micro-batch's loss, divided as the Trainer divides it)."""
        recorded: list

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.recorded.append(float(loss))
            return loss
    return Recording


class _KillAfterSave(TrainerCallback):
    """This process dies (SIGKILL, no cleanup) right after the checkpoint of step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def build_trainer(kind: str, out_dir: str, steps: int = 8, swap_dir: str | None = None, callbacks=None,
                  **overrides):
    """A recording ``Trainer`` (kind ``plain``) or ``InfinityTrainer`` (``memory`` / ``nvme``)."""
    from transformers import Trainer, TrainingArguments
    from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments

    if dist.is_initialized():   # accelerate reads the launcher's variables even when the group is up (World's is)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    train, evaluation = TokenWindows(96, seed=0), TokenWindows(8, seed=1)
    if kind == "plain":
        trainer = _recording(Trainer)(model=tiny_gpt2(), args=TrainingArguments(**trainer_arguments(
            out_dir, steps, **overrides)), train_dataset=train, eval_dataset=evaluation, callbacks=callbacks)
    else:
        args = InfinityTrainingArguments(**trainer_arguments(out_dir, steps, **overrides),
                                         infinity_config=None)
        trainer = _recording(InfinityTrainer)(model=tiny_gpt2(), args=args, train_dataset=train,
                                              eval_dataset=evaluation, callbacks=callbacks,
                                              infinity_config=infinity_config(kind, swap_dir))
    trainer.recorded = []
    return trainer


def _close(trainer) -> None:
    from infinity.initialization import engine_of
    try:
        engine_of(trainer.model).close()
    except KeyError:   # a plain Trainer's model
        pass


def train_and_check(kind: str, out_dir: str, swap_dir: str | None = None, steps: int = 8,
                    saved_model_dir: str | None = None) -> dict:
    """Train, then ``evaluate``, ``predict`` and the trained model's logits on a probe batch; with
    ``saved_model_dir`` also ``save_model`` there and rank 0's ``from_pretrained`` logits of it."""
    from transformers import AutoModelForCausalLM

    trainer = build_trainer(kind, out_dir, steps, swap_dir)
    try:
        trainer.train()
        result = {"losses": trainer.recorded,
                  "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
                  "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
                  "eval_loss": trainer.evaluate()["eval_loss"],
                  "predictions": torch.as_tensor(trainer.predict(trainer.eval_dataset).predictions)}
        engine = getattr(trainer, "infinity_optimizer", None)
        if engine is not None and engine.engine.store is not None:
            stats = engine.engine.store.stats()
            result["moved_bytes"] = dict(stats["moved_bytes"])
        model = trainer.model
        model.eval()
        with torch.no_grad():   # every rank: at stage 3 a forward gathers each unit from all ranks
            result["logits"] = model(probe_ids()).logits
        if saved_model_dir is not None:
            trainer.save_model(saved_model_dir)
            if rank() == 0:
                loaded = AutoModelForCausalLM.from_pretrained(saved_model_dir)
                loaded.eval()
                with torch.no_grad():
                    result["loaded_logits"] = loaded(probe_ids()).logits
                result["saved_files"] = sorted(os.listdir(saved_model_dir))
        return result
    finally:
        _close(trainer)


def train_until(kind: str, out_dir: str, swap_dir: str | None, steps: int, save_steps: int,
                kill_after: int | None = None, resume: bool = False) -> dict:
    """Train with a checkpoint every ``save_steps``; ``kill_after``: SIGKILL this rank after that step's
    checkpoint; ``resume``: ``resume_from_checkpoint=True``. The losses this run's steps returned."""
    callbacks = [_KillAfterSave(kill_after)] if kill_after is not None else None
    trainer = build_trainer(kind, out_dir, steps, swap_dir, callbacks=callbacks, save_strategy="steps",
                            save_steps=save_steps)
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
        return {"losses": trainer.recorded, "global_step": trainer.state.global_step,
                "files": {d: sorted(os.listdir(os.path.join(out_dir, d))) for d in sorted(os.listdir(out_dir))
                          if d.startswith("checkpoint-")}}
    finally:
        _close(trainer)


def refused(out_dir: str, overrides: dict, trainer_kwargs: dict | None = None, config: dict | None = None) -> str:
    """The error ``InfinityTrainer(...)`` raises for these arguments (they conflict with infinity)."""
    from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments

    args = InfinityTrainingArguments(**trainer_arguments(out_dir, 4, **overrides))
    try:
        InfinityTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenWindows(8, 0),
                        infinity_config=config if config is not None else {"zero": {"stage": 3}},
                        **(trainer_kwargs or {}))
    except (ValueError, RuntimeError) as e:
        return str(e)
    raise AssertionError(f"InfinityTrainer accepted {overrides} {trainer_kwargs} {config}")
