"""A DeepSpeed user's Trainer script on infinity: their ``ds_config.json`` and a local checkpoint.

``from_pretrained(path, ds_config)`` builds the checkpoint's model on the meta device and
``InfinityTrainer`` loads it unit by unit into the tiers the DeepSpeed config asks for (here
parameters and optimizer states on NVMe), filling the config's ``"auto"`` values from the
``TrainingArguments`` as transformers' DeepSpeed integration does. Its per-micro-batch losses
equal a plain ``Trainer`` run on the same checkpoint loaded with
``AutoModelForCausalLM.from_pretrained``: bitwise in one process, within 1e-5 relative at two
ranks (DDP's sums against ZeRO-3's reduce-scatter). A DeepSpeed ``scheduler`` is the run's
schedule; ``bf16`` and gradient checkpointing flags are taken over by the config; an explicit
value the arguments contradict is refused naming both.
"""

from __future__ import annotations

import pytest
import torch

import deepspeed_cases
import hf_trainer_cases as hc
import pretrained_trainer_cases as cases

REL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return cases.save_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-gpt2"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_from_pretrained_with_a_deepspeed_config_trains_as_the_plain_trainer(checkpoint, tmp_path):
    """One process: ``InfinityTrainer(from_pretrained(ckpt, ds_config))`` with parameters and optimizer states on
    NVMe gives the plain Trainer's learning rates bitwise and its per-micro-batch losses and gradient norms within
    1e-5 relative (fp32 sums in another order move the last bits),
    and its trained model the same logits; the state really went through the swap files."""
    plain = cases.fine_tune("plain", checkpoint, str(tmp_path / "plain"))
    ours = cases.fine_tune("ours", checkpoint, str(tmp_path / "ours"), cases.deepspeed_nvme(str(tmp_path / "swap")))
    # per-micro-batch losses: the same weights up to fp32 sums in another order (the gradients are reduced
    # over flat shards and the update runs on the stored copy), so equal to the last bits, not bitwise
    assert len(ours["losses"]) == len(plain["losses"]) == 8
    assert max(_rel(a, b) for a, b in zip(ours["losses"], plain["losses"])) <= REL
    assert ours["lrs"] == plain["lrs"] and len(ours["grad_norms"]) == len(plain["grad_norms"]) == 4
    # the norm's sum of squares runs over shards, not tensors: the last bit may differ
    assert max(_rel(a, b) for a, b in zip(ours["grad_norms"], plain["grad_norms"])) <= REL
    assert torch.allclose(ours["logits"], plain["logits"], rtol=REL, atol=1e-5)
    config = ours["config"]
    assert (config["offload"]["params"], config["offload"]["optimizer"]) == ("nvme", "nvme")
    assert config["optimizer"]["lr"] == 1e-3 and config["schedule"]["accum_steps"] == 2   # from the arguments
    assert ours["moved_bytes"].get("host->nvme", 0) > 0


def test_two_ranks_follow_the_plain_trainer(worlds, checkpoint, tmp_path):
    """Two gloo ranks: every rank's losses within 1e-5 relative of the plain Trainer's (DDP) run."""
    world = worlds(2)
    plain = world.run(cases.fine_tune, "plain", checkpoint, str(tmp_path / "plain"))
    ours = world.run(cases.fine_tune, "ours", checkpoint, str(tmp_path / "ours"),
                     cases.deepspeed_nvme(str(tmp_path / "swap")))
    for r in range(2):
        assert len(ours[r]["losses"]) == len(plain[r]["losses"]) == 8
        assert max(_rel(a, b) for a, b in zip(ours[r]["losses"], plain[r]["losses"])) <= REL, f"rank {r}"
        assert torch.allclose(ours[r]["logits"], plain[r]["logits"], rtol=REL, atol=1e-5)


def test_the_deepspeed_scheduler_and_flags_are_the_configs(checkpoint, tmp_path):
    """transformers' auto ZeRO-2 template: its WarmupLR is infinity's constant schedule warming up over the
    Trainer's ``warmup_steps``; ``--bf16`` makes it a bf16 run the engine computes (accelerate does not
    autocast: the Trainer's own ``bf16`` is off), and ``activation_checkpointing`` (``gradient_checkpointing``)
    checkpoints infinity's units."""
    config = deepspeed_cases.deepspeed_config("trainer-zero2", "unused")
    ours = cases.fine_tune("ours", checkpoint, str(tmp_path / "ours"), config, bf16=True,
                           activation_checkpointing=True)
    assert ours["lrs"] == [5e-4, 1e-3, 1e-3, 1e-3]   # (s + 1) / 2 of the peak, then the peak
    assert ours["config"]["precision"]["param_dtype"] == "bf16"
    assert ours["config"]["zero"]["activation_checkpointing"] is True
    assert ours["trainer_bf16"] is False and ours["mixed_precision"] == "no"
    assert ours["losses"][-1] == ours["losses"][-1]   # finite, trained


def test_an_argument_the_config_contradicts_is_refused_by_name(checkpoint, tmp_path):
    """An explicit DeepSpeed value the ``TrainingArguments`` contradict is a one-line error naming both."""
    config = dict(cases.deepspeed_nvme(str(tmp_path / "swap")), gradient_accumulation_steps=4)
    with pytest.raises(ValueError) as e:
        cases.fine_tune("ours", checkpoint, str(tmp_path / "ours"), config)
    assert "gradient_accumulation_steps=4 disagrees with TrainingArguments gradient_accumulation_steps=2" in \
        str(e.value) and "\n" not in str(e.value)


def test_from_pretrained_checks_the_files_before_any_trainer(tmp_path):
    """A checkpoint whose weights do not match its config is refused by ``from_pretrained``, naming the tensor."""
    from safetensors.torch import load_file, save_file

    from infinity.integrations.transformers import from_pretrained
    from infinity.models.pretrained import PretrainedError

    directory = cases.save_checkpoint(str(tmp_path / "ckpt"))
    tensors = load_file(f"{directory}/model.safetensors")
    tensors["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(3, 3)
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PretrainedError, match="transformer.h.0.mlp.c_fc.weight' has shape"):
        from_pretrained(directory, {"zero_optimization": {"stage": 3}})
    assert hc.VOCAB == 64


def _run_example(script: str, args: list, cwd, timeout_s: int = 300) -> None:
    """``python examples/<script> ARGS`` in ``cwd``, in its own session (killed whole on a timeout)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(repo / "examples" / script), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"{script} did not finish within {timeout_s} s: {err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]


_EXAMPLE_ARGS = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--logging_steps", "1",
                 "--learning_rate", "1e-3", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true"]


@pytest.mark.parametrize("script", ["finetune_llama_infinity.py", "run_clm_infinity.py"])
def test_the_examples_fine_tune_a_local_checkpoint_with_the_deepspeed_users_config(tmp_path, script):
    """Each example, given ``--infinity_config examples/ds_config_zero3_nvme.json`` unchanged (its swap directory
    ``./infinity_swap`` is the run's working directory's), fine-tunes a tiny local checkpoint (a Llama for the
    Llama example, a GPT-2 for run_clm) loaded through ``from_pretrained``: every step logged, and the output
    directory loads with ``AutoModelForCausalLM.from_pretrained``."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    repo = Path(__file__).resolve().parents[2]
    checkpoint = tmp_path / "model"
    if script.startswith("finetune_llama"):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                         ).save_pretrained(checkpoint)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(vocab_size=256, n_layer=2, n_embd=32, n_head=2, n_positions=64)
                        ).save_pretrained(checkpoint)
    out = tmp_path / "out"
    _run_example(script, ["--model_name_or_path", str(checkpoint), "--train_file", str(repo / "README.md"),
                          "--block_size", "32", "--output_dir", str(out), "--infinity_config",
                          str(repo / "examples" / "ds_config_zero3_nvme.json"), *_EXAMPLE_ARGS], cwd=tmp_path)
    state = json.loads((out / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]
    assert not (tmp_path / "infinity_swap").exists() or not any((tmp_path / "infinity_swap").iterdir())
    AutoModelForCausalLM.from_pretrained(out)
