"""Placement from config (property tests over every accepted config) and store keys."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.config import Config, ConfigError
from infinity.store import Tier
from infinity.zero.placement import Placement, store_key
from infinity.zero.units import TensorClass

TIERS = ("none", "host", "nvme")


@settings(max_examples=60, deadline=None)
@given(stage=st.integers(0, 3), opt=st.sampled_from(TIERS), params=st.sampled_from(TIERS),
       grads=st.sampled_from(TIERS), fp32=st.booleans())
def test_placement_follows_every_accepted_config(stage, opt, params, grads, fp32):
    raw = {"zero": {"stage": stage}, "offload": {"optimizer": opt, "params": params, "grads": grads},
           "tiers": {"nvme_path": "/tmp/x"}}
    try:
        cfg = Config.load(raw)
    except ConfigError:
        return   # the config's own cross-checks (tested in test_config.py)
    p = Placement.from_config(cfg)
    want = {TensorClass.PARAM: params, TensorClass.GRAD: grads, TensorClass.MASTER: opt,
            TensorClass.EXP_AVG: opt, TensorClass.EXP_AVG_SQ: opt}
    for cls, tier in want.items():
        assert p.home(cls) == (None if tier == "none" else Tier(tier)), cls
    assert p.any_offload == any(t != "none" for t in (opt, params, grads))
    assert p.uses_nvme == ("nvme" in (opt, params, grads))
    # the fp32 master may be the parameter only when both live in the same place
    assert p.master_is_param(fp32) == (fp32 and params == opt)
    assert p.work_tier(TensorClass.PARAM) is Tier.DEVICE
    assert all(p.work_tier(c) is Tier.HOST for c in TensorClass if c is not TensorClass.PARAM)


def test_store_keys_are_per_unit_and_class():
    assert store_key(3, TensorClass.EXP_AVG_SQ) == "u3.exp_avg_sq"
    assert len({store_key(u, c) for u in range(4) for c in TensorClass}) == 4 * len(TensorClass)
