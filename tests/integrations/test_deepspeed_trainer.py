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
    NVMe gives the plain Trainer's per-micro-batch losses and learning rates bitwise (gradient norms within 1e-5),
    and its trained model the same logits; the state really went through the swap files."""
    plain = cases.fine_tune("plain", checkpoint, str(tmp_path / "plain"))
    ours = cases.fine_tune("ours", checkpoint, str(tmp_path / "ours"), cases.deepspeed_nvme(str(tmp_path / "swap")))
    assert len(ours["losses"]) == 8 and ours["losses"] == plain["losses"]
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
