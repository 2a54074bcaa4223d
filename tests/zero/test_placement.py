"""Placement from config (property tests over every accepted config) and store keys."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.config import Config, ConfigError
from infinity.store import Tier
from infinity.zero.placement import Placement, store_key
from infinity.zero.stage import StagePolicy
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


def test_stored_formats_set_the_itemsizes_chunks_and_minimum_budgets():
    """optimizer.master remainder stores 2 B of master per element, moments bf16 2 B each and int8 65/64
    (whole bytes for whole blocks): the byte accounting, the chunk size that fits offload.chunk_bytes and
    the host minimum all follow."""
    from types import SimpleNamespace

    def placement(master, moments):
        return Placement.from_config(Config.from_dict({
            "zero": {"stage": 3}, "precision": {"param_dtype": "bf16"},
            "optimizer": {"master": master, "moments": moments},
            "offload": {"optimizer": "nvme", "params": "nvme", "grads": "host", "chunk_bytes": 4096 * 64},
            "tiers": {"nvme_path": "/tmp/unused"}}))

    want = {("fp32", "fp32"): (4, 4), ("remainder", "fp32"): (2, 4), ("fp32", "bf16"): (4, 2),
            ("remainder", "bf16"): (2, 2), ("remainder", "int8"): (2, 65 / 64)}
    units = [SimpleNamespace(index=0, name="u0", shard_numel=4096 * 100, is_root=False)]
    for (master, moments), (master_b, moment_b) in want.items():
        pl = placement(master, moments)
        sized = pl.of(units, StagePolicy.of(3), 2, 4)
        sizes = sized.stored_itemsizes()
        assert sizes == {TensorClass.PARAM: 2, TensorClass.MASTER: master_b, TensorClass.EXP_AVG: moment_b,
                         TensorClass.EXP_AVG_SQ: moment_b, TensorClass.GRAD: 4}, (master, moments)
        per_element = 2 + master_b + 2 * moment_b + 4
        chunk = sized.chunk_numel()
        assert chunk == int(4096 * 64 // per_element) // 4096 * 4096
        host, _ = sized.min_budgets()[Tier.HOST]
        # host-homed gradients + one job of the NVMe-homed classes, one chunk each
        assert host == 4 * 4096 * 100 + (per_element - 4) * chunk and isinstance(host, int)


def test_a_speculations_kept_gradients_are_written_home_only_where_the_host_cannot_hold_them():
    """update_at speculative with NVMe-homed gradients: the gradients a speculation keeps for a redo are
    written home at once exactly when all of them outweigh the host budget less its homes, its resident
    chunks and one optimizer job's chunk; never without spares (update_at backward or next_forward) or
    with gradients homed in host memory."""
    from types import SimpleNamespace

    def placement(mode="speculative", grads="nvme", overlap=True):
        return Placement.from_config(Config.from_dict({
            "zero": {"stage": 3}, "precision": {"param_dtype": "bf16"},
            "optimizer": {"update_at": mode if overlap else "step"},
            "offload": {"optimizer": "nvme", "params": "nvme", "grads": grads, "chunk_bytes": 4096 * 64},
            "tiers": {"nvme_path": "/tmp/unused"}}))

    units = [SimpleNamespace(index=i, name=f"u{i}", shard_numel=4096 * 40, is_root=i == 0) for i in range(3)]
    pl = placement().of(units, StagePolicy.of(3), 2, 4)
    kept = 3 * 4096 * 40 * 4                                # fp32 gradients of the three shards
    chunk_job = pl.host_working_set()[4]    # one job's chunk of every stored class
    edge = kept + chunk_job                                 # the host budget at which they just fit
    assert pl.writes_kept_grads({}, edge - 1)
    assert not pl.writes_kept_grads({}, edge)
    # a resident chunk takes host room: the same budget no longer holds them (two copies with spares)
    plan = {0: frozenset({(TensorClass.PARAM, 0)})}
    resident = pl.resident_bytes(plan)
    assert resident == 2 * 2 * min(4096 * 40, pl.chunk_numel())
    assert pl.writes_kept_grads(plan, edge)
    assert not pl.writes_kept_grads(plan, edge + resident)
    for other in (placement(mode="backward"), placement(grads="host"), placement(mode="next_forward")):
        assert not other.of(units, StagePolicy.of(3), 2, 4).writes_kept_grads({}, 1), other
