import pytest
import torch
from hypothesis import given, settings, strategies as st

from infinity.config import Config
from infinity.estimate.strategies import (FP32, MIXED, STRATEGIES, Placement, count_params, estimate, estimate_all,
                               estimate_config, parse_param_count)

GB = 10**9


def by_name(estimates):
    return {e.placement.name: e for e in estimates}


def test_7b_ddp_needs_112_gb_per_device():
    e = by_name(estimate_all(7 * GB, 8))["ddp"]
    assert e.memory.device_bytes == 112 * GB
    assert (e.memory.host_bytes, e.memory.nvme_bytes) == (0, 0)
    assert (e.memory.param_bytes, e.memory.grad_bytes, e.memory.optimizer_bytes) == (14 * GB, 14 * GB, 84 * GB)


def test_zero_paper_figure_1_numbers_for_7_5b_on_64_devices():
    # ZeRO paper, Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    est = by_name(estimate_all(7_500_000_000, 64))
    assert est["ddp"].memory.device_bytes == 120 * GB
    assert est["zero1"].memory.device_bytes == 31_406_250_000
    assert est["zero2"].memory.device_bytes == 16_640_625_000
    assert est["zero3"].memory.device_bytes == 1_875_000_000


@pytest.mark.parametrize("psi,n", [(7 * GB, 8), (1_000_000, 4), (125_000_000, 16), (4096, 1)])
def test_stage_formulas_in_mixed_precision(psi, n):
    est = by_name(estimate_all(psi, n))
    assert est["ddp"].memory.device_bytes == 16 * psi
    assert est["zero1"].memory.device_bytes == 4 * psi + 12 * psi // n
    assert est["zero2"].memory.device_bytes == 2 * psi + 14 * psi // n
    assert est["zero3"].memory.device_bytes == 16 * psi // n
    host = est["zero-infinity-host"].memory
    assert (host.device_bytes, host.host_bytes, host.nvme_bytes) == (2 * psi // n, 14 * psi // n, 0)
    nvme = est["zero-infinity-nvme"].memory
    assert (nvme.device_bytes, nvme.host_bytes, nvme.nvme_bytes) == (0, 2 * psi // n, 14 * psi // n)
    for e in est.values():   # placement moves bytes between tiers, never changes the per-class total
        m = e.memory
        assert m.device_bytes + m.host_bytes + m.nvme_bytes == m.param_bytes + m.grad_bytes + m.optimizer_bytes


def test_uneven_shards_round_up_per_rank():
    e = by_name(estimate_all(10, 4))["zero3"]
    assert e.memory.device_bytes == 16 * 3   # ceil(10 / 4) elements per rank


def test_fp32_case():
    assert MIXED.total == FP32.total == 16
    est = by_name(estimate_all(1000, 4, precision="fp32"))
    assert est["ddp"].memory.device_bytes == 16_000
    assert est["zero1"].memory.device_bytes == 8 * 1000 + 8 * 250
    assert est["zero2"].memory.device_bytes == 4 * 1000 + 12 * 250
    assert est["zero3"].memory.device_bytes == 16 * 250
    assert est["ddp"].comm.total_bytes == 2 * 1000 * 4


def test_communication_volume_per_step():
    psi = 7 * GB
    est = by_name(estimate_all(psi, 8))
    for name in ("ddp", "zero1", "zero2"):
        assert est[name].comm.total_numel == 2 * psi
        assert est[name].comm.total_bytes == 4 * psi   # 2 bytes an element
    assert est["ddp"].comm.all_reduce_numel == 2 * psi
    assert (est["zero2"].comm.reduce_scatter_numel, est["zero2"].comm.all_gather_numel) == (psi, psi)
    for name in ("zero3", "zero-infinity-host", "zero-infinity-nvme"):
        c = est[name].comm
        assert (c.total_numel, c.all_gather_numel, c.reduce_scatter_numel) == (3 * psi, 2 * psi, psi)
        assert c.total_bytes == 6 * psi


def test_reduce_dtype_changes_reduction_bytes_only():
    e = estimate(1000, 2, STRATEGIES[3], "mixed", param_dtype="bf16", reduce_dtype="fp32")
    assert e.comm.total_bytes == 2000 * 2 + 1000 * 4


def test_estimate_config_follows_stage_offload_and_dtypes(tmp_path):
    cfg = Config.from_dict({
        "zero": {"stage": 3}, "precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
        "offload": {"optimizer": "nvme", "params": "nvme", "grads": "host"},
        "tiers": {"nvme_path": str(tmp_path)}})
    e = estimate_config(cfg, 8000, 4)
    assert (e.memory.device_bytes, e.memory.host_bytes, e.memory.nvme_bytes) == (0, 2 * 2000, 14 * 2000)
    assert e.precision == "mixed" and e.comm.total_bytes == 3 * 8000 * 2
    fp32 = estimate_config(Config.from_dict({"zero": {"stage": 1}}), 8000, 4)
    assert fp32.precision == "fp32" and fp32.memory.device_bytes == 8 * 8000 + 8 * 2000


def test_invalid_inputs_are_named():
    with pytest.raises(ValueError, match="num_params"):
        estimate(0, 1, STRATEGIES[0])
    with pytest.raises(ValueError, match="world_size"):
        estimate(10, 0, STRATEGIES[0])
    with pytest.raises(ValueError, match="precision"):
        estimate(10, 1, STRATEGIES[0], precision="fp8")
    with pytest.raises(ValueError, match="param on host needs stage >= 3"):
        Placement("bad", 2, param="host")
    with pytest.raises(ValueError, match="tier must be one of"):
        Placement("bad", 3, grad="disk")


@pytest.mark.parametrize("text,n", [("7B", 7 * GB), ("7b", 7 * GB), ("1.5B", 1_500_000_000), ("125M", 125_000_000),
                                    ("350k", 350_000), ("1T", 10**12), ("7e9", 7 * GB), ("1000", 1000),
                                    ("2G", 2 * GB)])
def test_parse_param_count(text, n):
    assert parse_param_count(text) == n


@pytest.mark.parametrize("text", ["7Q", "", "B", "-3B", "7 BB", "0"])
def test_parse_param_count_rejects(text):
    with pytest.raises(ValueError):
        parse_param_count(text)


def test_count_params_on_meta_device_and_tied_weights_once():
    from infinity.models import GPT, gpt_config
    n = count_params(lambda: GPT(gpt_config("3b")))       # ~3B params, no memory used
    assert 2.9e9 < n < 3.1e9
    tiny = GPT(gpt_config("tiny"))
    assert count_params(tiny) == sum(p.numel() for n_, p in tiny.named_parameters(remove_duplicate=False)
                                     if n_ != "lm_head.weight")
    with pytest.raises(TypeError, match="not an nn.Module"):
        count_params(lambda: 3)
    seen = []
    count_params(lambda: seen.append(torch.empty(1).device) or torch.nn.Linear(2, 2))
    assert seen == [torch.device("meta")]


@settings(max_examples=200, deadline=None)
@given(psi=st.integers(1, 10**13), n=st.integers(1, 4096), precision=st.sampled_from(["mixed", "fp32"]))
def test_properties_any_size(psi, n, precision):
    est = by_name(estimate_all(psi, n, precision))
    device = [est[k].memory.device_bytes for k in ("ddp", "zero1", "zero2", "zero3")]
    assert device == sorted(device, reverse=True)          # each stage shards more, never less
    assert device[0] == 16 * psi
    zero3_total = est["zero3"].memory.device_bytes
    for name in ("zero-infinity-host", "zero-infinity-nvme"):
        m = est[name].memory
        assert m.device_bytes + m.host_bytes + m.nvme_bytes == zero3_total   # offload moves, never adds
        assert est[name].comm == est["zero3"].comm
    assert 16 * psi <= zero3_total * n < 16 * (psi + n)     # shards cover psi with < one element of padding each


def test_stored_formats_shrink_the_optimizer_state():
    """A remainder master is 2 B/param, bf16 moments 2 B each, int8 ones 65/64 B (a block's codes and scale):
    12 B of mixed-precision optimizer state becomes 10, 8, 6 or 4 + 1/32; fp32 parameters are their own
    master; the config's formats reach its estimate."""
    from infinity.estimate.strategies import estimate_config, format_rows, state_bytes

    assert state_bytes("mixed") == MIXED and state_bytes("fp32") == FP32
    assert state_bytes("mixed", "remainder").optimizer == 10
    assert state_bytes("mixed", "fp32", "bf16").optimizer == 8
    assert state_bytes("mixed", "remainder", "bf16").total == 10
    assert state_bytes("fp32", "fp32", "bf16") == type(FP32)(4, 4, 4)
    assert state_bytes("mixed", "remainder", "int8").optimizer == 2 + 2 * 65 / 64
    with pytest.raises(ValueError, match="remainder master needs mixed"):
        state_bytes("fp32", "remainder")
    rows = {(r["master"], r["moments"]): r for r in format_rows("mixed")}
    assert rows[("fp32", "fp32")]["nvme"] == 14 and rows[("remainder", "bf16")]["nvme"] == 8
    assert rows[("remainder", "int8")]["nvme"] == 6 + 1 / 32 and rows[("fp32", "int8")]["optimizer_read"] == 6 + 1 / 32
    # the remainder's update reads the bf16 parameter it joins, which the fp32 master's only writes
    assert rows[("remainder", "fp32")]["optimizer_read"] == 12 and rows[("remainder", "fp32")]["optimizer_write"] == 12
    cfg = Config.from_dict({"zero": {"stage": 3}, "precision": {"param_dtype": "bf16"},
                            "optimizer": {"master": "remainder", "moments": "bf16"},
                            "offload": {"optimizer": "nvme", "params": "nvme", "grads": "host"},
                            "tiers": {"nvme_path": "/tmp/unused"}})
    e = estimate_config(cfg, 1000, 1)
    assert e.memory.nvme_bytes == 1000 * 8 and e.memory.host_bytes == 1000 * 2
    e = estimate_config(Config.from_dict({**cfg.to_dict(), "optimizer": {"master": "remainder", "moments": "int8"}}),
                        1024, 1)
    assert e.memory.nvme_bytes == 1024 * 6 + 32


def test_a_speculative_update_adds_a_spare_of_the_parameter_shard_and_optimizer_states(tmp_path):
    conf = {"zero": {"stage": 3}, "precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
            "offload": {"optimizer": "nvme", "params": "nvme", "grads": "host"},
            "tiers": {"nvme_path": str(tmp_path)}, "optimizer": {"update_at": "auto"}}
    plain = estimate_config(Config.from_dict(conf), 8000, 4)
    conf["optimizer"]["update_at"] = "speculative"
    spec = estimate_config(Config.from_dict(conf), 8000, 4)
    # per rank: 2000 elements; spares of the bf16 parameter (2 B) and of master + moments (12 B), on NVMe
    assert spec.memory.spare_bytes == 14 * 2000 and plain.memory.spare_bytes == 0
    assert spec.memory.nvme_bytes == plain.memory.nvme_bytes + 14 * 2000
    assert spec.memory.host_bytes == plain.memory.host_bytes   # gradients have no spare
    assert spec.to_dict()["memory"]["spare_bytes"] == 14 * 2000
