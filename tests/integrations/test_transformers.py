"""Hugging Face ``Trainer`` on infinity: a stock ``transformers.Trainer`` run and ``InfinityTrainer`` side by side.

The same tiny GPT-2 (fp32, dropout off), data in a fixed order, linear schedule
with warmup, weight decay, ``max_grad_norm`` small enough to clip every step,
and ``gradient_accumulation_steps`` 2, trained by the plain ``Trainer`` (DDP
at two ranks) and by ``InfinityTrainer`` at ZeRO-3, in memory and with
parameters and optimizer states in NVMe files, at world sizes 1 (this
process) and 2 (a gloo world of real processes, as under ``torchrun``).
Per-micro-batch losses, gradient norms and learning rates follow the plain
run within 1e-5 relative (what is left is the order of float sums); eval loss,
``predict`` and the logits of the trained model too. A run killed (SIGKILL)
right after a ``save_steps`` checkpoint and resumed with
``resume_from_checkpoint=True`` in new processes continues bitwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import hf_trainer_cases as cases
from world import RankFailure

STEPS, ACCUM, MAX_GRAD_NORM = 8, 2, 0.5
REL = 1e-5


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Plain, in-memory and NVMe runs in this process (no torch.distributed)."""
    root = tmp_path_factory.mktemp("one_rank")
    out = {}
    for kind in ("plain", "memory", "nvme"):
        saved = str(root / f"{kind}-saved") if kind != "plain" else None
        out[kind] = [cases.train_and_check(kind, str(root / kind), swap_dir=str(root / "swap"), steps=STEPS,
                                           saved_model_dir=saved)]
    return out


@pytest.fixture(scope="module")
def two_ranks(worlds, tmp_path_factory):
    """The same three runs in a world of two ranks; the plain one is DDP."""
    root = tmp_path_factory.mktemp("two_ranks")
    world = worlds(2)
    out = {}
    for kind in ("plain", "memory", "nvme"):
        saved = str(root / f"{kind}-saved") if kind != "plain" else None
        out[kind] = world.run(cases.train_and_check, kind, str(root / kind), swap_dir=str(root / "swap"),
                              steps=STEPS, saved_model_dir=saved)
    return out


@pytest.fixture(params=[1, 2], ids=["world1", "world2"])
def runs(request):
    return request.getfixturevalue("one_rank" if request.param == 1 else "two_ranks")


@pytest.mark.parametrize("kind", ["memory", "nvme"])
def test_losses_follow_the_plain_trainer(runs, kind):
    """Every micro-batch loss, logged gradient norm (the clip fires each step) and learning rate matches the
    plain Trainer's within 1e-5 relative, on every rank."""
    for plain, ours in zip(runs["plain"], runs[kind]):
        assert len(ours["losses"]) == len(plain["losses"]) == STEPS * ACCUM
        worst = max(_rel(a, b) for a, b in zip(ours["losses"], plain["losses"]))
        assert worst <= REL, f"losses differ by {worst:.2e} relative"
        assert len(ours["grad_norms"]) == len(plain["grad_norms"]) == STEPS
        assert min(plain["grad_norms"]) > MAX_GRAD_NORM   # so clipping changed every step
        assert max(_rel(a, b) for a, b in zip(ours["grad_norms"], plain["grad_norms"])) <= REL
        assert ours["lrs"] == plain["lrs"]
        assert len(set(plain["lrs"])) > 2   # warmup and decay: the scheduler drives infinity's optimizer


@pytest.mark.parametrize("kind", ["memory", "nvme"])
def test_evaluate_predict_and_the_trained_model_follow_the_plain_trainer(runs, kind):
    """``evaluate()`` gives the plain Trainer's eval loss, ``predict()`` its logits, and a forward of the
    trained (stage-3 sharded) model its trained model's logits."""
    for plain, ours in zip(runs["plain"], runs[kind]):
        assert _rel(ours["eval_loss"], plain["eval_loss"]) <= REL
        assert ours["predictions"].shape == plain["predictions"].shape
        assert torch.allclose(ours["predictions"], plain["predictions"], rtol=REL, atol=1e-5)
        assert torch.allclose(ours["logits"], plain["logits"], rtol=REL, atol=1e-5)


@pytest.mark.parametrize("kind", ["memory", "nvme"])
def test_save_model_loads_with_from_pretrained(runs, kind):
    """``save_model(dir)`` writes a consolidated safetensors directory; ``AutoModelForCausalLM.from_pretrained``
    of it gives the trained model's logits, and nothing of the sharded save is left there."""
    ours = runs[kind][0]
    assert {"config.json", "model.safetensors", "training_args.bin"} <= set(ours["saved_files"])
    assert not any(name.startswith(".infinity") for name in ours["saved_files"])
    assert (ours["loaded_logits"] - ours["logits"]).abs().max().item() <= 1e-5


def test_nvme_run_moves_its_state_through_the_swap_files(runs):
    """With params and optimizer on NVMe (nothing host-resident) the state really went through the disk."""
    for ours in runs["nvme"]:
        moved = ours["moved_bytes"]
        assert moved.get("nvme->host", 0) > 0 and moved.get("host->nvme", 0) > 0, moved


def test_resume_after_a_kill_continues_bitwise(worlds, tmp_path):
    """Two ranks, params and optimizer on NVMe, a checkpoint every 4 steps: a run SIGKILLed right after
    step 4's checkpoint, resumed with ``resume_from_checkpoint=True`` in new processes, returns the
    uninterrupted run's losses for steps 5-8 bitwise; ``checkpoint-4`` holds the sharded checkpoint, the
    consolidated model and the Trainer's own files."""
    from transformers import AutoModelForCausalLM

    world = worlds(2)
    whole = world.run(cases.train_until, "nvme", str(tmp_path / "whole"), str(tmp_path / "swap-whole"), STEPS, 4)
    killed_dir, killed_swap = str(tmp_path / "killed"), str(tmp_path / "swap-killed")
    with pytest.raises(RankFailure):
        world.run(cases.train_until, "nvme", killed_dir, killed_swap, STEPS, 4, kill_after=4)
    assert sorted(os.listdir(killed_dir)) == ["checkpoint-4"]
    resumed = world.run(cases.train_until, "nvme", killed_dir, killed_swap, STEPS, 4, resume=True)
    half = STEPS // 2 * ACCUM
    for r in range(2):
        assert resumed[r]["global_step"] == STEPS
        assert resumed[r]["losses"] == whole[r]["losses"][half:], f"rank {r}"
    files = set(whole[0]["files"]["checkpoint-4"])
    assert {"infinity", "model.safetensors", "config.json", "trainer_state.json", "scheduler.pt",
            "rng_state_0.pth", "rng_state_1.pth", "training_args.bin"} <= files
    assert (Path(killed_dir) / "checkpoint-4" / "infinity" / "latest").read_text().strip() == "step_00000004"
    AutoModelForCausalLM.from_pretrained(Path(killed_dir) / "checkpoint-4")   # a checkpoint loads as a model


_CONFLICTS = [
    ({"bf16": True}, None, None, "bf16=True"),
    ({"activation_checkpointing": True}, None, None, "activation_checkpointing=True"),
    ({"optim": "sgd"}, None, None, "optim='sgd'"),
    ({"torch_compile": True}, None, None, "torch_compile=True"),
    ({"eval_strategy": "steps", "save_strategy": "steps", "load_best_model_at_end": True, "save_only_model": True},
     None, None, "load_best_model_at_end=True with save_only_model=True"),
    ({}, None, {"optimizer": {"lr": 0.01}}, "optimizer.lr=0.01 disagrees with TrainingArguments learning_rate"),
    ({}, None, {"schedule": {"clip_grad_norm": 1.0}}, "schedule.clip_grad_norm"),
    ({}, None, {"parallel": {"tensor": 2}}, "parallel.tensor=2"),
    ({}, {"model_init": cases.tiny_gpt2}, None, "model_init"),
    ({}, {"optimizers": (None, "a scheduler")}, None, "optimizers=(optimizer, scheduler)"),
]


@pytest.mark.parametrize("overrides,trainer_kwargs,config,named", _CONFLICTS,
                         ids=[c[3].split("=")[0].split(" ")[0] for c in _CONFLICTS])
def test_conflicting_options_are_refused_by_name(tmp_path, overrides, trainer_kwargs, config, named):
    """A Trainer option or config key infinity cannot honour is a one-line error naming it."""
    message = cases.refused(str(tmp_path), overrides, trainer_kwargs, config)
    assert named in message and "\n" not in message


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    """``load_best_model_at_end`` leaves the best checkpoint's model in the trainer (here the first of two, whose
    eval loss is the lower on this data), as ``from_pretrained`` of that checkpoint has it."""
    from transformers import AutoModelForCausalLM

    trainer = cases.build_trainer("memory", str(tmp_path / "out"), steps=4, eval_strategy="steps", eval_steps=2,
                                  save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                                  metric_for_best_model="eval_loss", greater_is_better=False)
    try:
        trainer.train()
        assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-2")
        best = AutoModelForCausalLM.from_pretrained(trainer.state.best_model_checkpoint)
        last = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-4")
        trainer.model.eval()
        with torch.no_grad():
            ours, theirs = trainer.model(cases.probe_ids()).logits, best(cases.probe_ids()).logits
            assert not torch.allclose(theirs, last(cases.probe_ids()).logits)   # so loading changed the model
        assert (ours - theirs).abs().max().item() <= 1e-5
    finally:
        cases._close(trainer)


def test_update_at_backward_refuses_clipping(tmp_path):
    """``optimizer.update_at: backward`` updates during backward: ``max_grad_norm`` > 0 is refused,
    naming the option (``auto`` would update during the next forward instead)."""
    config = {"zero": {"stage": 3}, "offload": {"optimizer": "nvme"}, "tiers": {"nvme_path": str(tmp_path / "s")},
              "optimizer": {"update_at": "backward"}}
    assert "max_grad_norm=0.5" in cases.refused(str(tmp_path), {}, None, config)
    assert "gradient_accumulation_steps" in cases.refused(
        str(tmp_path), {"max_grad_norm": 0.0}, None, dict(config, schedule={"accum_steps": 2}))


def test_overlapped_update_with_clipping_and_accumulation_is_bitwise_the_plain_one(tmp_path):
    """NVMe run with ``update_at`` auto (the Trainer clips every step and accumulates 2 micro-batches:
    the update runs during the next forward) against the same run without: losses, gradient norms and
    the trained model's logits bitwise equal."""
    runs = {kind: cases.train_and_check(kind, str(tmp_path / kind), swap_dir=str(tmp_path / f"swap-{kind}"),
                                        steps=4) for kind in ("nvme", "nvme-overlap")}
    plain, overlapped = runs["nvme"], runs["nvme-overlap"]
    assert overlapped["losses"] == plain["losses"] and overlapped["grad_norms"] == plain["grad_norms"]
    assert torch.equal(overlapped["logits"], plain["logits"])


def test_a_trainer_without_the_overridden_hooks_is_refused(tmp_path, monkeypatch):
    """A transformers whose Trainer lacks a hook InfinityTrainer overrides (so clipping would silently not
    happen) is refused at construction, naming the hook."""
    from transformers import Trainer
    monkeypatch.delattr(Trainer, "_get_grad_norm")
    assert "Trainer._get_grad_norm" in cases.refused(str(tmp_path), {})


def test_resuming_a_checkpoint_without_shards_is_refused(tmp_path):
    """``resume_from_checkpoint`` on a directory with no infinity sharded checkpoint (a plain Trainer's, or
    one saved with ``save_only_model``) is an error naming the directory, before any step."""
    trainer = cases.build_trainer("memory", str(tmp_path / "out"), steps=2)
    plain_checkpoint = tmp_path / "out" / "checkpoint-2"
    plain_checkpoint.mkdir(parents=True)
    try:
        with pytest.raises(ValueError, match="checkpoint-2 has no infinity/ sharded checkpoint"):
            trainer.train(resume_from_checkpoint=str(plain_checkpoint))
        assert trainer.recorded == []
    finally:
        cases._close(trainer)


@pytest.mark.slow
def test_example_script_trains_under_torchrun(tmp_path):
    """``examples/run_clm_infinity.py`` under ``torchrun --nproc_per_node 2`` (the launcher's env, no process
    group made beforehand) with parameters and optimizer on NVMe: it trains every step, writes a sharded
    checkpoint every 2, and its output directory loads with ``from_pretrained``."""
    import json
    import signal
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    repo = Path(__file__).resolve().parents[2]
    config = tmp_path / "nvme.json"
    config.write_text(json.dumps({"zero": {"stage": 3}, "offload": {"params": "nvme", "optimizer": "nvme"},
                                  "tiers": {"nvme_path": str(tmp_path / "swap")}, "io": {"threads": 1},
                                  "optimizer": {"threads": 1}}))
    out = tmp_path / "out"

    def run(max_steps):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(repo / "examples" / "run_clm_infinity.py"), "--model_type", "gpt2",
               "--config_overrides", "n_layer=2,n_embd=32,n_head=2", "--train_file", str(repo / "README.md"),
               "--block_size", "32", "--output_dir", str(out), "--infinity_config", str(config),
               "--max_steps", str(max_steps), "--per_device_train_batch_size", "2", "--save_steps", "2",
               "--logging_steps", "1", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true"]
        env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
        # its own session: on a timeout the launcher and both ranks are killed together
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            raise AssertionError(f"the example did not finish within 300 s: {err[-3000:]}") from None
        assert proc.returncode == 0, err[-3000:]

    run(4)
    assert (out / "checkpoint-2" / "infinity" / "latest").is_file()
    assert (out / "checkpoint-4" / "infinity" / "latest").is_file()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]
    AutoModelForCausalLM.from_pretrained(out)
