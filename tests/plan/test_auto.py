"""``offload: auto``: the planner resolves the config before anything is built; the chosen config is logged,
is the engine's, and is the one a checkpoint saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import infinity
from infinity.config import Config, ConfigError
from infinity.models import GPT, GPTConfig
from infinity.plan.auto import read_auto, wants_auto
from plan_cases import write_profile

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHAPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=32)


def _auto(tmp_path, **plan) -> dict:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return {"offload": "auto",
            "plan": {"profile": write_profile(tmp_path / "profile.json"), "tokens": 64, "host_bytes": "8MiB",
                     "device_bytes": "2MiB", **plan},
            "precision": {"param_dtype": "fp32"}, "optimizer": {"lr": 1e-2, "threads": 1},
            "tiers": {"nvme_path": str(swap)}}


def test_initialize_plans_an_auto_config_logs_it_and_checkpoints_save_it(tmp_path, capsys):
    torch.manual_seed(0)
    model, opt = infinity.initialize(GPT(GPTConfig(**SHAPE)), _auto(tmp_path))
    engine = infinity.engine_of(model)
    try:
        err = capsys.readouterr().err
        assert "# chosen:" in err and "predicted step" in err
        chosen = yaml.safe_load("\n".join(ln for ln in err.splitlines() if not ln.startswith("#")))
        assert engine.config.to_dict() == Config.from_dict(chosen).to_dict()
        assert engine.config.optimizer.lr == 1e-2   # the user's sections are kept
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        assert set(engine.stats.last_step["attribution"]) == {"forward", "backward", "step", "total"}
        path = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["config"] == engine.config.to_dict()
    finally:
        engine.close()


def test_an_auto_request_nothing_fits_is_refused_before_anything_is_built(tmp_path):
    from infinity.plan import InfeasiblePlan
    cfg = _auto(tmp_path, host_bytes="4KiB", device_bytes="8KiB")
    with pytest.raises(InfeasiblePlan, match="below the least any config needs"):
        infinity.initialize(GPT(GPTConfig(**SHAPE)), cfg)
    assert list((tmp_path / "swap").iterdir()) == []


def test_the_shipped_auto_config_asks_for_the_planner_and_plain_loading_says_so():
    path = REPO_CONFIGS / "auto.yaml"
    assert wants_auto(path) and wants_auto("auto") and not wants_auto(REPO_CONFIGS / "zero3.yaml")
    base, options = read_auto(path)
    assert "offload" not in base and "plan" not in base and base["precision"]["param_dtype"] == "auto"
    assert options == {}
    with pytest.raises(ConfigError, match="offload: auto asks the planner"):
        Config.from_file(path)


def test_a_bad_plan_key_is_named():
    with pytest.raises(ConfigError, match="unknown key plan.budget; valid keys: profile, host_bytes"):
        read_auto({"offload": "auto", "plan": {"budget": 1}})
    with pytest.raises(ConfigError, match="plan.tokens"):
        read_auto({"offload": "auto", "plan": {"tokens": 0}})


def test_train_config_auto_resolves_to_the_planned_config(tmp_path, capsys):
    from infinity.train import TrainOptions
    from infinity.train.resolve import resolve
    cfg_file = tmp_path / "auto.yaml"
    cfg_file.write_text(yaml.safe_dump(_auto(tmp_path)))
    run = resolve(TrainOptions(config=str(cfg_file), model="tiny:n_layer=2,n_head=4,n_embd=64,block_size=32",
                               steps=2, batch_size=2, seq_len=32, save=False, progress=False,
                               swap_dir=str(tmp_path / "swap")), world_size=1)
    config = Config.from_dict(run.config)
    assert "# chosen:" in capsys.readouterr().err
    assert config.tiers.host_bytes == 8 * 2**20 and config.optimizer.lr == 1e-2


def test_under_a_launcher_rank_0_plans_and_every_rank_builds_its_choice(worlds, tmp_path):
    """World size 2: rank 0 alone plans and logs the plan; rank 1 gets the same config through the
    broadcast and both train a step in one data-parallel world. A plan that fails on rank 0 raises there
    and, naming rank 0's error, on rank 1 (which would otherwise wait for a config forever)."""
    import plan_cases
    cfg = _auto(tmp_path)
    cfg["tiers"]["nvme_path"] = str(tmp_path / "swap")
    ok = worlds(2).run(plan_cases.auto_initialize, {"shape": SHAPE, "config": cfg})
    assert all("error" not in r for r in ok), ok
    assert ok[0]["config"] == ok[1]["config"] and ok[0]["world_size"] == ok[1]["world_size"] == 2
    assert "# chosen:" in ok[0]["log"] and "# chosen:" not in ok[1]["log"]
    planned = yaml.safe_load("\n".join(ln for ln in ok[0]["log"].splitlines() if not ln.startswith("#")))
    assert Config.from_dict(planned).to_dict() == ok[0]["config"]
    bad = _auto(tmp_path, host_bytes="4KiB", device_bytes="8KiB")
    failed = worlds(2).run(plan_cases.auto_initialize, {"shape": SHAPE, "config": bad})
    assert failed[0]["error"][0] == "InfeasiblePlan" and "below the least any config needs" in failed[0]["error"][1]
    assert failed[1]["error"][0] == "ConfigError"
    assert "failed on rank 0" in failed[1]["error"][1] and "below the least any config needs" in failed[1]["error"][1]


def test_planning_at_initialize_leaves_the_callers_random_stream_alone(tmp_path, monkeypatch):
    """A model built on meta and materialized by a seeded init_fn after auto planned it gets the weights the
    same seed gives with the planned config written out: the planner's compute timing and the quick profile
    it measures without a ``plan.profile`` (random data: stood in for here by one that draws from the
    global generator and returns the synthetic rates) leave the caller's generator as they found it."""
    import infinity.profile
    from plan_cases import profile_dict

    def quick_profile(options, say):
        torch.rand(1000)
        return profile_dict()

    monkeypatch.setattr(infinity.profile, "run_profile", quick_profile)

    def init(module):
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.normal_(0.0, 0.02)

    def first_draws(config):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(GPTConfig(**SHAPE))
        model, _ = infinity.initialize(model, config, init_fn=init)
        engine = infinity.engine_of(model)
        drawn = torch.rand(8)   # the stream after planning (if any) and the same init's draws
        chosen = engine.config.to_dict()
        engine.close()
        return drawn, chosen

    planned, chosen = first_draws(_auto(tmp_path, profile=None))
    plain, same = first_draws(chosen)
    assert same == chosen
    assert torch.equal(planned, plain)
