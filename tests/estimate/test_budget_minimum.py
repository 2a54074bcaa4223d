"""``initialize`` refuses tier budgets a step cannot run in, naming the minimum, before writing anything.

The minimum is tight: at exactly the reported bytes the model trains, 4 KiB
less is refused (so the error never asks for more than is needed). ``infinity
estimate`` prints the same minimum, from the model laid out on the meta device.
"""

from __future__ import annotations

import os

import pytest
import torch

import infinity
from infinity.config import Config, ConfigError
from infinity.estimate.peak_rss import bound_for_model
from infinity.models import GPT, GPTConfig
from infinity.store import Tier
from infinity.train.report import engine_metrics

PLACEMENTS = [
    (3, "fp32", dict(params="nvme", grads="nvme", optimizer="nvme")),
    (3, "bf16", dict(params="nvme", grads="nvme", optimizer="nvme")),
    (3, "bf16", dict(params="host", grads="nvme", optimizer="nvme")),
    (2, "bf16", dict(params="none", grads="nvme", optimizer="nvme")),
    (1, "fp32", dict(params="none", grads="none", optimizer="nvme")),
    (3, "fp32", dict(params="none", grads="host", optimizer="host")),
]


MODEL = GPTConfig(n_layer=3, n_head=4, n_embd=64, vocab_size=512, block_size=32)


def _model():
    torch.manual_seed(0)
    return GPT(MODEL)


def _config(path, host, device, stage, dtype, offload):
    return {"zero": {"stage": stage}, "precision": {"param_dtype": dtype}, "offload": offload,
            "tiers": {"host_bytes": host, "device_bytes": device, "nvme_path": str(path)},
            "prefetch": {"bytes": 0}}


def _minimum(path, stage, dtype, offload) -> dict:
    model, _ = infinity.initialize(_model(), _config(path, "1GiB", "1GiB", stage, dtype, offload))
    engine = infinity.engine_of(model)
    try:
        need = engine.placement.min_budgets()
    finally:
        engine.close()
    return {tier: max(least, 4096) for tier, (least, _) in need.items()}


@pytest.mark.parametrize("stage,dtype,offload", PLACEMENTS)
def test_trains_at_the_minimum_and_is_refused_below_it(tmp_path, stage, dtype, offload):
    need = _minimum(tmp_path / "probe", stage, dtype, offload)
    assert need[Tier.HOST] > 4096
    model, opt = infinity.initialize(_model(), _config(tmp_path / "ok", need[Tier.HOST], need[Tier.DEVICE],
                                                       stage, dtype, offload))
    try:
        for step in range(2):
            ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        infinity.engine_of(model).close()

    swap = tmp_path / "refused"
    with pytest.raises(ConfigError, match=r"tiers.host_bytes = \d+ bytes .* is below the (\d+) bytes") as e:
        infinity.initialize(_model(), _config(swap, need[Tier.HOST] - 4096, need[Tier.DEVICE], stage, dtype,
                                              offload))
    assert f"below the {need[Tier.HOST]} bytes" in str(e.value) and "Set tiers.host_bytes to at least" in str(e.value)
    assert not swap.exists() or not os.listdir(swap), "a refused initialize wrote a swap file"
    if need[Tier.DEVICE] > 4096:   # stage 3 with stored parameters: the gather's device copy
        with pytest.raises(ConfigError, match=rf"tiers.device_bytes = .* is below the {need[Tier.DEVICE]} bytes"):
            infinity.initialize(_model(), _config(swap, need[Tier.HOST], need[Tier.DEVICE] - 4096, stage, dtype,
                                                  offload))


@pytest.mark.parametrize("stage,dtype,offload", PLACEMENTS)
def test_the_estimate_names_the_minimum_initialize_enforces(tmp_path, stage, dtype, offload):
    conf = _config(tmp_path / "probe", "1GiB", "1GiB", stage, dtype, offload)
    _, estimated = bound_for_model(lambda: GPT(MODEL), Config.from_dict(conf), baseline_bytes=0)
    model, _ = infinity.initialize(_model(), conf)
    engine = infinity.engine_of(model)
    try:
        enforced = engine.placement.min_budgets()
    finally:
        engine.close()
    assert estimated == enforced   # bytes and the reason, per tier
    least = estimated[Tier.HOST][0]
    with pytest.raises(ConfigError, match=rf"is below the {least} bytes"):
        infinity.initialize(_model(), _config(tmp_path / "refused", least - 1, "1GiB", stage, dtype, offload))


SPECULATIVE = [
    (3, "bf16", dict(params="nvme", grads="nvme", optimizer="nvme")),
    (2, "bf16", dict(params="none", grads="nvme", optimizer="host")),
]


def _speculative(conf: dict) -> dict:
    return {**conf, "optimizer": {"update_at": "speculative"},
            "schedule": {"clip_grad_norm": 1.0}}


@pytest.mark.parametrize("stage,dtype,offload", SPECULATIVE)
def test_a_speculative_update_trains_at_its_minimum_and_is_refused_below_it(tmp_path, stage, dtype, offload):
    """update_at speculative: host-homed states have a spare beside them, so the minimum is above the plain
    update's by their bytes; NVMe-homed ones need no more host room (the copy a job reads is handed to the
    spare's key), but the update overlaps compute, so the minimum adds the chunk a gather or a fold brings
    through host memory outside the update's room. A committed and a redone speculative step run at exactly it, 4 KiB
    less is refused."""
    plain = _minimum(tmp_path / "plain", stage, dtype, offload)
    probe = _speculative(_config(tmp_path / "probe", "1GiB", "1GiB", stage, dtype, offload))
    _, estimated = bound_for_model(lambda: GPT(MODEL), Config.from_dict(probe), baseline_bytes=0)
    model, _ = infinity.initialize(_model(), probe)
    engine = infinity.engine_of(model)
    try:
        least, why = engine.placement.min_budgets()[Tier.HOST]
        beside = engine.placement.beside_update_bytes()   # the overlapped update's room leaves it to the rest
    finally:
        engine.close()
    if offload["optimizer"] == "host":   # the master and both moments, fp32, and their spares
        states = sum(12 * u.shard_numel for u in engine.units)
        assert least == plain[Tier.HOST] + states + beside, (least, plain, states, beside)
    else:
        assert least == plain[Tier.HOST] + beside, (least, plain, beside)
    assert beside > 0   # NVMe-homed gradients land in host memory beside the update
    assert estimated[Tier.HOST] == (least, why)   # infinity estimate names the same minimum
    conf = _speculative(_config(tmp_path / "ok", least, plain[Tier.DEVICE], stage, dtype, offload))
    model, opt = infinity.initialize(_model(), conf)
    engine = infinity.engine_of(model)
    engine.update.speculation.speculate = lambda: True
    outcomes = []
    try:
        for step, clip in enumerate((1e9, 1e-3)):   # the first commits as speculated, the second is redone
            ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
            outcomes.append(engine.stats.last_step["offload"]["speculation"])
            assert engine_metrics(engine, 1.0)["speculation"] == outcomes[-1]   # infinity train --metrics
    finally:
        engine.close()
    assert [(o["speculated"], o["committed"], o["redone"]) for o in outcomes] == [(True, True, False),
                                                                                  (True, True, True)]
    with pytest.raises(ConfigError, match=rf"tiers.host_bytes = .* is below the {least} bytes"):
        infinity.initialize(_model(), _speculative(_config(tmp_path / "refused", least - 4096, plain[Tier.DEVICE],
                                                           stage, dtype, offload)))
