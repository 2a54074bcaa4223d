"""The overlapped update with the recipes people run: gradient accumulation, clipping and fp16.

Each case trains the GPT test model (tied weights, two param groups, a LambdaLR schedule) with
``optimizer.overlap_backward`` on and off in the same world, same data: losses, the clip norms,
skipped steps and parameters bitwise equal (the arithmetic is the same, only its time differs).

- backward mode with accumulation 4, the boundary from ``schedule.accum_steps`` or from
  ``engine.no_sync()``: units are still submitted during the last backward;
- next_forward mode with clipping at a threshold that clips some steps and not others, with
  accumulation 1 and 4; with fp16 and a loss scale that overflows on some steps (skipped, nothing
  launched): ``step()`` launches, the next forward waits per unit;
- stage 3 (params, optimizer on NVMe; grads on host) and stage 2 (optimizer on host, on NVMe), world
  sizes 1 and 2.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import infinity
import offload_cases
import zero_cases
from zero_cases import global_batch, param_groups

SMALL = dict(host_bytes=(192 + 124 + 64) * 1024, device_bytes=64 * 1024, prefetch_bytes=20 * 1024)
PLACEMENTS = {
    "s3-nvme": dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host"), **SMALL),
    "s2-host": dict(stage=2, offload=dict(optimizer="host", params="none", grads="none"), **SMALL),
    "s2-nvme": dict(stage=2, offload=dict(optimizer="nvme", params="none", grads="none"), **SMALL),
}
BASE = dict(model="gpt", steps=4, batch=8, lr=1e-2, groups=True, scheduler=True, accum=1)
# the plain run's norms (GPT test model, lr 1e-2) are about 1.4, 3.1, 2.3, 1.3: 2.0 clips steps 1-2 and
# not 0 and 3 (the test checks that both branches happened)
CLIP = 2.0


def _rank_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def recipe(spec: dict) -> dict:
    """Steps of ``accum`` forward/backward, optional clip, step, zero_grad, LambdaLR; rank 0 returns the
    parameters."""
    rank, world = _rank_world()
    cfg = offload_cases.offload_config(spec, rank, world)
    cfg["optimizer"].update(overlap_backward=spec["overlap"], overlap_mode=spec.get("mode", "auto"))
    cfg["schedule"] = {"clip_grad_norm": spec.get("clip"), "accum_steps": spec.get("accum_steps", 1)}
    if spec.get("dtype") == "fp16":
        cfg["precision"].update(initial_loss_scale=spec["loss_scale"], loss_scale_window=2)
    model = offload_cases.build(spec["model"], spec.get("seed", 0))
    model, opt = infinity.initialize(model, cfg, params=param_groups(model, spec))
    engine = infinity.engine_of(model)
    sched = zero_cases.make_scheduler(opt, spec)
    accum = spec["accum"]
    losses, norms, stats = [], [], []
    try:
        for step in range(spec["steps"]):
            micro = global_batch(step, spec["batch"]).chunk(world * accum)
            total = torch.zeros(())
            for j in range(accum):
                quiet = spec.get("no_sync") and j < accum - 1
                with engine.no_sync() if quiet else contextlib.nullcontext():
                    ids = micro[rank * accum + j]
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss / accum).backward()
                total += loss.detach().float() / accum
            if world > 1:
                dist.all_reduce(total)
                total /= world
            losses.append(total.item())
            if spec.get("clip") is not None:
                norms.append(float(opt.clip_grad_norm_(spec["clip"])))
            opt.step()
            opt.zero_grad()
            if sched:
                sched.step()
            stats.append(engine.stats.last_step["offload"])
        with engine.gathered():
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
    finally:
        engine.close()
    return {"losses": losses, "norms": norms, "params": params, "stats": stats, "units": len(engine.units),
            "group_steps": list(opt.group_steps), "skipped": opt.skipped_steps}


def many(specs: list) -> list:
    return [recipe(s) for s in specs]


def _pairs(tmp_path, cases: list) -> list:
    """Each case without overlap, then with it."""
    return [{**BASE, **PLACEMENTS[c["placement"]], **c, "overlap": overlap,
             "tmp": str(tmp_path / f"{c['name']}-{overlap}")}
            for c in cases for overlap in (False, True)]


def _assert_same(off: dict, on: dict, what: str) -> None:
    assert on["losses"] == off["losses"], f"{what}: losses {on['losses']} vs {off['losses']} without overlap"
    assert on["norms"] == off["norms"], f"{what}: clip norms {on['norms']} vs {off['norms']}"
    assert on["group_steps"] == off["group_steps"] and on["skipped"] == off["skipped"], what
    for name, p in off["params"].items():
        assert torch.equal(on["params"][name], p), \
            f"{what}: parameter {name} differs by {(on['params'][name] - p).abs().max().item():.3g}"


CASES = [
    # backward mode, 4 micro-batches: the boundary from the config count, or from no_sync()
    dict(name="s3-accum4-count", placement="s3-nvme", accum=4, accum_steps=4, mode="backward", expect="backward"),
    dict(name="s2-accum4-nosync", placement="s2-host", accum=4, no_sync=True, mode="backward", expect="backward"),
    # next_forward (auto: clipping is configured): clips some steps, not others; accumulation 1 and 4
    dict(name="s3-clip", placement="s3-nvme", clip=CLIP, expect="next_forward"),
    dict(name="s2-clip-accum4", placement="s2-nvme", clip=CLIP, accum=4, accum_steps=4, expect="next_forward"),
    dict(name="s2-host-clip", placement="s2-host", clip=CLIP, expect="next_forward"),
    # fp16 (auto: next_forward): the first steps overflow and are skipped, the scale halves to fit
    dict(name="s3-fp16", placement="s3-nvme", dtype="fp16", loss_scale=2.0**18, expect="next_forward"),
    dict(name="s2-fp16-clip", placement="s2-host", dtype="fp16", loss_scale=2.0**18, host_bytes=SMALL["host_bytes"] + 64 * 1024, clip=CLIP, accum=2,
         accum_steps=2, expect="next_forward"),
]


@pytest.mark.parametrize("world_size", (1, 2))
def test_recipes_bitwise_equal_to_the_plain_step(worlds, tmp_path, world_size):
    specs = _pairs(tmp_path, CASES)
    per_rank = worlds(world_size).run(many, specs)
    results = per_rank[0]
    for case, off, on in zip(CASES, results[0::2], results[1::2]):
        what = f"{case['name']}, world {world_size}"
        _assert_same(off, on, what)
        assert on["losses"][0] != on["losses"][-1], f"{what}: training did not move"
        if case.get("clip") is not None:
            clipped = [n > case["clip"] for n in off["norms"]]
            assert any(clipped) and not all(clipped), f"{what}: norms {off['norms']} do not test both branches"
        if case.get("dtype") == "fp16":
            assert 0 < off["skipped"] < BASE["steps"], f"{what}: {off['skipped']} steps skipped"
        for s in on["stats"]:
            assert s["overlapped"] and s["overlap_mode"] == case["expect"], (what, s)
            if case["expect"] == "backward":
                # GPT: 2 blocks + root; block 1 is submitted inside the last backward
                assert s["submitted_in_backward"] == on["units"] - 2, (what, s)
            else:
                assert s["submitted_in_backward"] == 0, (what, s)
        launched = [s for s in on["stats"] if s.get("update_deferred")]
        if case["expect"] == "next_forward":
            applied = BASE["steps"] - on["skipped"]
            assert len(launched) == applied, (what, [s.get("update_deferred") for s in on["stats"]])
            # the next forward (or the final gathered()) waited for each and filled in its times
            assert all("update_wait_s" in s and s["adam_s"] > 0 for s in launched), (what, launched)
    for r in per_rank[1:]:   # every rank submitted the same units in backward
        for a, b in zip(r[1::2], results[1::2]):
            assert [s["submitted_in_backward"] for s in a["stats"]] == \
                [s["submitted_in_backward"] for s in b["stats"]]
