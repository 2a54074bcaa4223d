"""``precision.compute_dtype: fp32`` over bf16 parameters: stored and gathered in bf16, computed in fp32.

It equals a plain PyTorch run that keeps an fp32 master (torch AdamW) and computes in fp32 on the master
rounded to bf16 before each step (``precision_cases.reference_split``). Tolerances, from the arithmetic:
the per-step loss within 1e-5 relative (the same bf16 weights, fp32 sums in another order); each final
parameter within what fp32 rounding can move the master (``zero_cases.RoundingDrift``) plus one bf16 unit
in the last place of the parameter (two masters that close can round to neighbouring bf16 values).
"""

from __future__ import annotations

import pytest
import torch

from infinity.config import Config, ConfigError
import precision_cases

LOSS_RTOL = 1e-5
BASE = dict(model="gpt", steps=3, batch=8, lr=1e-2, stage=3)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits): 2^(exponent - 7); the smallest normal's at 0."""
    tiny = torch.finfo(torch.bfloat16).tiny
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=tiny))) - 7)


def _compare(got: dict, ref: dict) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: loss {a} vs reference {b}"
    assert got["params"].keys() == ref["params"].keys()
    for name, r in ref["params"].items():
        p = got["params"][name]
        assert p.dtype == torch.float32, f"{name}: the model computes in {p.dtype}"
        assert torch.equal(p, p.bfloat16().float()), f"{name}: not a bf16 value upcast"
        tol = ref["param_tol"][name] + _bf16_ulp(r)
        over = (p - r).abs() - tol
        i = int(over.argmax())
        assert over.flatten()[i] <= 0, (f"{name}: element {i} off by {(p - r).abs().flatten()[i]:.3g} > "
                                         f"{tol.flatten()[i]:.3g}; {int((over > 0).sum())} of {over.numel()} over")


@pytest.mark.parametrize("world_size", (1, 2))
def test_bf16_stored_fp32_compute_equals_the_rounded_master_reference(worlds, world_size, tmp_path):
    """In memory and with parameters and optimizer on NVMe, with the fp32 and the remainder master."""
    ref = precision_cases.reference_split(BASE)
    specs = [dict(BASE), dict(BASE, offload=True, tmp=str(tmp_path)),
             dict(BASE, offload=True, master="remainder", tmp=str(tmp_path / "r"))]
    for spec in specs:
        got = worlds(world_size).run(precision_cases.train_split, spec)[0]
        assert got["stored"] == ["torch.bfloat16"] and got["compute"] == "torch.float32"
        assert got["config"]["param_dtype"] == "bf16" and got["config"]["compute_dtype"] == "fp32"
        _compare(got, ref)


def test_the_reference_is_not_the_fp32_run():
    """The comparison can fail: training on unrounded fp32 weights ends off the rounded reference."""
    import zero_cases

    ref = precision_cases.reference_split(BASE)
    plain = zero_cases.reference_run(dict(BASE))
    with pytest.raises(AssertionError):
        _compare(dict(plain, params={n: p.bfloat16().float() for n, p in plain["params"].items()}), ref)


@pytest.mark.parametrize("precision, stage, match", [
    ({"param_dtype": "bf16", "compute_dtype": "fp32"}, 2, "needs zero.stage 3"),
    ({"param_dtype": "fp32", "compute_dtype": "bf16"}, 3, "not a pair this runs"),
    ({"param_dtype": "fp16", "compute_dtype": "fp32"}, 3, "not a pair this runs"),
])
def test_unsupported_pairs_are_refused(precision, stage, match):
    with pytest.raises(ConfigError, match=rf"precision\.compute_dtype: .*{match}"):
        Config.from_dict({"zero": {"stage": stage}, "precision": precision})
