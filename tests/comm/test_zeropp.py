"""ZeRO++ (infinity/comm/zeropp.py) at world size 4 as a 2 x 2 mesh: byte accounting, convergence, config.

Byte accounting is exact and compared with :func:`infinity.estimate.zeropp_comm`, the model
``infinity estimate`` prints. The engine keeps its root unit gathered through backward, so the
backward gather covers Ψ - Ψ_root. Convergence here is the short version (the test GPT, 40 steps
on 4 repeated batches); ``tools/zeropp_convergence.py`` trains the built-in GPT for 200 steps.
"""

from __future__ import annotations

import pytest

import zero_cases
import zeropp_cases
from infinity.config import Config, ConfigError
from infinity.estimate.strategies import ZeroPPSwitches, zeropp_comm
from infinity.comm.quantize import payload_bytes

WORLD, PER_NODE = 4, 2
BF16 = dict(stage=3, lr=1e-3, dtype="bf16", reduce="bf16")
SWITCHES = {
    "plain": {},
    "qwZ": {"quantize_weights": True},
    "hpZ": {"hierarchical_partition": True},
    "qgZ": {"quantize_grads": True},
    "qgZ4": {"quantize_grads": True, "grad_bits": 4},
    "all": {"quantize_weights": True, "hierarchical_partition": True, "quantize_grads": True},
    "all4": {"quantize_weights": True, "hierarchical_partition": True, "quantize_grads": True, "grad_bits": 4},
}


def _switches(pp: dict) -> ZeroPPSwitches:
    return ZeroPPSwitches(pp.get("quantize_weights", False), pp.get("hierarchical_partition", False),
                          pp.get("quantize_grads", False), pp.get("grad_bits", 8))


def _cross(r: dict, phase: str, kind: str) -> int:
    return r["phases"][phase]["cross_node_bytes"][kind]


def _intra(r: dict, phase: str, kind: str) -> int:
    return r["phases"][phase]["intra_node_bytes"][kind]


@pytest.fixture(scope="module")
def volumes(worlds):
    """Per rank, per (switch, reduce dtype): one step's bytes by phase (bf16 params)."""
    keys = [(name, reduce) for name in SWITCHES for reduce in ("bf16", "fp32", "fp16")
            if reduce == "bf16" or name in ("plain", "all", "qgZ", "qgZ4")]
    specs = [dict(BF16, reduce=reduce, pp=SWITCHES[name]) for name, reduce in keys]
    per_rank = worlds(WORLD).run(zeropp_cases.many, "bytes_case", specs)
    return [dict(zip(keys, results)) for results in per_rank]


def test_byte_accounting_matches_the_estimate_exactly(volumes):
    for rank, by_key in enumerate(volumes):
        for (name, reduce), r in by_key.items():
            psi = sum(p for p, _ in r["units"])
            root = sum(p for p, is_root in r["units"] if is_root)
            est = zeropp_comm(psi, WORLD, PER_NODE, _switches(SWITCHES[name]), 2, 4 if reduce == "fp32" else 2,
                              backward_numel=psi - root)
            got = {"forward_gather": (_intra(r, "forward", "all_gather"), _cross(r, "forward", "all_gather")),
                   "backward_gather": (_intra(r, "backward", "all_gather"), _cross(r, "backward", "all_gather")),
                   "grad_reduce": (_intra(r, "backward", "reduce_scatter"), _cross(r, "backward", "reduce_scatter"))}
            want = {k: (v["intra"], v["cross"]) for k, v in est.items()}
            assert got == want, f"rank {rank} {name} reduce {reduce}: counted {got}, estimate {want}"
            for phase in r["phases"].values():   # the split is of what this rank sends
                for kind, sent in phase["sent_bytes"].items():
                    assert phase["intra_node_bytes"][kind] + phase["cross_node_bytes"][kind] == sent, (name, kind)
            step = r["phases"]["step"]
            assert sum(step["bytes"].values()) == 0, "stage 3 moves nothing in the step"
            assert r["gathered_exact"], f"{name}: engine.gathered() must show the exact parameters"


def test_qwz_halves_the_bf16_all_gather_payload_to_the_byte(volumes):
    for by_key in volumes:
        plain, qwz = by_key[("plain", "bf16")], by_key[("qwZ", "bf16")]
        for phase in ("forward", "backward"):
            p, q = plain["phases"][phase]["bytes"]["all_gather"], qwz["phases"][phase]["bytes"]["all_gather"]
            assert p % 2 == 0 and p > 0
            # int8 values (half of bf16's bytes) + one fp32 scale per 256 values of every rank's shard
            scales = 4 * (p // 2) // 256
            assert q == p // 2 + scales, (phase, p, q)
            assert q == sum(WORLD * payload_bytes(n // WORLD, 8, 256)
                            for n, root in qwz["units"] if phase == "forward" or not root)


def test_hpz_backward_all_gathers_stay_inside_the_node(volumes):
    for by_key in volumes:
        plain, hpz = by_key[("plain", "bf16")], by_key[("hpZ", "bf16")]
        assert _cross(plain, "backward", "all_gather") > 0
        assert _cross(hpz, "backward", "all_gather") == 0
        # every released unit's full bf16 buffer is rebuilt from the node's 2 slices: this rank sends its
        # slice (half the unit) to its one node-mate
        assert _intra(hpz, "backward", "all_gather") == sum(p // PER_NODE * 2 * (PER_NODE - 1)
                                                             for p, root in hpz["units"] if not root)
        assert hpz["phases"]["forward"] == plain["phases"]["forward"]
        # the secondary shards: half (one of 2 ranks a node) of every released unit's bf16 params
        secondary = sum(p // PER_NODE * 2 for p, root in hpz["units"] if not root)
        assert hpz["after_forward"]["secondary_params"] == secondary > 0
        assert hpz["after_step"]["secondary_params"] == 0
        assert {k: v for k, v in hpz["after_step"].items() if k != "secondary_params"} == plain["after_step"]
        assert "secondary_params" not in plain["after_step"]


def test_qgz_cross_node_gradient_bytes_vs_fp16(volumes):
    for by_key in volumes:
        fp16 = _cross(by_key[("plain", "fp16")], "backward", "reduce_scatter")
        assert fp16 > 0
        assert _cross(by_key[("qgZ", "fp16")], "backward", "reduce_scatter") <= fp16 / 2
        assert _cross(by_key[("qgZ4", "fp16")], "backward", "reduce_scatter") <= fp16 / 4


def test_all_three_cut_cross_node_volume_to_a_quarter(volumes):
    def total(r):
        return sum(sum(ph["cross_node_bytes"].values()) for ph in r["phases"].values())

    for by_key in volumes:
        # fp32 gradient reduction (the mixed-precision default): int8 qgZ is enough
        assert total(by_key[("all", "fp32")]) <= total(by_key[("plain", "fp32")]) / 4
        # bf16 reduction: int4 gradients (int8 + scales lands at 0.27 on this small model, see the README)
        assert total(by_key[("all4", "bf16")]) <= total(by_key[("plain", "bf16")]) / 4


def test_qgz_error_does_not_grow_with_ranks(worlds):
    """Each value is quantized twice (inside the node, then the node sum), whatever the world size:
    the error of the mean is at most about absmax / qmax (half a step per level, the node sum's
    absmax at most k times the inputs', averaged over n = k * m)."""
    for bits in (8, 4):
        for r in worlds(WORLD).run(zeropp_cases.reduce_error_case, {"bits": bits}):
            assert 0 < r["err"] <= 1.01 * r["biggest"] / r["qmax"], r


@pytest.mark.slow
def test_convergence_and_exactness_short(worlds):
    base = dict(model="gpt", stage=3, lr=3e-3, dtype="bf16", reduce="fp32", steps=40, batch=8, cycle=4)
    names = ("plain", "qwZ", "hpZ", "qgZ", "all")
    specs = [dict(base, pp=SWITCHES[n]) for n in names]
    specs.append(dict(base, steps=6, pp=SWITCHES["all"], offload={"params": "host", "optimizer": "host"}))
    specs += [dict(base, stage=stage, steps=10, pp=SWITCHES["qgZ"]) for stage in (1, 2)]
    specs.append(dict(base, steps=6, pp=SWITCHES["all"], checkpointing=True))
    w = worlds(WORLD)
    extra = ("all_offload", "qgZ_stage1", "qgZ_stage2", "all_checkpointed")
    got = dict(zip(names + extra, w.run(zeropp_cases.many, "train_case", specs)[0]))
    # switches off: the node layout only labels bytes; bitwise the engine without a zeropp section
    ref = w.run(zero_cases.train_case, dict(base, steps=4, batch=8))[0]   # steps < cycle: the same batches
    assert got["plain"]["losses"][:4] == ref["losses"]
    # hpZ reuses the forward's gathered values: bitwise the same training
    assert got["hpZ"]["losses"] == got["plain"]["losses"]
    plain = got["plain"]["losses"]
    assert plain[-1] < 0.6 * plain[0], "the short run must really learn for the 1% check to mean something"
    for name in ("qwZ", "qgZ", "all"):
        losses = got[name]["losses"]
        assert losses != plain, f"{name} is on but changed nothing"
        assert abs(losses[-1] - plain[-1]) <= 0.01 * plain[-1], (name, losses[-1], plain[-1])
    # host offload: quantization is on the gathered path, the stored shards are exact
    assert got["all_offload"]["losses"] == got["all"]["losses"][:6]
    # activation checkpointing recomputes each unit inside its backward, from the same gathered values
    assert got["all_checkpointed"]["losses"] == got["all"]["losses"][:6]
    # qgZ is the reduce-scatter of stages 1 and 2 too
    for stage in (1, 2):
        losses = got[f"qgZ_stage{stage}"]["losses"]
        assert losses != plain[:10]
        assert all(abs(a - b) <= 0.01 * b for a, b in zip(losses, plain)), (stage, losses, plain[:10])


@pytest.mark.parametrize("section,message", [
    ({"zero": {"stage": 2}, "zeropp": {"quantize_weights": True}}, "zeropp.quantize_weights: needs zero.stage 3"),
    ({"zero": {"stage": 1}, "zeropp": {"hierarchical_partition": True}},
     "zeropp.hierarchical_partition: needs zero.stage 3"),
    ({"zero": {"reshard_after_forward": False}, "zeropp": {"hierarchical_partition": True}},
     "needs zero.reshard_after_forward true"),
    ({"zero": {"stage": 0}, "zeropp": {"quantize_grads": True}}, "zeropp.quantize_grads: needs zero.stage >= 1"),
    ({"precision": {"param_dtype": "fp16"}, "zeropp": {"quantize_grads": True}}, "not with precision.param_dtype fp16"),
    ({"zeropp": {"grad_bits": 2}}, r"zeropp.grad_bits: expected one of \[8, 4\]"),
    ({"zeropp": {"block_numel": 100}}, "zeropp.block_numel: expected a multiple of 8"),
    ({"zeropp": {"quantise_weights": True}}, "unknown key zeropp.quantise_weights.*valid keys: quantize_weights"),
])
def test_config_refuses_what_makes_no_sense(section, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(section)


def test_config_defaults_are_off_and_round_trip():
    cfg = Config.from_dict({"zeropp": {"quantize_grads": True, "grad_bits": 4, "ranks_per_node": 8}})
    assert cfg.zeropp.enabled and not Config().zeropp.enabled
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_ranks_per_node_must_divide_the_world(worlds):
    out = worlds(WORLD).run(zeropp_cases.error_case, {"ranks_per_node": 3})
    assert all("zeropp.ranks_per_node: 3 does not divide the world size 4" in m for m in out), out


def test_estimate_rows_for_a_cluster():
    from infinity.estimate.strategies import zeropp_rows

    psi = 7 * 10**9
    rows = {r["name"]: r for r in zeropp_rows(psi, 64, 8)}
    plain = rows["plain stage 3"]
    assert plain["device_bytes"] == 16 * psi // 64
    # ZeRO-3 pairwise: 56 of 63 peers are off-node; bf16 shards of Ψ/64 to each, 3 times
    assert plain["cross_node_bytes"] == 3 * 56 * (psi // 64) * 2
    assert rows["hpZ"]["device_bytes"] == plain["device_bytes"] + 2 * psi // 8
    assert rows["hpZ"]["phases"]["backward_gather"]["cross"] == 0
    assert 0.5 < rows["qwZ"]["phases"]["forward_gather"]["cross"] / plain["phases"]["forward_gather"]["cross"] < 0.51
    assert rows["qwZ+hpZ+qgZ"]["cross_vs_zero3"] <= 0.25
    one_node = zeropp_rows(psi, 8, 8)
    assert all(r["cross_node_bytes"] == 0 for r in one_node)


def test_cli_estimate_prints_the_zeropp_table(capsys):
    from infinity.cli import main

    assert main(["estimate", "--params", "7B", "--devices", "16", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO++ at stage 3, 2 node(s) x 8 ranks" in out
    line = next(x for x in out.splitlines() if x.startswith("qwZ+hpZ+qgZ "))
    assert float(line.split()[-1]) <= 0.25
    assert main(["estimate", "--params", "7B", "--devices", "16", "--ranks-per-node", "3"]) == 2
