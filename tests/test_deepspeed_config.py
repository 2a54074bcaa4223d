"""A DeepSpeed ``ds_config.json`` is read as the infinity config that means the same.

Four configs as DeepSpeed users write them (the ZeRO-3 + NVMe and ZeRO-3 + CPU offload
examples of DeepSpeed's tutorials and config reference, transformers' ``"auto"`` ZeRO-2 and
ZeRO-3 templates) each read into the infinity config an infinity user would write for it, and
training with the DeepSpeed file is bitwise training with that YAML (world size 1, and the CPU
offload one at 2). ``"auto"`` values are filled from the Trainer's arguments; an unknown key
and a value infinity cannot honour are one-line errors naming the key; DeepSpeed's own tuning
knobs are said once and ignored; ``infinity train --print-config`` shows what a file became.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml

import deepspeed_cases as cases
from infinity import deepspeed_config
from infinity.config import Config, ConfigError
from infinity.deepspeed_config import KEYS, TrainerValues, is_deepspeed, read_deepspeed

NAMES = list(cases.DEEPSPEED)


@pytest.fixture
def pair(tmp_path, request):
    return cases.write_pair(request.param, tmp_path, str(tmp_path / "swap"))


@pytest.mark.parametrize("pair", NAMES, indirect=True, ids=NAMES)
def test_each_config_reads_as_its_infinity_yaml(pair):
    """``Config.from_deepspeed`` of the file, and ``Config.load`` / ``from_dict`` recognising it, all give
    the config its equivalent infinity YAML gives."""
    ds, yml = pair
    expected = Config.from_file(yml)
    assert Config.from_deepspeed(ds) == expected
    assert Config.load(ds) == expected
    assert Config.from_dict(json.loads(ds.read_text())) == expected
    assert is_deepspeed(json.loads(ds.read_text())) and not is_deepspeed(yaml.safe_load(yml.read_text()))


@pytest.mark.parametrize("pair", NAMES, indirect=True, ids=NAMES)
def test_training_with_the_deepspeed_config_is_bitwise_the_yaml_run(pair):
    """``infinity.initialize(model, "ds_config.json")`` trains exactly as with the equivalent YAML: every loss
    and every trained parameter equal (torch.equal), with the schedule, clipping and accumulation it maps."""
    ds, yml = pair
    ours, theirs = cases.train_run(str(ds)), cases.train_run(str(yml))
    assert ours["losses"] == theirs["losses"] and ours["lrs"] == theirs["lrs"]
    assert ours["losses"][-1] < ours["losses"][0]
    assert ours["params"].keys() == theirs["params"].keys()
    assert all(torch.equal(ours["params"][n], theirs["params"][n]) for n in ours["params"])


def test_two_ranks_train_bitwise_as_the_yaml(worlds, tmp_path):
    """The ZeRO-3 CPU-offload config (fp16, loss scaling, WarmupDecayLR, clipping) on two gloo ranks: losses
    on every rank and the trained parameters equal the equivalent YAML's run."""
    ds, yml = cases.write_pair("zero3-cpu", tmp_path, str(tmp_path / "swap"))
    world = worlds(2)
    ours, theirs = world.run(cases.train_run, str(ds)), world.run(cases.train_run, str(yml))
    for r in range(2):
        assert ours[r]["losses"] == theirs[r]["losses"], f"rank {r}"
    assert all(torch.equal(ours[0]["params"][n], theirs[0]["params"][n]) for n in ours[0]["params"])


TRAINER = TrainerValues(learning_rate=2e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, max_grad_norm=1.0,
                        accum_steps=2, micro_batch=4, world_size=2, bf16=True, fp16=False)


def test_auto_values_are_filled_from_the_trainer_arguments():
    """Under the Trainer, transformers' ZeRO-3 template takes bf16, the AdamW hyper-parameters, clipping and
    accumulation from ``TrainingArguments``; its WarmupLR warmup is left for the run's step count."""
    reading = read_deepspeed(cases.deepspeed_config("trainer-zero3", "unused"), TRAINER)
    c = reading.config
    assert c.precision.param_dtype == "bf16"
    assert (c.optimizer.lr, c.optimizer.betas, c.optimizer.eps, c.optimizer.weight_decay) == (2e-5, (0.9, 0.999),
                                                                                              1e-8, 0.01)
    assert (c.schedule.clip_grad_norm, c.schedule.accum_steps, c.schedule.lr_schedule) == (1.0, 2, "constant")
    assert (c.zero.stage, c.offload.params, c.offload.optimizer) == (3, "host", "host")
    assert c.prefetch.max_live_bytes == 2 * 10**9   # 1e9 elements of bf16
    assert reading.scheduler and reading.auto_warmup
    gradient_checkpointing = TrainerValues(**{**TRAINER.__dict__, "gradient_checkpointing": True})
    assert read_deepspeed(cases.deepspeed_config("trainer-zero2", "unused"),
                          gradient_checkpointing).config.zero.activation_checkpointing is True


def test_cpu_checkpointing_offloads_the_checkpointed_inputs_to_host_memory():
    """DeepSpeed's ``cpu_checkpointing`` keeps each checkpointed activation in CPU memory until its backward:
    infinity's ``zero.activation_offload: host`` with the units checkpointed. Under a Trainer that does not
    checkpoint, DeepSpeed's flag would move nothing: refused, naming both."""
    ds = {"zero_optimization": {"stage": 3}, "activation_checkpointing": {"cpu_checkpointing": True}}
    zero = Config.from_dict(ds).zero
    assert (zero.activation_checkpointing, zero.activation_offload) == (True, "host")
    checkpointing = TrainerValues(**{**TRAINER.__dict__, "gradient_checkpointing": True, "bf16": None})
    zero = read_deepspeed(dict(ds, bf16={"enabled": "auto"}), checkpointing).config.zero
    assert (zero.activation_checkpointing, zero.activation_offload) == (True, "host")
    with pytest.raises(ConfigError, match="cpu_checkpointing: true moves checkpointed activations, and "
                                          "TrainingArguments gradient_checkpointing is off"):
        read_deepspeed(dict(ds, bf16={"enabled": "auto"}), TRAINER)
    assert Config.from_dict({**ds, "activation_checkpointing": {"cpu_checkpointing": False}}).zero.activation_offload \
        == "none"


@pytest.mark.parametrize("key, value, named", [
    ("gradient_accumulation_steps", 4, "gradient_accumulation_steps=4 disagrees with TrainingArguments "
                                       "gradient_accumulation_steps=2"),
    ("train_micro_batch_size_per_gpu", 8, "per_device_train_batch_size=4"),
    ("train_batch_size", 32, "train_batch_size=32 disagrees"),
    ("gradient_clipping", 0.5, "gradient_clipping=0.5 disagrees with TrainingArguments max_grad_norm=1"),
])
def test_an_explicit_value_that_disagrees_with_the_trainer_is_refused(key, value, named):
    """As transformers does, an explicit DeepSpeed value the Trainer's arguments contradict is an error naming
    both (``"auto"`` would take the argument)."""
    ds = dict(cases.deepspeed_config("trainer-zero2", "unused"), **{key: value})
    with pytest.raises(ConfigError) as e:
        read_deepspeed(ds, TRAINER)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("patch, named", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "swap_folder": "x"}}},
     "unknown DeepSpeed key zero_optimization.offload_param.swap_folder; valid keys in "
     "zero_optimization.offload_param: device, nvme_path"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "unknown DeepSpeed key zero_optimization.overlap_com"),
    ({"bf16": {"enabled": True}, "train_batch_sise": 8}, "unknown DeepSpeed key train_batch_sise; valid keys at "
                                                          "the top level: zero_optimization"),
    ({"aio": {"block_size": 1048576, "queue_dept": 8}}, "unknown DeepSpeed key aio.queue_dept"),
])
def test_an_unknown_key_is_one_line_naming_it_and_the_valid_ones(patch, named):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(patch)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("patch, named", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio: 0.3 cannot be honoured"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type: 'Lamb' cannot be honoured"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "optimizer.params.adam_w_mode: False"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type: 'OneCycle' cannot be honoured"),
    ({"fp16": {"enabled": True, "min_loss_scale": 1e-4}}, "fp16.min_loss_scale: 0.0001 cannot be honoured"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0}},
     "zero_optimization.stage3_max_live_parameters: 0 cannot be honoured"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param: device 'cpu' needs stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}},
     "zero_optimization.offload_optimizer.nvme_path: '/b' differs from offload_param.nvme_path '/a'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.nvme_path: required with device nvme"),
    ({"aio": {"use_gds": True}}, "aio.use_gds: True cannot be honoured"),
    ({"aio": {"block_size": 1000}}, "aio.block_size: 1000 must be a multiple of 4096"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled and fp16.enabled are both true"),
    ({"bf16": {"enabled": True}, "zero": {"stage": 3}}, "mixes DeepSpeed keys (bf16) with infinity's section 'zero'"),
])
def test_a_value_infinity_cannot_honour_is_one_line_naming_the_key(patch, named):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(patch)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_file_error_names_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}))
    with pytest.raises(ConfigError, match=r"ds\.json: DeepSpeed zero_optimization\.offload_param\.device: "
                                          r"expected none, cpu or nvme, got 'disk'"):
        Config.from_deepspeed(path)


def test_tuning_knobs_are_said_once_then_ignored(caplog, monkeypatch):
    """A DeepSpeed knob infinity sizes itself is one log line naming it and what infinity uses instead, once per
    process however often a config holding it is read."""
    monkeypatch.setattr(deepspeed_config, "_said", set())
    ds = cases.deepspeed_config("trainer-zero3", "unused")
    with caplog.at_level(logging.WARNING, logger="infinity.deepspeed_config"):
        Config.from_deepspeed(ds)
        Config.from_deepspeed(ds)
    lines = [r.getMessage() for r in caplog.records]
    said = [line.split()[2] for line in lines]
    assert len(said) == len(set(said))   # once each
    assert "zero_optimization.sub_group_size" in said and "fp16.hysteresis" in said
    assert all(KEYS[k].fate == "sized here" for k in said)
    overlap = next(line for line in lines if "overlap_comm" in line)
    assert overlap.startswith("infinity: DeepSpeed zero_optimization.overlap_comm is not used: ")


def test_print_config_shows_what_the_deepspeed_config_became(tmp_path, capsys):
    """``infinity train --config ds.json --print-config`` prints the infinity config the run would use (YAML,
    flags applied) and exits 0 without training; a bad file is one line on stderr and exit code 2."""
    from infinity.cli import main

    ds, _ = cases.write_pair("zero3-nvme", tmp_path, str(tmp_path / "swap"))
    assert main(["train", "--config", str(ds), "--print-config", "--steps", "7", "--lr", "0.002"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = Config.from_deepspeed(ds).replace(optimizer={"lr": 0.002}, schedule={"total_steps": 7})
    assert Config.from_dict(printed) == expected
    assert not (tmp_path / "swap").exists()   # nothing started
    assert main(["train", "--print-config", "--json"]) == 0   # any config: here the default one
    assert json.loads(capsys.readouterr().out)["zero"]["stage"] == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"ratio": 0.5}}}))
    assert main(["train", "--config", str(bad), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown DeepSpeed key zero_optimization.offload_param.ratio" in err and "\n" not in err


def test_infinity_train_accumulates_as_the_deepspeed_config_says(tmp_path, capsys):
    """Without ``--accum``, ``infinity train`` accumulates the config's ``gradient_accumulation_steps``."""
    from infinity.cli import main

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}))
    assert main(["train", "--config", str(ds), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["schedule"]["accum_steps"] == 2
    assert main(["train", "--config", str(ds), "--print-config", "--accum", "1"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["schedule"]["accum_steps"] == 1


def test_infinity_plan_plans_from_a_deepspeed_config(tmp_path, capsys):
    """``infinity plan --config ds.json`` keeps what the file says of precision, optimizer and schedule and
    chooses the rest; the plan it prints is a config with those values."""
    from plan_cases import write_profile

    from infinity.cli import main

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.98], "weight_decay": 0.05}},
        "gradient_clipping": 0.7, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    assert main(["plan", "--model", "tiny:n_layer=2,n_embd=64,n_head=4,block_size=32", "--config", str(ds),
                 "--host-bytes", "8MiB", "--device-bytes", "2MiB", "--profile", write_profile(tmp_path / "p.json"),
                 "--tokens", "64", "--swap-dir", str(tmp_path / "swap"), "--json"]) == 0
    chosen = Config.from_dict(json.loads(capsys.readouterr().out)["config"])
    assert (chosen.optimizer.lr, chosen.optimizer.betas, chosen.optimizer.weight_decay) == (2e-4, (0.9, 0.98), 0.05)
    assert chosen.schedule.clip_grad_norm == 0.7 and chosen.precision.param_dtype == "fp32"


def test_the_readme_table_is_the_mapping():
    """The migration page's key table (docs/migrating-from-deepspeed.md) is :func:`mapping_table` of the
    mapping itself, so the two cannot drift (regenerate it with ``python -m infinity.deepspeed_config``)."""
    from pathlib import Path

    from infinity.deepspeed_config import mapping_table

    readme = (Path(__file__).resolve().parents[1] / "docs" / "migrating-from-deepspeed.md").read_text()
    start, end = "<!-- deepspeed-keys:start -->\n", "\n<!-- deepspeed-keys:end -->"
    assert start in readme and end in readme
    assert readme.split(start, 1)[1].split(end, 1)[0] == mapping_table()
    rows = mapping_table().splitlines()[2:]
    assert all(f"`{path}`" in table_row for path, table_row in zip(
        [k for k, v in KEYS.items() if v.fate != "section" or v.note], rows))
