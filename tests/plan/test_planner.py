"""The planner: candidates predicted from measured rates, the fastest that fits chosen, an unfit request refused
naming the least that would run, and the cost model's byte counts equal to what the engine moves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.config import Config
from infinity.models import GPT, GPTConfig
from infinity.plan import InfeasiblePlan, PlanRequest, make_plan
from infinity.estimate.activations import BACKWARD_FRACTION, BACKWARD_WORKING_BLOCKS
from infinity.plan.planner import TIE, describe
from infinity.plan.rates import PlanInputError, Rates, measure_compute
from plan_cases import compute, profile_dict, rates, write_profile

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=32)


def _loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def _request(tmp_path, **kw) -> PlanRequest:
    args = dict(build=lambda: GPT(GPTConfig(**SHAPE)), loss_fn=_loss, model_name="tiny", vocab_size=512,
                batch=2, seq=32, host_bytes=64 * 2**20, device_bytes=64 * 2**20, nvme_path=str(tmp_path),
                param_dtype="fp32")
    args.update(kw)
    return PlanRequest(**args)


def test_a_request_nothing_fits_is_refused_naming_the_minimum_and_that_minimum_runs(tmp_path):
    """Refused before anything is built (no swap file appears); the named minimum plans, and trains."""
    with pytest.raises(InfeasiblePlan, match=r"below the least any config needs") as e:
        make_plan(_request(tmp_path, host_bytes=4096, device_bytes=8192), rates(), compute(2))
    assert list(tmp_path.iterdir()) == []
    need = _named_minimum(e)
    assert need > 8192 and "device_bytes" in str(e.value)
    plan = make_plan(_request(tmp_path, host_bytes=4 << 20, device_bytes=need), rates(), compute(2))
    assert plan.chosen.fits and plan.chosen.needs["device_bytes"] <= need


def _named_minimum(error) -> int:
    return int(str(error.value).split("(")[1].split(" bytes")[0])   # "... 1.2MiB (1234 bytes, ...)"


def test_a_request_whose_tiers_fit_but_whose_peak_exceeds_the_ram_names_the_least_peak(tmp_path):
    """Tier grants every candidate meets, on a machine whose RAM (1 MiB) holds none of their predicted peaks:
    the refusal names the RAM and the least predicted peak (not a tier minimum every candidate already
    meets), and that much RAM plans."""
    from dataclasses import replace
    base = 256 * 2**20   # the process's RSS before initialize, fixed: this process's own grows between the calls
    with pytest.raises(InfeasiblePlan, match=r"^tiny: no config's predicted peak RSS fits the 1\.0MiB of RAM "
                                             r"available: the least is .* bytes, stage .*; grant at least") as e:
        make_plan(_request(tmp_path, device_bytes=2**30), replace(rates(), ram_available_bytes=2**20), compute(2),
                  baseline_bytes=base)
    need = _named_minimum(e)
    plan = make_plan(_request(tmp_path, device_bytes=2**30), replace(rates(), ram_available_bytes=need), compute(2),
                     baseline_bytes=base)
    assert plan.chosen.fits and plan.chosen.prediction.rss.total_bytes <= need


def test_host_minimum_is_named_when_the_device_grant_suffices(tmp_path):
    with pytest.raises(InfeasiblePlan) as e:
        make_plan(_request(tmp_path, host_bytes=4096, device_bytes=8192), rates(), compute(2))
    device = _named_minimum(e)
    with pytest.raises(InfeasiblePlan, match=r"tiers.host_bytes 4.0KiB is below the least") as e:
        make_plan(_request(tmp_path, host_bytes=4096, device_bytes=device), rates(), compute(2))
    host = _named_minimum(e)
    assert host > 4096
    plan = make_plan(_request(tmp_path, host_bytes=host, device_bytes=device), rates(), compute(2))
    assert plan.chosen.fits and plan.chosen.config.offload.optimizer != "none"


def test_plenty_of_device_memory_keeps_everything_in_memory_and_a_small_grant_offloads(tmp_path):
    roomy = make_plan(_request(tmp_path, device_bytes=2**30), rates(), compute(2))
    assert roomy.chosen.config.offload.optimizer == "none" and roomy.chosen.config.offload.params == "none"
    with pytest.raises(InfeasiblePlan) as e:
        make_plan(_request(tmp_path, host_bytes=8 << 20, device_bytes=8192), rates(), compute(2))
    tight = make_plan(_request(tmp_path, device_bytes=_named_minimum(e), host_bytes=8 << 20), rates(), compute(2))
    off = tight.chosen.config.offload
    assert "none" in (off.optimizer, off.params) and (off.optimizer, off.params) != ("none", "none")
    assert tight.chosen.step_s <= min(c.step_s for c in tight.alternatives) * (1 + TIE)
    assert all(c.fits for c in tight.alternatives) and all(c.step_s == c.step_s for c in tight.faster_unfit)


def test_a_slower_disk_is_predicted_slower_and_shows_in_the_io_term(tmp_path):
    cfg = _nvme_config(tmp_path)
    from infinity.plan.planner import model_layout
    from infinity.plan.cost import predict
    from infinity.store import Tier
    req = _request(tmp_path)
    c = compute(2)
    layout = model_layout(req, 3, "fp32", 0)
    budgets = {Tier.HOST: cfg.tiers.host_bytes, Tier.DEVICE: cfg.tiers.device_bytes}
    fast = predict(layout, cfg, c, rates(read_gbps=2.0, write_gbps=2.0), 1, budgets, True, 1 << 20)
    slow = predict(layout, cfg, c, rates(read_gbps=0.01, write_gbps=0.01), 1, budgets, True, 1 << 20)
    assert slow.step_s > fast.step_s
    assert slow.totals()["io_wait_s"] - fast.totals()["io_wait_s"] == pytest.approx(slow.step_s - fast.step_s)


def _nvme_config(tmp_path) -> Config:
    return Config.from_dict({
        "zero": {"stage": 3}, "precision": {"param_dtype": "fp32", "reduce_dtype": "fp32"},
        "offload": {"params": "nvme", "grads": "nvme", "optimizer": "nvme", "host_resident_bytes": "auto"},
        "tiers": {"host_bytes": "1536KiB", "device_bytes": "1MiB", "nvme_path": str(tmp_path)},
        "optimizer": {"threads": 1}})


def test_predicted_bytes_per_tier_pair_equal_what_the_engine_moves(tmp_path):
    """The cost model's disk traffic comes from placement's own accounting: it matches the store's counters
    (at the host minimum, where no LRU room is left to hit: the model's assumption, module doc)."""
    from infinity.plan.cost import tier_traffic
    from infinity.plan.planner import model_layout
    from infinity.store import Tier
    from infinity.zero.placement import Placement
    from infinity.zero.stage import StagePolicy
    req = _request(tmp_path)
    layout = model_layout(req, 3, "fp32", 0)
    # gradients homed in host memory: NVMe-homed ones whose dirty copies survive into the step are read
    # less than the model's no-hit assumption says (cost.py's module doc)
    cfg = _nvme_config(tmp_path).replace(offload={"grads": "host"})
    least = Placement.from_config(cfg).of(layout.units, StagePolicy.of(3), 4, 4).min_budgets()[Tier.HOST][0]
    cfg = cfg.replace(tiers={"host_bytes": least})
    predicted = tier_traffic(layout, cfg, cfg.tiers.host_bytes)["moved"]
    torch.manual_seed(0)
    model, opt = infinity.initialize(GPT(GPTConfig(**SHAPE)), cfg)
    engine = infinity.engine_of(model)
    try:
        for step in range(3):
            ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        moved = engine.stats.last_step["offload"]["moved_bytes"]
    finally:
        engine.close()
    for pair in ("nvme->host", "host->nvme", "host->device"):
        assert predicted[pair] == moved.get(pair, 0), (pair, moved.get(pair), predicted)


def test_a_device_tier_too_small_for_the_parameters_rereads_them_in_backward(tmp_path):
    from infinity.plan.cost import tier_traffic
    from infinity.plan.planner import model_layout
    roomy = _nvme_config(tmp_path)
    small = roomy.replace(tiers={"device_bytes": 256 * 1024})
    layout = model_layout(_request(tmp_path), 3, "fp32", 0)
    a = tier_traffic(layout, roomy, roomy.tiers.host_bytes)
    b = tier_traffic(layout, small, small.tiers.host_bytes)
    assert a["read"]["backward"] == 0 < b["read"]["backward"]
    assert b["moved"]["host->device"] > a["moved"]["host->device"]


def test_measured_compute_splits_root_and_blocks(tmp_path):
    c = measure_compute(lambda: GPT(GPTConfig(**SHAPE)), _loss, 2, 32, torch.float32, 512, repeats=1)
    assert c.blocks == 2 and c.tokens == 64
    assert c.forward_s() > 0 and c.backward_s(2) >= c.backward_s(1) >= c.backward_s(0) > 0
    assert c.block_saved_bytes > c.block_input_bytes > 0
    assert c.activation_bytes(2) < c.activation_bytes(1) < c.activation_bytes(0)
    with pytest.raises(TypeError, match="not a bool"):
        c.activation_bytes(True)   # would read as one block


def test_checkpointing_the_first_n_blocks_is_priced_when_fixed(tmp_path):
    """Stage 0 in memory, 8 blocks each saving 7 MiB more than its input when not checkpointed, the count
    fixed at 5: the plan recomputes 5 blocks, is 3 block forwards faster than checkpointing all 8, needs
    3 blocks' activations more device memory, and predicts the activations of 5 inputs + 3 blocks. Unasked,
    the planner tries all or none."""
    fixed = {"zero.stage": 0, "offload.params": "none", "offload.grads": "none", "offload.optimizer": "none",
             "precision.reduce_dtype": "fp32"}
    blocks = compute(8, block_s=0.05, saved=8 * 2**20)
    per_block = blocks.block_saved_bytes - blocks.block_input_bytes

    def plan(ckpt):
        request = _request(tmp_path, device_bytes=2**30, fixed=dict(fixed, **{"zero.activation_checkpointing": ckpt}))
        return make_plan(request, rates(), blocks).chosen

    every, first5 = plan(True), plan(5)
    assert first5.fits and first5.config.zero.checkpointed_units(8) == 5 and "ckpt first 5 units" in first5.label()
    assert first5.prediction.rss_bound.activation_bytes == blocks.activation_bytes(5) == (
        blocks.root_saved_bytes + 5 * blocks.block_input_bytes + 3 * blocks.block_saved_bytes)
    # at backward's peak: a recomputed block's saves rebuilt, the working set of the block whose backward
    # runs, and the allocator's share of the four live
    assert first5.prediction.rss.activation_bytes == blocks.activation_bytes(5) + blocks.block_saved_bytes + int(
        BACKWARD_WORKING_BLOCKS * blocks.block_saved_bytes) + int(BACKWARD_FRACTION * 4 * blocks.block_saved_bytes)
    assert every.step_s - first5.step_s == pytest.approx(3 * 0.05)
    assert first5.needs["device_bytes"] - every.needs["device_bytes"] == 3 * per_block
    unasked = make_plan(_request(tmp_path, device_bytes=every.needs["device_bytes"] + 4 * per_block, fixed=fixed),
                        rates(), blocks)
    assert unasked.chosen.knobs["zero.activation_checkpointing"] is True
    assert all(isinstance(c.knobs["zero.activation_checkpointing"], bool) for c in unasked.alternatives)


def test_the_planner_offloads_checkpointed_activations_when_their_inputs_do_not_fit(tmp_path):
    """8 blocks, each input 32 MiB (256 MiB at once when recomputed), stage 0 in memory fixed. With device
    memory for all of them: recompute stays on the device (no copies). With device memory for a window only:
    recompute + host when the host grant holds the 256 MiB, recompute + NVMe when it does not; the device
    then holds the root's saves and the window (prefetch.bytes + two blocks), and each way the inputs cross
    host memory (and the disk, for NVMe)."""
    fixed = {"zero.stage": 0, "offload.params": "none", "offload.grads": "none", "offload.optimizer": "none",
             "precision.reduce_dtype": "fp32", "prefetch.bytes": 0}
    blocks = compute(8, block_s=0.5, saved=256 * 2**20)   # inputs: saved // 8 = 32 MiB
    moved = 8 * blocks.block_input_bytes

    def plan(device_bytes, host_bytes):
        request = _request(tmp_path, device_bytes=device_bytes, host_bytes=host_bytes, fixed=fixed)
        return make_plan(request, rates(), blocks).chosen

    recompute = plan(2**30, 2**30)
    assert recompute.knobs["zero.activation_checkpointing"] is True
    assert recompute.knobs["zero.activation_offload"] == "none"
    small = recompute.needs["device_bytes"] - moved + 3 * blocks.block_input_bytes
    host = plan(small, 2**30)
    assert host.knobs["zero.activation_offload"] == "host" and "activations to host" in host.label()
    assert host.prediction.rss_bound.activation_bytes == blocks.root_saved_bytes + 2 * blocks.block_input_bytes
    assert host.needs["host_bytes"] == moved
    assert host.prediction.moved_bytes == {"device->host": moved, "host->device": moved}
    nvme = plan(small, moved // 2)
    assert nvme.knobs["zero.activation_offload"] == "nvme"
    assert nvme.prediction.moved_bytes["host->nvme"] == nvme.prediction.moved_bytes["nvme->host"] == moved
    assert nvme.step_s > host.step_s > recompute.step_s
    # the NVMe writes hide behind forward's compute (4 s of it for 256 MiB at 1 GB/s); in backward only
    # the last block's read shows
    assert nvme.prediction.phases["forward"]["io_wait_s"] == 0.0
    assert nvme.prediction.phases["backward"]["io_wait_s"] == pytest.approx(blocks.block_input_bytes / 1e9)


def test_a_profile_missing_a_section_is_named():
    p = profile_dict()
    del p["cpu_adam"]
    with pytest.raises(PlanInputError, match="missing 'cpu_adam'"):
        Rates.from_profile(p, source="x.json")


def test_the_description_prints_loadable_yaml_and_every_part(tmp_path):
    import yaml
    plan = make_plan(_request(tmp_path, device_bytes=2 << 20, host_bytes=8 << 20), rates(), compute(2, saved=1024))
    text = "\n".join(describe(plan))
    for part in ("predicted step", "predicted peak RSS", "bytes moved per step", "next best"):
        assert part in text
    assert Config.from_dict(yaml.safe_load(text)).to_dict() == plan.chosen.config.to_dict()


def test_cli_refuses_an_infeasible_request_with_exit_2(tmp_path):
    prof = write_profile(tmp_path / "profile.json")
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli", "plan", "--model", "tiny:n_layer=2,n_embd=64,n_head=4,block_size=32",
         "--host-bytes", "4KiB", "--device-bytes", "8KiB", "--profile", prof, "--tokens", "64",
         "--swap-dir", str(tmp_path / "swap")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "below the least any config needs" in proc.stderr and not (tmp_path / "swap").exists()


def test_cli_json_plan_loads_as_a_config(tmp_path):
    prof = write_profile(tmp_path / "profile.json")
    out = tmp_path / "chosen.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli", "plan", "--model", "tiny:n_layer=2,n_embd=64,n_head=4,block_size=32",
         "--host-bytes", "8MiB", "--device-bytes", "2MiB", "--profile", prof, "--tokens", "64", "--json",
         "--out", str(out), "--swap-dir", str(tmp_path / "swap")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["predicted"]["step_s"] > 0 and len(plan["alternatives"]) >= 1
    assert set(plan["predicted"]["phases"]) == {"forward", "backward", "step"}
    assert Config.from_file(out).to_dict() == Config.from_dict(plan["config"]).to_dict()


def test_a_fixed_knob_is_planned_around_and_an_unknown_one_is_named(tmp_path):
    plan = make_plan(_request(tmp_path, device_bytes=2**30, fixed={"zero.stage": 3, "offload.optimizer": "host"}),
                     rates(), compute(2))
    assert plan.chosen.config.zero.stage == 3 and plan.chosen.config.offload.optimizer == "host"
    with pytest.raises(PlanInputError, match="--fix zero.stages: not a knob"):
        make_plan(_request(tmp_path, fixed={"zero.stages": 3}), rates(), compute(2))


def _bf16_nvme(tmp_path, **optimizer) -> Config:
    return _nvme_config(tmp_path).replace(precision={"param_dtype": "bf16", "reduce_dtype": "bf16"},
                                          optimizer=optimizer)


def _predict(tmp_path, cfg, rates_):
    from infinity.plan.cost import predict
    from infinity.plan.planner import model_layout
    from infinity.store import Tier
    c = compute(2)
    layout = model_layout(_request(tmp_path, param_dtype="bf16"), 3, "bf16", 0)
    budgets = {Tier.HOST: cfg.tiers.host_bytes, Tier.DEVICE: cfg.tiers.device_bytes}
    return predict(layout, cfg, c, rates_, 1, budgets, True, 1 << 20)


def test_a_stored_format_is_priced_at_its_profiled_adam_rate_and_moves_fewer_bytes(tmp_path):
    """The remainder master's update costs what the profile measured for it, and its stored bytes follow
    placement; a profile without that format's figure falls back to fp32's, and says so."""
    slow_formats = {"remainder/fp32": {"params_per_s": 1e6}}
    fp32 = _predict(tmp_path, _bf16_nvme(tmp_path), rates(adam_formats=slow_formats))
    rem = _predict(tmp_path, _bf16_nvme(tmp_path, master="remainder"), rates(adam_formats=slow_formats))
    assert rem.phases["step"]["adam_s"] > 10 * fp32.phases["step"]["adam_s"] > 0
    assert rem.moved_bytes["host->nvme"] < fp32.moved_bytes["host->nvme"]
    old = _predict(tmp_path, _bf16_nvme(tmp_path, master="remainder"), rates())
    assert old.phases["step"]["adam_s"] == pytest.approx(fp32.phases["step"]["adam_s"])
    assert any("remainder/fp32 not in the profile" in n for n in old.notes)


def test_the_update_during_the_next_forward_hides_behind_forward_and_waits_there(tmp_path):
    """Clipping makes an overlapped update run in the next forward (update_at auto): the model
    charges its Adam to forward (a CPU device: the cores are shared) and leaves the step phase without it;
    the backward mode charges backward."""
    base = dict(update_at="auto")
    backward = _predict(tmp_path, _bf16_nvme(tmp_path, **base), rates())
    clipped = _bf16_nvme(tmp_path, **base).replace(schedule={"clip_grad_norm": 1.0})
    assert clipped.update_schedule().at == "next_forward"
    nxt = _predict(tmp_path, clipped, rates())
    plain = _predict(tmp_path, _bf16_nvme(tmp_path).replace(schedule={"clip_grad_norm": 1.0}), rates())
    adam = plain.phases["step"]["adam_s"]
    assert adam > 0
    assert nxt.phases["forward"]["compute_s"] == pytest.approx(plain.phases["forward"]["compute_s"] + adam)
    assert backward.phases["backward"]["compute_s"] == pytest.approx(plain.phases["backward"]["compute_s"] + adam)
    assert nxt.phases["step"]["adam_s"] == 0 and nxt.phases["backward"]["compute_s"] == pytest.approx(
        plain.phases["backward"]["compute_s"])


def test_new_gradient_blocks_above_the_mmap_threshold_are_priced_at_the_fresh_memory_rate(tmp_path):
    """Stages 2-3 on a CPU device make each unit's full gradient anew: the blocks at or above the mmap
    threshold the config fixes cost the profile's fresh-memory copy rate in backward's unattributed time;
    a profile without that figure prices them at memcpy and says so; stage 1 folds into its arena; the host
    block cache takes the blocks no larger than its cap off the bill."""
    from infinity.plan.planner import model_layout
    low = _bf16_nvme(tmp_path).replace(tiers={"malloc_mmap_threshold": "4KiB", "host_cache_bytes": 0})
    high = _bf16_nvme(tmp_path).replace(tiers={"malloc_mmap_threshold": "32MiB", "host_cache_bytes": 0})
    layout = model_layout(_request(tmp_path, param_dtype="bf16"), 3, "bf16", 0)
    fresh = sum(u.padded_numel * 2 for u in layout.units if u.padded_numel * 2 >= 4096)
    assert fresh > 0
    slow = rates(fresh_gbps=0.1)   # memcpy 8 GB/s

    def unattributed(cfg, r):
        return _predict(tmp_path, cfg, r).phases["backward"]["unattributed_s"]

    assert unattributed(low, slow) - unattributed(high, slow) == pytest.approx(fresh / 0.1e9 - fresh / 8e9)
    old = _predict(tmp_path, low, rates())
    assert old.phases["backward"]["unattributed_s"] == pytest.approx(unattributed(high, slow))
    assert any("no fresh-memory copy rate" in n for n in old.notes)
    stage1 = low.replace(zero={"stage": 1}, offload={"params": "none", "grads": "none"})
    assert unattributed(stage1, slow) == pytest.approx(unattributed(stage1, rates()))
    blocks = sorted(u.padded_numel * 2 for u in layout.units if u.padded_numel * 2 >= 4096)
    assert blocks[0] < blocks[-1]
    cap = blocks[0]   # keeps the smallest blocks, not the largest
    part = low.replace(tiers={"host_cache_bytes": cap})
    beyond = sum(b for b in blocks if b > cap)
    assert 0 < beyond < fresh
    assert unattributed(part, slow) - unattributed(high, slow) == pytest.approx(beyond / 0.1e9 - beyond / 8e9)
    assert unattributed(low.replace(tiers={"host_cache_bytes": "auto"}), slow) == pytest.approx(
        unattributed(high, slow))   # auto's 512 MiB keeps every block of this model


def test_the_planner_chooses_where_the_update_overlaps_and_follows_clipping(tmp_path, monkeypatch):
    """Among overlapped updates (the step-time one left out of the search), in backward and in the next
    forward are both candidates; the chosen one predicts no slower than the same knobs in the other mode.
    With clipping the config refuses backward, so every overlapped candidate runs in the next forward;
    speculative is planned only when fixed."""
    from infinity.plan import planner
    monkeypatch.setitem(planner.DIMENSIONS, "optimizer.update_at", ("backward", "next_forward"))
    req = _request(tmp_path, param_dtype="bf16", host_bytes=8 << 20, device_bytes=3 << 20,
                   fixed={"offload.optimizer": "nvme"})
    slow_disk = rates(read_gbps=0.05, write_gbps=0.05)
    plan = make_plan(req, slow_disk, compute(2))
    mode = plan.chosen.config.optimizer.update_at
    assert mode in ("backward", "next_forward") and plan.chosen.config.update_schedule().at == mode
    other = {"backward": "next_forward", "next_forward": "backward"}[mode]
    pinned = {**plan.chosen.knobs, "optimizer.update_at": other}
    rival = make_plan(PlanRequest(**{**req.__dict__, "fixed": pinned}), slow_disk, compute(2))
    assert rival.chosen.config.optimizer.update_at == other
    assert plan.chosen.step_s <= rival.chosen.step_s * (1 + TIE)
    clipped = make_plan(PlanRequest(**{**req.__dict__, "base": {"schedule": {"clip_grad_norm": 1.0}}}),
                        slow_disk, compute(2))
    everything = [clipped.chosen, *clipped.alternatives]
    assert all(c.config.optimizer.update_at == "next_forward" for c in everything)
    assert "overlap in next_forward" in clipped.chosen.label()
    spec = make_plan(PlanRequest(**{**req.__dict__, "base": {"schedule": {"clip_grad_norm": 1.0}},
                                    "fixed": {**req.fixed, "optimizer.update_at": "speculative"}}),
                     slow_disk, compute(2))
    assert spec.chosen.config.update_schedule().at == "speculative"


def test_the_planner_tries_the_exact_split_master_for_bf16_and_never_lossy_moments_unasked(tmp_path):
    req = _request(tmp_path, param_dtype="bf16", host_bytes=8 << 20, device_bytes=3 << 20)
    fast = {"remainder/fp32": {"params_per_s": 4e8}, "fp32/bf16": {"params_per_s": 4e8},
            "remainder/bf16": {"params_per_s": 4e8}}
    plan = make_plan(req, rates(read_gbps=0.05, write_gbps=0.05, adam_formats=fast), compute(2))
    everything = [plan.chosen, *plan.alternatives, *plan.faster_unfit]
    assert plan.chosen.config.offload.optimizer != "none"
    assert plan.chosen.config.optimizer.master == "remainder"   # fewer bytes on a slow disk, same math
    assert all(c.config.optimizer.moments == "fp32" for c in everything)
    lossy = make_plan(PlanRequest(**{**req.__dict__, "fixed": {"optimizer.moments": "bf16"}}),
                      rates(read_gbps=0.05, write_gbps=0.05, adam_formats=fast), compute(2))
    assert lossy.chosen.config.optimizer.moments == "bf16"
    fast["remainder/int8"] = {"params_per_s": 4e8}
    int8 = make_plan(PlanRequest(**{**req.__dict__, "fixed": {"optimizer.moments": "int8"}}),
                     rates(read_gbps=0.05, write_gbps=0.05, adam_formats=fast), compute(2))
    assert int8.chosen.config.optimizer.moments == "int8"


def test_a_speculative_update_is_priced_as_the_step_that_commits(tmp_path):
    """update_at speculative with clipping: predicted as the unclipped update during backward (what a
    step that commits does), with a note on the redo; its kept gradients add one write of every gradient in
    backward exactly where UnitPlacement.writes_kept_grads sends them home, and nothing where the host holds them."""
    from infinity.plan.cost import tier_traffic
    from infinity.plan.planner import model_layout
    from infinity.store import Tier
    from infinity.zero.placement import Placement
    from infinity.zero.stage import StagePolicy
    from infinity.zero.units import TensorClass
    unclipped = _bf16_nvme(tmp_path, update_at="auto")
    spec = _bf16_nvme(tmp_path, update_at="speculative").replace(
        schedule={"clip_grad_norm": 1.0})
    layout = model_layout(_request(tmp_path, param_dtype="bf16"), 3, "bf16", 0)
    placement = Placement.from_config(spec).of(layout.units, StagePolicy.of(3), 2, 2)
    assert TensorClass.GRAD in placement.stored_itemsizes()   # bf16 gradients on NVMe
    grads = sum(u.shard_numel for u in layout.units) * 2
    least = placement.min_budgets()[Tier.HOST][0]
    for host in (least, 4 * spec.tiers.host_bytes):
        s_cfg, u_cfg = spec.replace(tiers={"host_bytes": host}), unclipped.replace(tiers={"host_bytes": host})
        a, b = tier_traffic(layout, s_cfg, host), tier_traffic(layout, u_cfg, host)
        written = placement.writes_kept_grads(a["plan"], host)
        assert written == (host == least), host   # the host minimum cannot hold them all
        # (the step's reads and writes differ where spares halve what the resident chunks hold)
        assert a["read"]["backward"] == b["read"]["backward"]
        assert a["write"]["backward"] == b["write"]["backward"] + (grads if written else 0)
    s_pred, u_pred = _predict(tmp_path, spec, rates()), _predict(tmp_path, unclipped, rates())
    assert s_pred.phases["step"]["adam_s"] == u_pred.phases["step"]["adam_s"] == 0
    assert s_pred.phases["backward"]["compute_s"] == pytest.approx(u_pred.phases["backward"]["compute_s"])
    assert s_pred.phases["forward"]["compute_s"] == pytest.approx(u_pred.phases["forward"]["compute_s"])
    assert any(n.startswith("speculative: the step that commits") for n in s_pred.notes)


def test_a_cpu_devices_compute_is_slowed_beside_the_disk_and_the_update_shares_one_disk(tmp_path):
    """On a CPU device the compute (and the overlapped update's Adam) runs slower for the part of a phase
    the disk is busy, by the profile's contention slowdown: on a disk-bound step all of it, so its seconds
    move from I/O waited on to compute and the step stays the disk's; with no disk time, nothing. The
    overlapped update's reads and writes share the disk with backward's own: backward and the step's
    waits together take the disk time of both at once. A profile without the section is priced unslowed
    and says so; a CUDA device is never slowed."""
    from infinity.plan.cost import tier_traffic
    from infinity.plan.planner import model_layout
    from infinity.store import Tier
    cfg = _bf16_nvme(tmp_path, update_at="auto").replace(tiers={"device_bytes": "256KiB"})
    slow_disk = dict(read_gbps=1e-3, write_gbps=1.0)   # reads the slow side: backward's own reads count
    alone, slowed = _predict(tmp_path, cfg, rates(**slow_disk)), _predict(tmp_path, cfg, rates(slowdown=1.5, **slow_disk))
    assert any("no contention section" in n for n in alone.notes)
    assert not any("no contention section" in n for n in slowed.notes)
    for phase in ("forward", "backward"):
        assert alone.phases[phase]["compute_s"] > 0
        assert slowed.phases[phase]["compute_s"] == pytest.approx(1.5 * alone.phases[phase]["compute_s"]), phase
    assert slowed.step_s == pytest.approx(alone.step_s)   # disk-bound: the compute hides under the disk either way
    assert slowed.totals()["io_wait_s"] < alone.totals()["io_wait_s"]
    # one disk: backward's own reads (its device tier is too small to keep forward's parameters) and the update's
    layout = model_layout(_request(tmp_path, param_dtype="bf16"), 3, "bf16", 0)
    t = tier_traffic(layout, cfg, cfg.tiers.host_bytes)
    assert t["read"]["backward"] > 0 and t["read"]["step"] > 0 and t["write"]["step"] > 0
    mixed_read, mixed_write = 0.6 * 1e6, 0.6 * 1e9   # plan_cases' at-once rates
    both = max((t["read"]["backward"] + t["read"]["step"]) / mixed_read,
               (t["write"]["backward"] + t["write"]["step"]) / mixed_write)
    fill = t["chunk"][0] / 1e6 + t["chunk"][1] / 1e9
    for p in (alone, slowed):
        b, st = p.phases["backward"], p.phases["step"]
        assert b["compute_s"] + b["io_wait_s"] + st["io_wait_s"] == pytest.approx(both + fill)
    # no disk to speak of: nothing slowed
    fast_disk = dict(read_gbps=1e6, write_gbps=1e6)
    a, s = _predict(tmp_path, cfg, rates(**fast_disk)), _predict(tmp_path, cfg, rates(slowdown=1.5, **fast_disk))
    assert s.step_s == pytest.approx(a.step_s, rel=1e-6)
    # a CUDA device: its compute is not on the cores the I/O engine uses
    from infinity.plan.cost import predict
    c = compute(2)
    budgets = {Tier.HOST: cfg.tiers.host_bytes, Tier.DEVICE: cfg.tiers.device_bytes}
    on_gpu = [predict(layout, cfg, c, r, 1, budgets, False, 1 << 20) for r in (rates(**slow_disk), rates(slowdown=1.5, **slow_disk))]
    assert on_gpu[0].phases == on_gpu[1].phases


def test_the_root_units_update_shows_after_an_overlapped_backward(tmp_path):
    """The root unit's gradient (the embeddings) is final when backward ends, so its update's reads and
    writes have nothing to hide behind: with compute long enough to hide every other unit's, the step still
    waits for the root's (its reads and writes at once), here longer than one chunk's write, on either device."""
    from infinity.plan.cost import predict, tier_traffic
    from infinity.plan.planner import model_layout
    from infinity.store import Tier
    cfg = _bf16_nvme(tmp_path, update_at="auto")
    slow = compute(2, block_s=1e3, root_s=1e3)   # compute far longer than the whole step's disk time
    layout = model_layout(_request(tmp_path, param_dtype="bf16"), 3, "bf16", 0)
    budgets = {Tier.HOST: cfg.tiers.host_bytes, Tier.DEVICE: cfg.tiers.device_bytes}
    t = tier_traffic(layout, cfg, cfg.tiers.host_bytes)
    read, write = t["root_job"]
    mixed = 0.6 * 1e-3 * 1e9   # plan_cases' at-once rates
    assert read > 0 and max(read, write) / mixed > t["chunk"][1] / 1e6 > 0   # longer than one chunk's write alone
    for device_is_host in (True, False):
        p = predict(layout, cfg, slow, rates(read_gbps=1e-3, write_gbps=1e-3), 1, budgets, device_is_host, 1 << 20)
        assert p.phases["step"]["io_wait_s"] == pytest.approx(max(read, write) / mixed), device_is_host


def test_predictions_within_the_tie_go_to_the_candidate_moving_fewer_disk_bytes(tmp_path):
    """Two masters on a fast disk: the remainder's Adam a little slower, its traffic smaller. Inside
    TIE of the fastest the remainder wins on disk bytes, and the faster-predicted fp32 master is listed
    saying so; outside TIE (a much slower remainder Adam) the fastest wins as before."""
    fixed = {"zero.stage": 3, "offload.params": "nvme", "offload.grads": "nvme", "offload.optimizer": "nvme",
             "optimizer.update_at": "step", "zero.activation_checkpointing": False,
             "offload.chunk_bytes": 64 * 2**20, "prefetch.bytes": 0, "precision.reduce_dtype": "bf16"}
    req = _request(tmp_path, param_dtype="bf16", host_bytes=1536 << 10, device_bytes=8 << 20, fixed=fixed)
    disk = dict(read_gbps=50.0, write_gbps=50.0)

    def plan_at(rem_rate):
        return make_plan(req, rates(adam_params_per_s=2e8, adam_formats={"remainder/fp32": {"params_per_s": rem_rate}},
                                    **disk), compute(2))

    near = plan_at(1.9e8)
    fp32 = next(c for c in near.alternatives if c.knobs["optimizer.master"] == "fp32")
    assert fp32.step_s < near.chosen.step_s <= fp32.step_s * (1 + TIE)   # a tie the model calls by a hair
    assert near.chosen.knobs["optimizer.master"] == "remainder"
    assert near.chosen.disk_bytes < fp32.disk_bytes
    assert "within the 3% tie, but moves" in near.why_lost(fp32)
    assert "master remainder" in near.chosen.label() and "master" not in fp32.label()
    far = plan_at(2e7)
    rem = next(c for c in far.alternatives if c.knobs["optimizer.master"] == "remainder")
    assert far.chosen.knobs["optimizer.master"] == "fp32" and rem.step_s > far.chosen.step_s * (1 + TIE)


def test_expected_peak_rss_counts_what_the_engine_holds_not_the_caps(tmp_path):
    """The predicted peak RSS takes each term at the occupancy measured at GPT-2 2.7B, not its bound: stage
    3's gathered parameters are the root, the unit computing and the whole units prefetch fetches ahead
    (within max_live); at one rank a unit's full gradient is its own mean (no shard buffer beside it); and
    the host tier fills to its budget with the parameter shards read from NVMe and kept clean until the
    backward reads them again."""
    from infinity.plan.planner import model_layout
    layout = model_layout(_request(tmp_path, param_dtype="bf16"), 3, "bf16", 0)
    root = sum(u.padded_numel for u in layout.units if u.is_root) * 2
    largest = max(u.padded_numel for u in layout.units if not u.is_root) * 2
    base = _bf16_nvme(tmp_path)
    for ahead_units in (0, 1, 2):
        cfg = base.replace(prefetch={"bytes": ahead_units * largest})
        p = _predict(tmp_path, cfg, rates())
        assert p.rss.gathered_params_bytes == min(root + largest * (1 + ahead_units), p.rss_bound.gathered_params_bytes)
        assert p.rss.gathered_params_bytes < p.rss_bound.gathered_params_bytes   # the 1 MiB cap is not reached
    p = _predict(tmp_path, base, rates())
    full = max(u.padded_numel for u in layout.units) * 2
    assert p.rss.grad_buffers_bytes == layout.largest_param_numel * 2 + full   # no second, shard-sized buffer
    assert p.rss.host_tier_bytes == base.tiers.host_bytes   # parameters read from NVMe fill the cache
    # gradients written home in backward stay cached until the step reads them (stage 2), up to the budget
    from infinity.plan import cost
    from infinity.store import Tier
    stage2 = base.replace(zero={"stage": 2}, offload={"params": "none"}, tiers={"host_bytes": "64MiB"})
    p2 = _predict(tmp_path, stage2, rates())
    layout2 = model_layout(_request(tmp_path, param_dtype="bf16"), 2, "bf16", 0)
    traffic = cost.tier_traffic(layout2, stage2, 64 * 2**20)
    written = traffic["write"]["backward"]
    assert written > 0

    def host_tier(backward_writes, budget):
        t = dict(traffic, write=dict(traffic["write"], backward=backward_writes))
        return cost._expected_rss(p2.rss_bound, t, cost.unit_placement(layout2, stage2),
                                  {Tier.HOST: budget, Tier.DEVICE: 0}, True, layout2.largest_param_numel,
                                  0).host_tier_bytes
    assert host_tier(written, 64 * 2**20) - host_tier(0, 64 * 2**20) == written
    assert host_tier(10**12, 64 * 2**20) == 64 * 2**20


def test_timing_the_compute_leaves_nothing_of_the_timed_model_alive():
    """``measure_compute`` frees the model it timed, though one of its forwards (counting the blocks' saved
    bytes) has no backward: the saved-tensor meter holds what it saves detached, where an output held whole
    by its own node's grad_fn was a cycle gc cannot see, which kept every parameter and activation alive."""
    import gc
    before = {id(o) for o in gc.get_objects() if type(o) is torch.nn.Parameter}
    measure_compute(lambda: GPT(GPTConfig(**dict(SHAPE, n_layer=4))), _loss, 2, 32, torch.float32, 512, blocks=2)
    gc.collect()
    left = [o for o in gc.get_objects() if type(o) is torch.nn.Parameter and id(o) not in before]
    assert left == [], f"{len(left)} parameters of the timed model outlived measure_compute"


def test_measured_precision_stores_bf16_only_where_parameters_are_offloaded(tmp_path):
    """``param_dtype: auto`` on a CPU without fast bf16 (its measured answer given): every candidate computes
    in fp32; those that offload stage-3 parameters (or keep a remainder master) store them in bf16, the
    rest store fp32; and the plan still picks among them."""
    from infinity.plan.planner import _enumerate
    from infinity.precision import PrecisionChoice

    slow = PrecisionChoice("bf16", "fp32", "bf16 computes 80x slower")
    req = _request(tmp_path, param_dtype="auto", precision=slow)
    seen = set()
    for knobs, config in _enumerate(req, {}):
        stored_params = knobs["zero.stage"] == 3 and knobs["offload.params"] != "none"
        bf16_store = stored_params or knobs["optimizer.master"] == "remainder"
        assert config.precision.compute_dtype == "fp32"
        assert config.precision.param_dtype == ("bf16" if bf16_store else "fp32"), knobs
        seen.add(bf16_store)
    assert seen == {True, False}
    plan = make_plan(req, rates(), compute(2))
    assert plan.chosen.fits and "fp32" in plan.compute
