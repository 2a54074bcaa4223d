"""optimizer.update_at backward / next_forward: each unit's update runs during backward, with the same results.

Overlap on vs off, same world, same data: losses and parameters bitwise equal, for stage 3
(params + optimizer on NVMe, grads on host; everything on NVMe) and stage 2 (optimizer on NVMe),
fp32 and bf16, world sizes 1 and 2, on the GPT test model (tied weights, two param groups) with a
LambdaLR schedule changing the lr between steps; and on a model whose unit order changes between
steps. The stats show updates submitted, and begun, while backward still ran. Misuse gets clear
errors, and a backward that raises half-way leaves no thread behind.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import infinity
import offload_cases
import zero_cases
from infinity.config import ConfigError
from zero_cases import VOCAB, Out, global_batch, param_groups

SMALL = dict(host_bytes=192 * 1024, device_bytes=64 * 1024, prefetch_bytes=20 * 1024)  # see test_offload_equivalence
# gradients on the host tier; + 16 KiB: the overlapped update's room leaves a chunk to the gathers beside it
SMALL_GRADS_ON_HOST = dict(SMALL, host_bytes=(192 + 124 + 16) * 1024)
PLACEMENTS = [
    ("s3-params-opt-nvme", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host"),
                                **SMALL_GRADS_ON_HOST)),
    ("s3-all-nvme", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="nvme"),
                         **SMALL_GRADS_ON_HOST)),
    ("s2-opt-nvme", dict(stage=2, offload=dict(optimizer="nvme", params="none", grads="none"), **SMALL)),
]
BASE = dict(model="gpt", steps=3, batch=8, lr=1e-2, groups=True, scheduler=True)
_THREADS = ("infinity-adam", "infinity-swap-in")


# ---------------------------------------------------------------- rank side

class _Hook(torch.autograd.Function):
    """Identity whose backward calls ``hook()`` first."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return grad, None


class Gated(offload_cases.Reorder):
    """24 tiny blocks; ``hook()`` runs in backward after every block's backward, before the embedding's."""

    def __init__(self):
        super().__init__(width=8, n=24)
        self.hook = lambda: None

    def forward(self, input_ids, labels=None):
        x = _Hook.apply(self.emb(input_ids), self.hook)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return Out(F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1)), logits)


def _rank_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _init(spec: dict, model):
    rank, world = _rank_world()
    cfg = offload_cases.offload_config(spec, rank, world)
    cfg["optimizer"]["update_at"] = "auto" if spec["overlap"] else "step"
    model, opt = infinity.initialize(model, cfg, params=param_groups(model, spec))
    return model, opt, infinity.engine_of(model)


def train(spec: dict) -> dict:
    """Steps of forward / backward / step / zero_grad / LambdaLR; rank 0 returns the parameters."""
    rank, world = _rank_world()
    model, opt, engine = _init(spec, offload_cases.build(spec["model"], spec.get("seed", 0)))
    sched = zero_cases.make_scheduler(opt, spec)
    losses, stats = [], []
    try:
        for step in range(spec["steps"]):
            if spec["model"] == "reorder":
                model.route = offload_cases.route_for(step)
            losses.append(zero_cases.backward_on_share(model, global_batch(step, spec["batch"]), rank, world))
            opt.step()
            opt.zero_grad()
            if sched:
                sched.step()
            stats.append(engine.stats.last_step["offload"])
        with engine.gathered():
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
    finally:
        engine.close()
    return {"losses": losses, "params": params, "stats": stats, "units": len(engine.units),
            "group_steps": list(opt.group_steps)}


def many(specs: list) -> list:
    return [train(s) for s in specs]


def _wait_until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)


def gated(spec: dict) -> dict:
    """One step of the gated model; its hook waits until the pipeline has begun an update (or raises)."""
    rank, world = _rank_world()
    torch.manual_seed(0)
    model, opt, engine = _init(spec, Gated())
    if spec.get("raise_in_backward"):
        def hook():
            raise RuntimeError("boom in backward")
    else:
        def hook():
            _wait_until(lambda: engine.update.pipeline.updates_started > 0)
    model.hook = hook
    error = None
    try:
        ids = global_batch(0, spec["batch"]).chunk(world)[rank]
        try:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        except RuntimeError as e:
            error = str(e)
        stats = engine.stats.last_step.get("offload")
    finally:
        engine.close()
    alive = [t.name for t in threading.enumerate() if t.name in _THREADS]
    return {"error": error, "stats": stats, "units": len(engine.units), "alive": alive}


def misuse(spec: dict) -> dict:
    """``second_backward``: backward twice, then step (which still applies the first backward only);
    ``clip``: clip_grad_norm_ after backward; ``once``: neither. Returns the error and the parameters
    after the step."""
    rank, world = _rank_world()
    model, opt, engine = _init(spec, offload_cases.build("gpt"))
    error = None
    try:
        ids = global_batch(0, spec["batch"]).chunk(world)[rank]
        model(input_ids=ids, labels=ids).loss.backward()
        try:
            if spec["kind"] == "second_backward":
                model(input_ids=ids, labels=ids).loss.backward()
            elif spec["kind"] == "clip":
                opt.clip_grad_norm_(1.0)
        except RuntimeError as e:
            error = str(e)
        opt.step()
        opt.zero_grad()
        with engine.gathered():
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
    finally:
        engine.close()
    return {"error": error, "params": params}


# ---------------------------------------------------------------- tests

def _specs(tmp_path, cases, **extra):
    return [dict(BASE, **dict(c, **extra), overlap=overlap, tmp=str(tmp_path / f"{name}-{overlap}"))
            for name, c in cases for overlap in (False, True)]


def _assert_same(off: dict, on: dict, what: str) -> None:
    assert on["losses"] == off["losses"], f"{what}: losses {on['losses']} vs {off['losses']} without overlap"
    assert on["group_steps"] == off["group_steps"], f"{what}: group steps {on['group_steps']}"
    for name, p in off["params"].items():
        assert torch.equal(on["params"][name], p), \
            f"{what}: parameter {name} differs by {(on['params'][name] - p).abs().max().item():.3g}"


@pytest.mark.parametrize("world_size", (1, 2))
def test_bitwise_equal_to_the_step_after_backward(worlds, tmp_path, world_size):
    specs = []
    for dtype in ("fp32", "bf16"):
        for name, case in PLACEMENTS:
            # bf16 parameters are keys of their own: 64 KiB more host room (either way: the budget,
            # not the overlap, decides; without it the step after backward fails for room as well)
            more = dict(host_bytes=case["host_bytes"] + 64 * 1024) if dtype == "bf16" else {}
            specs += _specs(tmp_path / dtype, [(name, dict(case, **more))], dtype=dtype)
    per_rank = worlds(world_size).run(many, specs)
    results = per_rank[0]
    for i in range(0, len(specs), 2):
        off, on = results[i], results[i + 1]
        what = f"{specs[i]['tmp'].rsplit('/', 2)[-2]}/{specs[i]['tmp'].rsplit('/', 1)[-1][:-6]}, world {world_size}"
        _assert_same(off, on, what)
        assert on["losses"][0] != on["losses"][-1], f"{what}: training did not move"
        assert [s["overlapped"] for s in off["stats"]] == [False] * BASE["steps"]
        for s in on["stats"]:
            assert s["overlapped"] is True
            # GPT: 2 blocks + root; block 1's shard is final when the root's reduce-scatter is
            # launched (two in flight), still inside backward; block 0 and root follow its end
            assert s["submitted_in_backward"] == on["units"] - 2, s
            if "nvme" in specs[i + 1]["offload"].values():
                assert s["moved_bytes"].get("nvme->host", 0) > 0, f"{what}: states never re-read from NVMe"
    for r in per_rank[1:]:   # every rank submitted the same number of units in backward
        for a, b in zip(r[1::2], results[1::2]):
            assert [s["submitted_in_backward"] for s in a["stats"]] == \
                [s["submitted_in_backward"] for s in b["stats"]]


def test_unit_order_changes_between_steps(worlds, tmp_path):
    """Blocks run in another order in steps 2 and 4 (and one twice): still bitwise equal."""
    case = ("reorder", dict(PLACEMENTS[1][1], model="reorder", steps=5, groups=False))
    specs = _specs(tmp_path, [case])
    off, on = worlds(2).run(many, specs)[0]
    _assert_same(off, on, "reorder")
    assert off["losses"] == pytest.approx(offload_cases.reference_run(specs[0])["losses"], rel=1e-5)


def test_stress_many_units_tiny_budgets(worlds, tmp_path):
    """24 tiny units, everything on NVMe, device tier ~4 shards: gathers, prefetches and gradient
    writes of backward share the store with the updates running beside them; still bitwise equal."""
    case = ("many", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="nvme"),
                         host_bytes=160 * 1024, device_bytes=16 * 1024, prefetch_bytes=12 * 1024,
                         max_live=24 * 1024))
    specs = _specs(tmp_path, [case], model="many", groups=False, scheduler=False)
    off, on = worlds(2).run(many, specs)[0]
    _assert_same(off, on, "many units")
    assert all(s["submitted_in_backward"] == on["units"] - 2 for s in on["stats"]), on["stats"]


def test_updates_begin_while_backward_runs(worlds, tmp_path):
    """The gated model's backward pauses (before its last unit) until the pipeline has begun an
    update: the engine counts that update as begun before backward ended. Falling back to the
    step after backward would time the hook out and count none."""
    spec = dict(BASE, **PLACEMENTS[1][1], model="gated", groups=False, overlap=True, tmp=str(tmp_path / "gated"))
    for r in worlds(2).run(gated, spec):
        assert r["error"] is None, r["error"]
        s = r["stats"]
        assert s["overlapped"] and s["submitted_in_backward"] == r["units"] - 2, s
        assert s["updates_before_backward_end"] >= 1, s


def test_backward_that_raises_leaves_no_thread(worlds, tmp_path):
    """A backward raising after 22 units were submitted: the error comes through, close() stops the
    pipeline threads (the units already updated stay so: documented)."""
    spec = dict(BASE, **PLACEMENTS[0][1], model="gated", groups=False, overlap=True, raise_in_backward=True,
                tmp=str(tmp_path / "raises"))
    for r in worlds(1).run(gated, spec):
        assert r["error"] == "boom in backward"
        assert r["alive"] == [], f"pipeline threads left running after close(): {r['alive']}"


def test_second_backward_is_refused_and_the_step_still_applies_the_first(worlds, tmp_path):
    case = PLACEMENTS[2]
    base = dict(BASE, **case[1], scheduler=False)
    ref = worlds(2).run(misuse, dict(base, overlap=False, kind="once", tmp=str(tmp_path / "ref")))[0]
    got = worlds(2).run(misuse, dict(base, overlap=True, kind="second_backward", tmp=str(tmp_path / "twice")))[0]
    assert got["error"].startswith("backward() on rank 0 before optimizer.step(): optimizer.update_at backward "
                                   "applies the update in the step's last backward (schedule.accum_steps "
                                   "backwards per step, or the first outside engine.no_sync())"), got["error"]
    assert ref["error"] is None
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), f"{name}: the refused backward changed the step"


def test_stage3_forward_before_step_is_refused(worlds, tmp_path):
    """Stage 3: the second forward would gather units whose update is running; refused there."""
    spec = dict(BASE, **PLACEMENTS[0][1], overlap=True, kind="second_backward", tmp=str(tmp_path / "s3"))
    got = worlds(1).run(misuse, spec)[0]
    assert "before optimizer.step()" in got["error"] and "the step's last backward" in got["error"], got["error"]


def test_clip_grad_norm_is_refused_in_backward_mode(worlds, tmp_path):
    spec = dict(BASE, **PLACEMENTS[0][1], overlap=True, kind="clip", tmp=str(tmp_path / "clip"))
    got = worlds(1).run(misuse, spec)[0]
    assert "clip_grad_norm_() on rank 0 with optimizer.update_at backward" in got["error"], got["error"]
    assert "clipping needs every gradient before any update" in got["error"]


@pytest.mark.parametrize("change,needs", [
    (dict(zero={"stage": 1}), "needs zero.stage >= 2"),
    (dict(offload={"optimizer": "none"}), "needs offload.optimizer host or nvme"),
    (dict(precision={"param_dtype": "fp16"}), "not for precision.param_dtype fp16"),
])
def test_config_refusals_at_initialize(tmp_path, change, needs):
    cfg = {"zero": {"stage": 2}, "offload": {"optimizer": "host"},
           "optimizer": {"update_at": "backward"}}
    for section, keys in change.items():
        cfg[section] = dict(cfg.get(section, {}), **keys)
    model = offload_cases.build("gpt")
    with pytest.raises(ConfigError, match=f"^optimizer.update_at backward: {needs}"):
        infinity.initialize(model, cfg)
    infinity.Config.from_dict(dict(cfg, optimizer={"update_at": "step"}))   # fine without it


# ---------------------------------------------------------------- the pipeline's streaming form

def _pipeline_store(tmp_path, host_bytes, n=1, numel=4096):
    from infinity.config import IOConfig, TiersConfig
    from infinity.optim.shard_job import ShardJob
    from infinity.store import TensorStore
    store = TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=host_bytes, nvme_path=str(tmp_path)),
                        IOConfig(block_bytes=16384, queue_depth=4, threads=2))
    jobs = []
    for i in range(n):
        for name in ("master", "exp_avg", "exp_avg_sq", "grad"):
            store.wait(store.register(f"u{i}.{name}", torch.full((numel,), 0.5), home="nvme"))
        jobs.append(ShardJob(f"u{i}", f"u{i}.master", f"u{i}.exp_avg", f"u{i}.exp_avg_sq", f"u{i}.grad",
                             None, [(0, 0, numel)]))
    store.wait(store.register("extra", (numel,), dtype=torch.float32, home="nvme"))
    return store, jobs


HYPER = dict(step=1, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_a_caller_beside_the_running_update_never_waits_for_its_room(tmp_path):
    """The update's copies live in the room it set aside when it started: a store operation beside it
    (a fold, a gather) fits in the rest of the tier at once, while the update is stopped mid-job with its
    states pinned, and waits for nothing; the room goes back to the tier when the step ends."""
    from infinity.optim.cpu_adam import CpuAdamW
    from infinity.optim.pipeline import AdamPipeline
    from infinity.store import Tier
    # one job pins its four 16 KiB states: 64 KiB; the extra 16 KiB key is what runs beside it
    store, jobs = _pipeline_store(tmp_path, host_bytes=80 * 1024)
    pipe = AdamPipeline(store, CpuAdamW(threads=1), lookahead=1, job_bytes=64 * 1024, leave_bytes=16 * 1024)
    reached, gate = threading.Event(), threading.Event()

    def hyper(gi):
        reached.set()            # the compute thread is mid-update: the job's states are pinned
        assert gate.wait(30), "the caller never let the update go on"
        return HYPER

    with store:
        pipe.start(hyper)
        try:
            assert pipe._room.size_bytes == 64 * 1024   # 80 KiB less the 16 KiB left beside it
            pipe.submit(jobs[0])
            assert reached.wait(30)
            before = store.thread_wait_s()
            store.wait(store.bring("extra", Tier.HOST, pin=True))
            assert store.thread_wait_s() - before < 0.1, "the caller waited for the update's room"
        finally:
            gate.set()
        stats = pipe.finish()
        assert stats["shards"] == 1 and store.stats()["set_aside_bytes"]["host"] == 0
        store.unpin("extra", Tier.HOST)


def test_abort_stops_the_threads_and_unpins(tmp_path):
    """close() while a step runs (a backward that raised): jobs not begun are dropped, nothing stays
    pinned, no thread is left; submit / finish without a running step are refused."""
    from infinity.optim.cpu_adam import CpuAdamW
    from infinity.optim.pipeline import AdamPipeline
    store, jobs = _pipeline_store(tmp_path, host_bytes=1 << 20, n=3)
    pipe = AdamPipeline(store, CpuAdamW(threads=1), lookahead=1)
    with store:
        pipe.start(lambda gi: HYPER)
        pipe.submit(jobs[0])
        with pytest.raises(RuntimeError, match="already running"):
            pipe.start(lambda gi: HYPER)
        pipe.close()
        assert not pipe.running
        assert [t.name for t in threading.enumerate() if t.name in _THREADS] == []
        for key in store.keys():
            store.release(key)   # refused for a pinned copy
        with pytest.raises(RuntimeError, match="no step is running"):
            pipe.submit(jobs[1])
        with pytest.raises(RuntimeError, match="no step is running"):
            pipe.finish()


def test_gradients_never_touch_the_disk_when_the_update_overlaps_backward(tmp_path):
    """Stage 3, fp32, everything on NVMe, a host budget that holds a step's gradients: a step writes
    exactly the master (= parameter) and both moments home, 12 B/element, with the update overlapped; the
    gradients (4 B/element more) are consumed from host memory and dropped unwritten. Without
    overlap they wait for the step and are written home at the fold."""
    from infinity.models import GPT, GPTConfig

    def step_writes(overlap: bool) -> tuple:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=32))
        cfg = {"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "params": "nvme", "grads": "nvme",
                                                 "host_resident_bytes": 0},
               "tiers": {"host_bytes": "64MiB", "device_bytes": "64MiB", "nvme_path": str(tmp_path / str(overlap))},
               "optimizer": {"threads": 1, "update_at": "auto" if overlap else "step"}, "prefetch": {"bytes": 0}}
        model, opt = infinity.initialize(model, cfg)
        engine = infinity.engine_of(model)
        try:
            numel = sum(u.shard_numel for u in engine.units)
            written = []
            for step in range(3):
                before = engine.store.stats()["moved_bytes"].get("host->nvme", 0)
                ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                written.append(engine.store.stats()["moved_bytes"].get("host->nvme", 0) - before)
            return written, numel
        finally:
            engine.close()

    written, numel = step_writes(True)
    assert written == [12 * numel] * 3, (written, numel)
    written, numel = step_writes(False)
    assert all(w >= 16 * numel for w in written), (written, numel)


def test_a_failed_update_while_the_swap_in_waits_for_room_ends_the_step(tmp_path):
    """The compute thread raises while the swap-in thread waits for look-ahead room that only the compute
    thread would free: the swap-in gives up too, and finish() raises the error instead of hanging."""
    from infinity.optim.cpu_adam import CpuAdamW
    from infinity.optim.pipeline import AdamPipeline
    store, jobs = _pipeline_store(tmp_path, host_bytes=72 * 1024, n=3)   # one job's states fit, not two
    pipe = AdamPipeline(store, CpuAdamW(threads=1), lookahead=2)
    started = threading.Event()

    def hyper(gi):
        started.set()
        _wait_until(lambda: pipe._issued == 1 and pipe._room_left < 64 * 1024)   # job 1 waits for room
        time.sleep(0.05)
        raise RuntimeError("injected failure in the update")

    errors = []

    def finish():
        try:
            pipe.finish()
        except RuntimeError as e:
            errors.append(str(e))

    with store:
        pipe.start(hyper)
        for job in jobs:
            pipe.submit(job)
        t = threading.Thread(target=finish, daemon=True)
        t.start()
        t.join(60)
        assert started.is_set()
        assert not t.is_alive(), "finish() hung: the swap-in thread kept waiting for room after the failure"
        assert errors == ["injected failure in the update"], errors
        assert [t.name for t in threading.enumerate() if t.name in _THREADS] == []
        assert store.stats()["set_aside_bytes"]["host"] == 0
