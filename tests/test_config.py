"""The typed config tree (sizes, validation, loading), and every ready config in configs/, which each
load and train the tiny GPT a few steps (world size 1)."""

import json
from pathlib import Path

import pytest
import torch
import yaml

import infinity
from infinity.config import Config, ConfigError, format_size, parse_size
from infinity.data import TokenDataset
from infinity.models import GPT, gpt_config

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize(
    "text, expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * 2**20),
        ("8GiB", 8 * 2**30),
        ("1.5KiB", 1536),
        ("2 GB", 2 * 10**9),
        ("1e3", 1000),
        (0, 0),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12 bananas", "", "MiB", [1], None, True, "1.2.3GiB"])
def test_parse_size_rejects_garbage(bad):
    with pytest.raises(ConfigError, match="size"):
        parse_size(bad, "tiers.host_bytes")


def test_negative_size_names_key():
    with pytest.raises(ConfigError, match=r"tiers\.host_bytes: size must be >= 0"):
        Config.from_dict({"tiers": {"host_bytes": "-1GiB"}})


def test_format_size():
    assert format_size(1536) == "1.5KiB"
    assert format_size(100) == "100B"


def test_defaults_match_design():
    c = Config()
    assert c.zero.stage == 3
    assert c.optimizer.betas == (0.9, 0.95)
    assert c.io.block_bytes == 8 * 2**20
    assert c.offload.optimizer == "none"


def test_from_dict_parses_sizes_and_types():
    c = Config.from_dict(
        {
            "zero": {"stage": 3, "unit_classes": "Block"},
            "precision": {"param_dtype": "bf16"},
            "offload": {"optimizer": "nvme", "params": "nvme", "grads": "host"},
            "tiers": {"device_bytes": "512MiB", "nvme_path": "/tmp/x"},
            "prefetch": {"bytes": "64MiB"},
            "io": {"direct": False, "threads": 4},
        }
    )
    assert c.zero.unit_classes == ("Block",)
    assert c.tiers.device_bytes == 512 * 2**20
    assert c.tiers.host_bytes == "auto"
    assert c.prefetch.bytes == 64 * 2**20
    assert c.io.direct is False and c.io.threads == 4


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"zero": {"stag": 1}})
    msg = str(e.value)
    assert "zero.stag" in msg and "section 'zero'" in msg
    for valid in ("stage", "reshard_after_forward", "unit_classes", "bucket_bytes"):
        assert valid in msg


def test_unknown_section_lists_valid_sections():
    with pytest.raises(ConfigError, match=r"unknown config section 'zer0'.*zero, precision, optimizer"):
        Config.from_dict({"zer0": {}})


@pytest.mark.parametrize(
    "d, match",
    [
        ({"zero": {"stage": 5}}, r"zero\.stage: expected an integer in 0\.\.3, got 5"),
        ({"zero": {"stage": "3"}}, r"zero\.stage: expected an integer"),
        ({"zero": {"stage": True}}, r"zero\.stage: expected an integer"),
        ({"precision": {"param_dtype": "fp8"}}, r"precision\.param_dtype: expected one of \['auto', 'fp32', 'bf16', 'fp16'\]"),
        ({"optimizer": {"betas": [0.9]}}, r"optimizer\.betas: expected two numbers"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, r"optimizer\.betas: each beta must be in \[0, 1\)"),
        ({"optimizer": {"lr": -1}}, r"optimizer\.lr: expected a number >= 0"),
        ({"optimizer": {"eps": 0}}, r"optimizer\.eps: expected a number > 0"),
        ({"offload": {"optimizer": "disk"}}, r"offload\.optimizer: expected one of \['none', 'host', 'nvme'\]"),
        ({"offload": {"host_resident_bytes": "lots"}}, r"offload\.host_resident_bytes: cannot read 'lots' as a size"),
        ({"offload": {"host_resident_bytes": -1}}, r"offload\.host_resident_bytes: size must be >= 0"),
        ({"io": {"queue_depth": 0}}, r"io\.queue_depth: expected an integer >= 1"),
        ({"io": {"checksum": "yes"}}, r"io\.checksum: expected true or false"),
        ({"io": {"block_bytes": 1000}}, r"io\.block_bytes: must be a multiple of 4096"),
        ({"zero": []}, r"zero: expected a mapping"),
        ({"zero": {"activation_checkpointing": -1}}, r"zero\.activation_checkpointing: expected true, false or a"),
        ({"zero": {"activation_checkpointing": "all"}}, r"zero\.activation_checkpointing: expected true, false or a"),
        ({"zero": {"activation_checkpointing": 1.5}}, r"zero\.activation_checkpointing: expected true, false or a"),
    ],
)
def test_bad_values_name_key_and_expectation(d, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(d)


@pytest.mark.parametrize("value, stored, units", [(True, True, 12), (False, False, 0), (0, False, 0), (5, 5, 5),
                                                  (12, 12, 12), (40, 40, 12)])
def test_activation_checkpointing_takes_all_none_or_the_first_n_units(value, stored, units):
    zero = Config.from_dict({"zero": {"activation_checkpointing": value}}).zero
    assert zero.checkpointed_units(12) == units
    assert zero.activation_checkpointing == stored and type(zero.activation_checkpointing) is type(stored)


def test_nvme_needs_path():
    with pytest.raises(ConfigError, match=r"tiers\.nvme_path: required because offload\.params is 'nvme'"):
        Config.from_dict({"offload": {"params": "nvme"}})


@pytest.mark.parametrize(
    "d, match",
    [
        ({"zero": {"stage": 2}, "offload": {"params": "host"}}, r"offload\.params: 'host' needs zero\.stage 3"),
        ({"zero": {"stage": 1}, "offload": {"grads": "host"}}, r"offload\.grads: 'host' needs zero\.stage >= 2"),
        ({"zero": {"stage": 0}, "offload": {"optimizer": "host"}}, r"offload\.optimizer: needs zero\.stage >= 1"),
    ],
)
def test_offload_needs_matching_stage(d, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(d)


def test_from_file_yaml_and_json_round_trip(tmp_path):
    c = Config.from_dict({"zero": {"stage": 1}, "tiers": {"host_bytes": "1GiB"}})
    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump(c.to_dict()))
    j = tmp_path / "c.json"
    j.write_text(json.dumps(c.to_dict()))
    assert Config.from_file(y) == c
    assert Config.from_file(j) == c
    assert Config.load(str(y)) == c and Config.load(c) is c and Config.load(c.to_dict()) == c


def test_from_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*missing.yaml"):
        Config.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero: {stage: [\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        Config.from_file(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("io: {blocks: 3}\n")
    with pytest.raises(ConfigError, match=r"unknown.yaml: unknown key io\.blocks"):
        Config.from_file(unknown)


def test_yaml_is_safe_loaded(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("zero: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Config.from_file(p)


def test_replace_revalidates():
    c = Config().replace(zero={"stage": 2})
    assert c.zero.stage == 2
    with pytest.raises(ConfigError, match="offload.params"):
        c.replace(offload={"params": "host"})


# ---------------------------------------------------------------- the ready configs

CONFIGS = sorted(p for p in REPO_CONFIGS.glob("*.yaml") if p.stem != "auto")   # auto: tests/plan/test_auto.py


def test_every_expected_config_is_there():
    names = {p.stem for p in REPO_CONFIGS.glob("*.yaml")}
    assert {"ddp", "zero1", "zero2", "zero3", "zero3-host", "zero3-nvme", "auto"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_trains_tiny_gpt(path, tmp_path):
    cfg = infinity.Config.from_file(path)
    if cfg.tiers.nvme_path is not None:
        (tmp_path / "swap").mkdir()  # a missing swap directory is an error, not created silently
        cfg = cfg.replace(tiers={"nvme_path": str(tmp_path / "swap")})
    cfg = cfg.replace(optimizer={"lr": 3e-3, "weight_decay": 0.0})
    torch.manual_seed(0)
    model, opt = infinity.initialize(GPT(gpt_config("tiny")), cfg)
    data = TokenDataset.default(seq_len=32, max_bytes=1 << 20)
    losses = []
    for step in range(8):
        x, y = data.global_batch(step % 2, batch_size=4, seed=0)
        loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    # the same two batches alternate, so a working optimizer drives their loss down
    assert losses[-1] < losses[0] - 0.2, losses
    infinity.engine_of(model).close()


def test_nvme_config_leaves_no_swap_files(tmp_path):
    cfg = infinity.Config.from_file(REPO_CONFIGS / "zero3-nvme.yaml")
    (tmp_path / "swap").mkdir()
    # the tiny model's state would fit the host budget: keep it on the disk, where this test looks
    cfg = cfg.replace(tiers={"nvme_path": str(tmp_path / "swap")}, offload={"host_resident_bytes": 0})
    torch.manual_seed(0)
    model, opt = infinity.initialize(GPT(gpt_config("tiny")), cfg)
    x, y = TokenDataset.default(seq_len=32, max_bytes=1 << 20).global_batch(0, batch_size=2)
    model(x, labels=y).loss.backward()
    opt.step()
    assert any(p.is_file() for p in (tmp_path / "swap").rglob("*"))
    infinity.engine_of(model).close()
    assert not any(p.is_file() for p in (tmp_path / "swap").rglob("*"))


def _every_key():
    from infinity.config.sections import _SECTIONS
    import dataclasses
    return [(name, f.name) for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("section, key", _every_key(), ids=[f"{s}.{k}" for s, k in _every_key()])
def test_every_key_refuses_nan_and_inf_by_name(section, key, bad):
    """No key takes NaN or inf: each is refused with the key's full name in the message."""
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}: "):
        Config.from_dict({section: {key: bad}})


@pytest.mark.parametrize("text, key", [("optimizer: {weight_decay: .nan}", "optimizer.weight_decay"),
                                       ("optimizer: {lr: .inf}", "optimizer.lr"),
                                       ("optimizer: {eps: .nan}", "optimizer.eps"),
                                       ("optimizer: {betas: [0.9, .nan]}", "optimizer.betas"),
                                       ("schedule: {clip_grad_norm: .inf}", "schedule.clip_grad_norm"),
                                       ("precision: {loss_scale: .inf}", "precision.loss_scale"),
                                       ("tiers: {host_bytes: 1e400}", "tiers.host_bytes")])
def test_yaml_nan_and_inf_are_refused(tmp_path, text, key):
    """YAML's .nan / .inf (and a size too large to be finite) fail at load, naming the file and the key."""
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=rf"{path}: {key}: .*finite"):
        Config.from_file(path)


def test_sections_built_directly_refuse_nan():
    """A section dataclass built in code, bypassing the parsers, still cannot carry NaN into a Config."""
    from infinity.config import OptimizerConfig
    with pytest.raises(ConfigError, match=r"optimizer\.lr: expected a finite number"):
        Config(optimizer=OptimizerConfig(lr=float("nan")))


@pytest.mark.parametrize("dtype, why", [("fp16", "an fp16 parameter has other exponent bits"),
                                        ("fp32", "an fp32 one is the master itself")])
def test_remainder_master_needs_bf16_parameters(dtype, why):
    with pytest.raises(ConfigError, match=f"optimizer.master: remainder needs precision.param_dtype bf16, got "
                                          f"{dtype}.*{why}"):
        Config.from_dict({"optimizer": {"master": "remainder"}, "precision": {"param_dtype": dtype}})
    assert Config.from_dict({"optimizer": {"master": "remainder"},
                             "precision": {"param_dtype": "bf16"}}).optimizer.master == "remainder"
    with pytest.raises(ConfigError, match="optimizer.master"):
        Config.from_dict({"optimizer": {"master": "fp16"}})
    assert Config().optimizer.master == "fp32"


@pytest.mark.parametrize("key", ["overlap_backward", "overlap_mode"])
def test_the_replaced_overlap_keys_are_refused_naming_update_at(key):
    """The two keys that chose when the update runs are one knob now: either is a one-line error naming
    ``optimizer.update_at`` and how the old pair maps onto it; auto resolves once, by what the run allows."""
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"optimizer": {key: True if key == "overlap_backward" else "backward"}})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"optimizer.{key}: replaced by optimizer.update_at")
    assert "update_at M" in msg
    offloaded = {"zero": {"stage": 2}, "offload": {"optimizer": "host"}}
    assert Config.from_dict({"optimizer": {"update_at": "auto"}}).update_schedule().at == "step"
    assert Config.from_dict({**offloaded, "optimizer": {"update_at": "auto"},
                             "precision": {"param_dtype": "bf16"}}).update_schedule().at == "backward"
    assert Config.from_dict({**offloaded, "optimizer": {"update_at": "auto"},
                             "schedule": {"clip_grad_norm": 1.0}}).update_schedule().at == "next_forward"
    timing = Config.from_dict({**offloaded, "optimizer": {"update_at": "speculative"}}).update_schedule()
    assert (timing.overlapped, timing.in_backward, timing.spares) == (True, True, True)
