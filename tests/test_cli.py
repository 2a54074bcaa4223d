import json
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.cli import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_table_shows_every_strategy(capsys):
    code, out, err = run(capsys, "estimate", "--params", "7B", "--devices", "8")
    assert code == 0 and err == ""
    rows = {line.split()[0]: line for line in out.splitlines() if line and line.split()[0] in
            ("ddp", "zero1", "zero2", "zero3", "zero-infinity-host", "zero-infinity-nvme")}
    assert len(rows) == 6
    assert "112.00 GB" in rows["ddp"] and "28.00 GB" in rows["ddp"]
    assert "14.00 GB" in rows["zero3"] and "3 x params" in rows["zero3"]


def test_estimate_json(capsys):
    code, out, _ = run(capsys, "estimate", "--params", "7B", "--devices", "8", "--json")
    data = json.loads(out)
    assert code == 0 and data["num_params"] == 7_000_000_000 and data["world_size"] == 8
    ddp = {e["name"]: e for e in data["estimates"]}["ddp"]
    assert ddp["memory"]["device_bytes"] == 112 * 10**9
    assert ddp["comm"]["total_numel"] == 14 * 10**9


def test_estimate_builtin_model_counts_on_meta(capsys):
    from infinity.estimate.strategies import count_params
    from infinity.models import GPT, gpt_config
    code, out, _ = run(capsys, "estimate", "--model", "1b", "--devices", "4", "--json")
    data = json.loads(out)
    assert code == 0 and data["model"] == "1b"
    assert data["num_params"] == count_params(lambda: GPT(gpt_config("1b")))
    zero3 = {e["name"]: e for e in data["estimates"]}["zero3"]
    assert zero3["memory"]["device_bytes"] == 16 * -(-data["num_params"] // 4)


def test_estimate_with_config_adds_its_row_and_precision(capsys, tmp_path):
    cfg = tmp_path / "inf.yaml"
    cfg.write_text(f"zero: {{stage: 3}}\nprecision: {{param_dtype: bf16, reduce_dtype: bf16}}\n"
                   f"offload: {{optimizer: nvme, params: nvme, grads: host}}\ntiers: {{nvme_path: {tmp_path}}}\n")
    code, out, _ = run(capsys, "estimate", "--model", "tiny", "--devices", "2", "--config", str(cfg), "--json")
    data = json.loads(out)
    assert code == 0 and data["precision"] == "mixed"
    row = data["estimates"][-1]
    assert row["name"] == "config" and row["placement"] == {"param": "nvme", "grad": "host", "optimizer": "nvme"}
    n = data["num_params"]
    assert row["memory"]["nvme_bytes"] == 14 * -(-n // 2) and row["memory"]["device_bytes"] == 0
    code, out, _ = run(capsys, "estimate", "--model", "tiny", "--config", str(cfg))
    assert code == 0 and f"config ({cfg})" in out


def test_estimate_prints_the_minimum_budgets_and_the_rss_bound(capsys, tmp_path):
    """With --model and --config: initialize's minimum tier budgets (the numbers it enforces) and the
    predicted peak RSS with its terms; --json carries both."""
    import infinity
    from infinity.models import GPT, gpt_config
    from infinity.store import Tier
    cfg = tmp_path / "nvme.yaml"
    cfg.write_text(f"zero: {{stage: 3}}\noffload: {{optimizer: nvme, params: nvme, grads: nvme}}\n"
                   f"tiers: {{nvme_path: {tmp_path}, host_bytes: 4KiB, device_bytes: 8MiB}}\n")
    code, out, err = run(capsys, "estimate", "--model", "tiny", "--config", str(cfg))
    assert code == 0, err
    model, _ = infinity.initialize(GPT(gpt_config("tiny")), {"zero": {"stage": 3}, "offload": {
        "optimizer": "nvme", "params": "nvme", "grads": "nvme"}, "tiers": {"nvme_path": str(tmp_path)}})
    engine = infinity.engine_of(model)
    need = engine.placement.min_budgets()
    engine.close()
    host, device = need[Tier.HOST][0], need[Tier.DEVICE][0]
    assert f"tiers.host_bytes >= {host} bytes" in out and f"tiers.device_bytes >= {device} bytes" in out
    assert "the config's 4.0KiB: BELOW the minimum: initialize refuses it" in out     # host_bytes: 4KiB
    assert "the config's 8.0MiB: enough" in out
    for term in ("baseline_bytes", "host_tier_bytes", "gathered_params_bytes", "activation_bytes", "total"):
        assert term in out
    code, out, _ = run(capsys, "estimate", "--model", "tiny", "--config", str(cfg), "--tokens", "128", "--json")
    memory = json.loads(out)["memory"]
    assert memory["min_budgets"]["host_bytes"]["bytes"] == host
    assert memory["min_budgets"]["device_bytes"]["bytes"] == device
    bound = memory["rss_bound"]
    assert memory["micro_batch"] == [2, 64] and bound["host_tier_bytes"] == 4096
    assert bound["total_bytes"] == sum(v for k, v in bound.items() if k != "total_bytes")
    assert bound["activation_bytes"] > 0 and bound["baseline_bytes"] > 0


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--params", "7Q"], "--params: cannot read '7Q'"),
    (["estimate", "--model", "gpt5"], "--model: unknown GPT size 'gpt5'; valid names: tiny, 125m"),
    (["estimate", "--params"], "argument --params: expected one argument"),
    (["estimate"], "one of the arguments --params --model is required"),
    (["estimate", "--params", "7B", "--model", "tiny"], "not allowed with argument"),
    (["estimate", "--params", "7B", "--devices", "0"], "--devices must be >= 1"),
    (["estimate", "--params", "7B", "--devices", "two"], "invalid int value: 'two'"),
    (["estimate", "--params", "7B", "--config", "/nonexistent/c.yaml"], "cannot read config file /nonexistent/c.yaml"),
    (["estimate", "--params", "1e400"], "--params: parameter count '1e400' is not a finite number"),
    (["estimate", "--model", "tiny", "--tokens", "-5"], "--tokens must be >= 1"),
    (["sample", "ckpt", "--temperature", "nan"], "--temperature a finite number >= 0, got"),
    (["sample", "ckpt", "--temperature", "inf"], "--temperature a finite number >= 0, got"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "required: COMMAND"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_bad_config_key_is_one_line(capsys, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("zero: {stag: 3}\n")
    code, _, err = run(capsys, "estimate", "--params", "1B", "--config", str(cfg))
    assert code == 2 and err.count("\n") == 1 and "unknown key zero.stag" in err


def test_help_exits_zero(capsys):
    assert main(["estimate", "--help"]) == 0
    assert "--params" in capsys.readouterr().out


def test_console_script_subprocess():
    exe = Path(sys.executable).parent / "infinity"
    proc = subprocess.run([str(exe), "estimate", "--params", "7B", "--devices", "8", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    ddp = {e["name"]: e for e in json.loads(proc.stdout)["estimates"]}["ddp"]
    assert ddp["memory"]["device_bytes"] == 112 * 10**9
    bad = subprocess.run([str(exe), "estimate", "--params", "7Q"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
