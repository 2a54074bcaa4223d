"""The overlapped update with the recipes people run: gradient accumulation, clipping and fp16.

Each case trains the GPT test model (tied weights, two param groups, a LambdaLR schedule) with
``optimizer.update_at`` overlapped and at step in the same world, same data: losses, the clip norms,
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
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import infinity
import offload_cases
import zero_cases
from failure_cases import wait_store_idle
from zero_cases import global_batch, param_groups
from infinity.train.report import engine_metrics

SMALL = dict(host_bytes=(192 + 124 + 64) * 1024, device_bytes=64 * 1024, prefetch_bytes=20 * 1024)
PLACEMENTS = {
    "s3-nvme": dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host"), **SMALL),
    "s2-host": dict(stage=2, offload=dict(optimizer="host", params="none", grads="none"), **SMALL),
    "s2-nvme": dict(stage=2, offload=dict(optimizer="nvme", params="none", grads="none"), **SMALL),
    "s3-all-nvme": dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="nvme"), **SMALL),
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
    cfg["optimizer"].update(update_at=spec.get("mode", "auto") if spec["overlap"] else "step",
                            master=spec.get("master", "fp32"), moments=spec.get("moments", "fp32"))
    cfg["schedule"] = {"clip_grad_norm": spec.get("clip"), "accum_steps": spec.get("accum_steps", 1)}
    if spec.get("dtype") == "fp16":
        cfg["precision"].update(initial_loss_scale=spec["loss_scale"], loss_scale_window=2)
    model = offload_cases.build(spec["model"], spec.get("seed", 0))
    model, opt = infinity.initialize(model, cfg, params=param_groups(model, spec))
    engine = infinity.engine_of(model)
    if spec.get("always_speculate") and engine.update.uses_spares:   # no fallback: every step speculates
        engine.update.speculation.speculate = lambda: True
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
            "group_steps": list(opt.group_steps), "skipped": opt.skipped_steps,
            "writes_kept_grads": any(getattr(u.shard, "write_kept_grads", False) for u in engine.units)}


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
            assert s["overlapped"] and s["update_at"] == case["expect"], (what, s)
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


# ---------------------------------------------------------------- speculative: commit, redo, fall back

# a speculative job holds the current and the spare copy of each state: twice the SMALL host working set
SPEC_HOST = 640 * 1024
SPECULATIVE = [
    dict(name="s3-clip", placement="s3-nvme", clip=CLIP, host_bytes=SPEC_HOST),
    dict(name="s3-clip-always", placement="s3-nvme", clip=CLIP, host_bytes=SPEC_HOST, always_speculate=True),
    dict(name="s2-nvme-clip-accum4", placement="s2-nvme", clip=CLIP, accum=4, accum_steps=4, host_bytes=SPEC_HOST),
    dict(name="s2-host-clip-always", placement="s2-host", clip=CLIP, host_bytes=1 << 20, always_speculate=True),
    dict(name="s3-fp16", placement="s3-nvme", dtype="fp16", loss_scale=2.0**18, host_bytes=SPEC_HOST,
         always_speculate=True),
    dict(name="s2-host-fp16-clip-accum2", placement="s2-host", dtype="fp16", loss_scale=2.0**18, clip=CLIP, accum=2,
         accum_steps=2, host_bytes=1 << 20),
    dict(name="s3-bf16-remainder-int8-clip", placement="s3-nvme", dtype="bf16", master="remainder", moments="int8",
         clip=CLIP, host_bytes=SPEC_HOST, always_speculate=True),
    # gradients on NVMe, more of them than the host holds: written home as each update is done, read back
    # by the redo (UnitPlacement.writes_kept_grads)
    # (a rank's shards halve at world size 2, so its host budget does too; the overlapped update's room leaves
    # a chunk beside it to the gathers and folds: 52 KiB, 4 KiB at world size 2)
    dict(name="s3-all-nvme-clip-always", placement="s3-all-nvme", clip=CLIP,
         host_bytes={1: 276 * 1024, 2: 148 * 1024}, always_speculate=True, writes_kept_grads=True),
    # the same with the policy: its fallback steps write their gradients at the fold, as next_forward does
    dict(name="s3-all-nvme-clip", placement="s3-all-nvme", clip=CLIP,
         host_bytes={1: 276 * 1024, 2: 148 * 1024}, writes_kept_grads=True),
]


@pytest.mark.parametrize("world_size", (1, 2))
def test_speculative_steps_commit_or_redo_bitwise_equal_to_the_plain_step(worlds, tmp_path, world_size):
    """update_at speculative: each speculating step updates during its last backward (units submitted in
    it), and step() commits it when the multiplier is unclipped (nothing redone), redoes it when clipped,
    drops it on an fp16 overflow; the policy falls back to next_forward after a redo. Every result bitwise
    the plain step's, with the kept gradients held in host memory or, where they outweigh it (all on NVMe),
    written home as each update is done and read back by the redo (and on a fallback step, written at the
    fold as next_forward writes them)."""
    cases = [dict(c, mode="speculative", host_bytes=c["host_bytes"][world_size]
                  if isinstance(c["host_bytes"], dict) else c["host_bytes"]) for c in SPECULATIVE]
    per_rank = worlds(world_size).run(many, _pairs(tmp_path, cases))
    results = per_rank[0]
    for case, off, on in zip(cases, results[0::2], results[1::2]):
        what = f"{case['name']}, world {world_size}"
        _assert_same(off, on, what)
        assert on["losses"][0] != on["losses"][-1], f"{what}: training did not move"
        assert on["writes_kept_grads"] == case.get("writes_kept_grads", False), what
        outcomes = [s["speculation"] for s in on["stats"]]
        assert all(s["update_at"] == "speculative" for s in on["stats"]), what
        if case.get("dtype") == "fp16":
            skipped = [o.get("skipped", False) for o in outcomes]
            assert 0 < on["skipped"] == sum(skipped) < BASE["steps"], (what, outcomes)
        clipped = [n > CLIP for n in off["norms"]]
        if case.get("clip") is not None and case.get("dtype") != "fp16":
            assert any(clipped) and not all(clipped), f"{what}: norms {off['norms']} do not test both branches"
        # an fp16 overflow: a skipped step (its clip norm reads inf); unclipped: the final multiplier is the
        # one a speculation uses (no clip, no overflow), so a speculation commits without a redo
        norms = off["norms"] or [None] * len(outcomes)
        overflow = [bool(o.get("skipped")) or n == float("inf") for o, n in zip(outcomes, norms)]
        unclipped = [not skip and (n is None or n <= CLIP) for skip, n in zip(overflow, norms)]
        expected = _policy_replay(unclipped, case.get("always_speculate", False))
        assert [o["speculated"] for o in outcomes] == expected, (what, outcomes)
        for step, (o, st) in enumerate(zip(outcomes, on["stats"])):
            if o["speculated"]:   # updated during backward; step() committed (or redid) it, or skipped it
                assert st["submitted_in_backward"] > 0 and not st.get("update_deferred"), (what, step, st)
                assert o["committed"] == (not overflow[step]) and o.get("skipped", False) == overflow[step], \
                    (what, step, o)
                assert o["redone"] == (not unclipped[step] and not overflow[step]), (what, step, o)
                assert (o.get("redo_s", 0) > 0) == o["redone"], (what, step, o)
            else:   # the fallback: next_forward, launched by step() unless skipped
                assert st["submitted_in_backward"] == 0, (what, step, st)
                assert bool(st.get("update_deferred")) == (not overflow[step]), (what, step, st)
                if case.get("writes_kept_grads"):   # gradients written at the fold: none held, so none spilled
                    assert st["spills"] == 0, (what, step, st)
        if not case.get("always_speculate"):
            assert not all(expected) and any(expected), f"{what}: speculation and its fallback both ran"
        else:
            assert any(o.get("redone") or o.get("skipped") for o in outcomes), f"{what}: nothing was redone"
    for r in per_rank[1:]:   # every rank speculated, committed, redid and skipped the same steps
        for a, b in zip(r[1::2], results[1::2]):
            assert [_outcome(st) for st in a["stats"]] == [_outcome(st) for st in b["stats"]]


def _outcome(stats: dict) -> tuple:
    o = stats["speculation"]
    return o["speculated"], o.get("committed"), o.get("redone"), o.get("skipped")


def _policy_replay(unclipped: list, always: bool) -> list:
    """The steps that speculate, by the rule SpeculationPolicy documents: after a failed speculation wait
    for 1, 2, 4, ... unclipped steps in a row (doubling while speculations keep failing), reset on a commit."""
    speculated, need, calm, wait = [], 0, 0, 1
    for ok in unclipped:
        now = always or calm >= need
        speculated.append(now)
        if now and ok:
            need, calm, wait = 0, 0, 1
        elif now:
            need, calm, wait = wait, 0, min(2 * wait, 32)
        else:
            calm = calm + 1 if ok else 0
    return speculated


@pytest.mark.parametrize("world_size", (1, 2))
def test_accumulated_gradients_that_fill_the_host_tier_are_spilled_before_any_update(worlds, tmp_path, world_size):
    """Backward mode, NVMe gradients, accumulation 2, a host budget at the minimum, 24 small units: the first
    backward's gradients wait unwritten in host memory for the overlapped update (defer_grad_writes) and
    fill the tier before the pipeline has ever run; the folds of that backward write some home (spills)
    instead of failing for room. Bitwise the plain step. (At 2.7B this failed the first step for room.)"""
    case = dict(name="many-nvme-grads-accum2", placement="s3-nvme", model="many", groups=False, scheduler=False,
                offload=dict(optimizer="nvme", params="nvme", grads="nvme"), host_bytes=40 * 1024,
                accum=2, accum_steps=2, mode="backward")
    off, on = worlds(world_size).run(many, _pairs(tmp_path, [case]))[0]
    _assert_same(off, on, f"world {world_size}")
    assert on["stats"][0]["spills"] > 0, on["stats"][0]   # the first step's folds spilled, nothing had run
    assert all(s["update_at"] == "backward" and s["submitted_in_backward"] > 0 for s in on["stats"]), on["stats"]


# ---------------------------------------------------------------- next_forward: when the update is waited for

def _start(spec: dict, overlap: bool = True):
    cfg = offload_cases.offload_config(spec, *_rank_world())
    cfg["optimizer"].update(update_at=spec.get("mode", "auto") if overlap else "step")
    cfg["schedule"] = {"clip_grad_norm": spec.get("clip", CLIP)}
    model = offload_cases.build("gpt", 0)
    model, opt = infinity.initialize(model, cfg, params=param_groups(model, spec))
    return model, opt, infinity.engine_of(model)


def _step(model, opt, step: int, batch: int = 8) -> float:
    ids = global_batch(step, batch)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.clip_grad_norm_(CLIP)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _params(model, engine) -> dict:
    with engine.gathered():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement", ["s3-nvme", "s2-nvme"])
def test_the_next_forward_waits_for_each_unit_just_before_it_runs(tmp_path, placement):
    """After ``step()`` every unit's update is launched, none waited for; at each block's forward the
    root and the blocks before it (and it) have been waited for, the blocks after it not yet; after the
    forward nothing is pending and the step's stats carry the update's times."""
    spec = {**BASE, **PLACEMENTS[placement], "tmp": str(tmp_path)}
    model, opt, engine = _start(spec)
    seen = []
    try:
        _step(model, opt, 0)
        assert engine.update.pending
        blocks = [u for u in engine.units if not u.is_root]
        root = next(u for u in engine.units if u.is_root)
        assert all(engine.update.updating(u) for u in engine.units)
        for unit in blocks:   # registered after the engine's hook: runs once it has waited
            unit.module.register_forward_pre_hook(
                lambda module, args, unit=unit: seen.append(
                    (unit.index, engine.update.updating(root),
                     [engine.update.updating(u) for u in blocks])))
        launched = engine.stats.last_step["offload"]
        assert launched["update_deferred"] and "update_wait_s" not in launched
        line = engine_metrics(engine, 1.0)   # the --metrics line of the launched step: its Adam time is unknown
        assert "adam_s" not in line and "swap_in_wait_s" not in line and "previous_update" not in line, line
        _step(model, opt, 1)
        assert launched["update_wait_s"] >= 0 and launched["adam_s"] > 0
        line = engine_metrics(engine, 1.0)   # the next step's line carries the update it waited for
        assert line["previous_update"] == {k: launched[k] for k in
                                           ("adam_s", "swap_in_wait_s", "swap_out_wait_s", "update_wait_s")}
    finally:
        engine.close()
    first = seen[:len(blocks)]   # the forward right after the launched step
    for i, (index, root_waiting, waiting) in enumerate(first):
        assert index == blocks[i].index and not root_waiting
        assert waiting == [j > i for j in range(len(blocks))], first


FLUSHES = ("state_dict", "save", "gathered", "close")


def flushed(spec: dict) -> dict:
    """Two steps; right after the second ``step()`` one thing that reads every shard: its parameters."""
    model, opt, engine = _start(spec, overlap=spec["overlap"])
    for step in range(2):
        _step(model, opt, step)
    pending = engine.update.pending
    how = spec["flush"]
    try:
        if how == "state_dict":   # stage 2: the full parameters
            params = {n: t.float().clone() for n, t in model.state_dict().items()}
        elif how == "save":
            infinity.save_checkpoint(spec["tmp"] + "/ckpt", model, opt)
            fresh, fresh_opt, fresh_engine = _start(dict(spec, tmp=spec["tmp"] + "/fresh"), overlap=False)
            try:
                infinity.load_checkpoint(spec["tmp"] + "/ckpt", fresh, fresh_opt)
                params = _params(fresh, fresh_engine)
            finally:
                fresh_engine.close()
        elif how == "gathered":
            params = _params(model, engine)
        else:
            engine.close()   # stage 2: parameters stay readable views of the full buffers
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return {"pending": pending, "params": params}


def test_a_save_state_dict_gathered_and_close_wait_for_the_launched_update(tmp_path):
    """Each reader of every shard right after a next_forward ``step()`` sees that step's parameters,
    bitwise those of the plain step."""
    base = {**BASE, **PLACEMENTS["s2-nvme"]}
    ref = flushed(dict(base, overlap=False, flush="gathered", tmp=str(tmp_path / "ref")))
    assert not ref["pending"]
    for how in FLUSHES:
        got = flushed(dict(base, overlap=True, flush=how, tmp=str(tmp_path / how)))
        assert got["pending"], how
        assert got["params"].keys() >= ref["params"].keys(), how
        for name, p in ref["params"].items():
            assert torch.equal(got["params"][name], p), f"{how}: {name}"


# ---------------------------------------------------------------- next_forward: faults

def faulted(spec: dict) -> dict:
    """Steps 0-3; a checkpoint after step 1; ``fault`` ("raise" / "enospc") hits step 2's launched
    update, so step 3's forward raises; then zero_grad is refused, the checkpoint is loaded and steps
    2-3 run again."""
    model, opt, engine = _start(spec, overlap=spec["overlap"])
    out = {"error": None, "refused": None}
    try:
        for step in range(4):
            if step == 2 and spec.get("fault"):
                ids = global_batch(step, 8)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.clip_grad_norm_(CLIP)
                real, calls = engine.update.adam.step_, []
                if spec["fault"] == "raise":

                    def failing(*args, **kwargs):
                        calls.append(1)
                        if len(calls) == 2:
                            raise RuntimeError("injected failure in the launched update")
                        return real(*args, **kwargs)
                    engine.update.adam.step_ = failing
                else:
                    wait_store_idle(engine.store)
                    engine.store._engine.syscalls.inject("pwritev", errno.ENOSPC, count=1)
                opt.step()   # launches, returns
                opt.zero_grad()
                try:
                    with pytest.raises((RuntimeError, OSError)) as err:
                        _step(model, opt, 3)
                    out["error"] = str(err.value)
                    out["notes"] = getattr(err.value, "__notes__", [])
                    with pytest.raises(RuntimeError) as refused:
                        opt.zero_grad()
                    out["refused"] = str(refused.value)
                finally:
                    engine.update.adam.step_ = real
                    engine.store._engine.syscalls.clear()
                infinity.load_checkpoint(spec["tmp"] + "/ckpt", model, opt)
                for again in (2, 3):
                    _step(model, opt, again)
                break
            _step(model, opt, step)
            if step == 1:
                infinity.save_checkpoint(spec["tmp"] + "/ckpt", model, opt)
        out["params"] = _params(model, engine)
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("fault", ["raise", "enospc"])
def test_a_launched_update_that_fails_is_reported_and_the_last_checkpoint_loses_nothing(tmp_path, fault):
    """An exception (or ENOSPC) inside the update ``step()`` launched: the next forward raises it with
    a note saying the state is not a whole step, zero_grad is refused, and after loading the last
    checkpoint the run ends bitwise where a run without the fault ends."""
    base = {**BASE, **PLACEMENTS["s3-nvme"], "scheduler": False}
    ref = faulted(dict(base, overlap=False, tmp=str(tmp_path / "ref")))
    got = faulted(dict(base, overlap=True, fault=fault, tmp=str(tmp_path / fault)))
    expected = "injected failure in the launched update" if fault == "raise" else "No space left on device"
    assert expected in got["error"], got["error"]
    assert any("failed part-way" in n and "load the last checkpoint" in n for n in got["notes"]), got["notes"]
    assert "failed part-way" in got["refused"], got["refused"]
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), f"{fault}: {name}"


# ---------------------------------------------------------------- speculative: faults

def speculative_faulted(spec: dict) -> dict:
    """Steps 0-3 with clipping, every step speculating. ``fault`` hits step 2's speculative update: "enospc"
    (a spare's write home fails), "raise" (CPU Adam raises), so step() raises; or "backward" (the user's
    code raises in the middle of the backward, after one unit's update has run). Then ``after`` "retry" calls
    step() again, or "drop" zero_grads (nothing of the step is kept) and runs step 2 again."""
    model, opt, engine = _start(spec, overlap=spec["overlap"])
    if engine.update.uses_spares:
        engine.update.speculation.speculate = lambda: True
    out: dict = {"error": None}
    try:
        for step in range(4):
            if step != 2 or not spec.get("fault"):
                _step(model, opt, step)
                continue
            before = _params(model, engine)
            ids = global_batch(step, 8)
            loss = model(input_ids=ids, labels=ids).loss
            real, calls = engine.update.adam.step_, []
            fault = spec["fault"]
            if fault == "raise":
                def failing(*args, **kwargs):
                    calls.append(1)
                    if len(calls) == 2:
                        raise RuntimeError("injected failure in the speculative update")
                    return real(*args, **kwargs)
                engine.update.adam.step_ = failing
            elif fault == "enospc":
                wait_store_idle(engine.store)
                engine.store._engine.syscalls.inject("pwritev", errno.ENOSPC, count=1)
            else:   # raised by a hook on the first block's weight, once the last block's update has run
                first_block = model.transformer.h[0].mlp.c_fc.weight

                def raising(grad):
                    deadline = time.monotonic() + 30
                    while not engine.update.pipeline.updated and time.monotonic() < deadline:
                        time.sleep(0.001)
                    out["updated_before_raise"] = list(engine.update.pipeline.updated)
                    raise RuntimeError("injected failure in backward")
                handle = first_block.register_hook(raising)
            try:
                with pytest.raises((RuntimeError, OSError)) as err:
                    loss.backward()
                    opt.clip_grad_norm_(CLIP)
                    opt.step()
                out["error"] = str(err.value)
            finally:
                engine.update.adam.step_ = real
                engine.store._engine.syscalls.clear()
                if fault == "backward":
                    handle.remove()
            if spec["after"] == "retry" and fault != "backward":
                opt.step()
                opt.zero_grad()
            else:
                opt.zero_grad()   # not refused: nothing of the step was kept
                out["dropped"] = _params(model, engine)
                out["before"] = before
                _step(model, opt, step)
        out["params"] = _params(model, engine)
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("fault,after", [("enospc", "retry"), ("enospc", "drop"), ("raise", "retry"),
                                         ("backward", "drop")])
def test_a_speculative_step_that_fails_keeps_the_last_committed_state(tmp_path, fault, after):
    """A failure inside a speculative step (ENOSPC writing a spare, an exception in its update or in the
    backward it overlaps) leaves the state of the last committed step: zero_grad() is allowed and the
    parameters are bitwise those before the step; or step() again redoes the step whole. Either way the run
    ends bitwise where a run without overlap (and without the fault) ends."""
    base = {**BASE, **PLACEMENTS["s3-nvme"], "scheduler": False, "host_bytes": SPEC_HOST, "mode": "speculative"}
    ref = speculative_faulted(dict(base, overlap=False, tmp=str(tmp_path / "ref")))
    got = speculative_faulted(dict(base, overlap=True, fault=fault, after=after, tmp=str(tmp_path / fault)))
    expected = {"raise": "injected failure in the speculative update", "enospc": "No space left on device",
                "backward": "injected failure in backward"}[fault]
    assert expected in got["error"], got["error"]
    if fault == "backward":
        assert got["updated_before_raise"], "no unit was updated before the backward raised"
    if after == "drop":
        for name, p in got["before"].items():
            assert torch.equal(got["dropped"][name], p), f"{fault}: {name} changed by a dropped step"
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), f"{fault}/{after}: {name}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "speculative"])
def test_sigkill_inside_an_overlapped_update_then_resume_loses_nothing(tmp_path, mode):
    """A process SIGKILLed inside an overlapped update (auto: the update its step() launched, one unit's
    Adam done; speculative: during backward, spares half written): a new process resumes from the last
    checkpoint and ends bitwise where a run without overlap ends."""
    script = Path(__file__).resolve().parents[1] / "helpers" / "overlap_kill_script.py"

    def run(what: str) -> int:
        return subprocess.run([sys.executable, str(script), what, str(tmp_path), mode], timeout=300,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))).returncode

    assert run("kill") == -signal.SIGKILL
    assert (tmp_path / "ckpt").exists() and not (tmp_path / "kill.pt").exists()
    assert run("resume") == 0 and run("straight") == 0
    resumed, straight = torch.load(tmp_path / "resume.pt"), torch.load(tmp_path / "straight.pt")
    for name, p in straight.items():
        assert torch.equal(resumed[name], p), name
