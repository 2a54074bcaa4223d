"""The pipelined offloaded Adam step against torch.optim.AdamW, on host and NVMe homes."""

import gc
import time
import weakref

import pytest
import torch

from fake_registrar import RecordingRegistrar
from infinity.config import IOConfig, TiersConfig
from infinity.optim.cpu_adam import CpuAdamW
from infinity.optim.pipeline import AdamPipeline
from infinity.optim.shard_job import ShardJob
from infinity.optim.split_master import round_bf16_
from infinity.store import BudgetError, TensorStore, Tier
from infinity.trace import Tracer

NUMEL = 4096 * 3   # 48 KiB fp32: a multiple of 4096 bytes in fp32 and bf16


def _store(tmp_path, host_bytes):
    return TensorStore(TiersConfig(device_bytes=1 << 20, host_bytes=host_bytes, nvme_path=str(tmp_path)),
                       IOConfig(block_bytes=16384, queue_depth=4, threads=2))


def _make(store, n, home, lowp, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(NUMEL, generator=g) for _ in range(n)]
    jobs = []
    for i, p in enumerate(params):
        store.wait(store.register(f"u{i}.master", p, home=home))
        store.wait(store.register(f"u{i}.exp_avg", (NUMEL,), dtype=torch.float32, home=home))
        store.wait(store.register(f"u{i}.exp_avg_sq", (NUMEL,), dtype=torch.float32, home=home))
        store.wait(store.register(f"u{i}.grad", (NUMEL,), dtype=torch.float32, home=home))
        if lowp:
            store.wait(store.register(f"u{i}.param", p.to(torch.bfloat16), home=home))
        half = NUMEL // 2   # two param groups inside one shard
        jobs.append(ShardJob(f"u{i}", f"u{i}.master", f"u{i}.exp_avg", f"u{i}.exp_avg_sq", f"u{i}.grad",
                             f"u{i}.param" if lowp else None, [(0, 0, half), (1, half, NUMEL)]))
    return params, jobs


def _set_grads(store, n, step):
    grads = []
    for i in range(n):
        gr = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + i))
        with store.use(f"u{i}.grad", Tier.HOST, dirty=True) as t:
            t.copy_(gr)
        store.wait(store.write_back(f"u{i}.grad"))
        grads.append(gr)
    return grads


HYPER = [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
         dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]


@pytest.mark.parametrize("home,lowp,host_kib", [("nvme", True, 400), ("nvme", False, 250), ("host", True, 4096)])
def test_matches_torch_adamw(tmp_path, home, lowp, host_kib):
    n, steps = 6, 3
    with _store(tmp_path, host_kib * 1024) as store:
        params, jobs = _make(store, n, home, lowp)
        half = NUMEL // 2
        # torch reference: one AdamW with two groups over the halves (as separate leaf tensors)
        leaves = [[p[:half].clone().requires_grad_(True), p[half:].clone().requires_grad_(True)] for p in params]
        opt = torch.optim.AdamW([{"params": [lv[0] for lv in leaves], **HYPER[0]},
                                 {"params": [lv[1] for lv in leaves], **HYPER[1]}], fused=True)
        pipe = AdamPipeline(store, CpuAdamW(threads=2, chunk_numel=4096), lookahead=2)
        for step in range(1, steps + 1):
            grads = _set_grads(store, n, step)
            for lv, gr in zip(leaves, grads):
                lv[0].grad, lv[1].grad = gr[:half].clone(), gr[half:].clone()
            opt.step()
            stats = pipe.run(jobs, lambda gi, step=step: dict(HYPER[gi], step=step))
            assert stats["shards"] == n
        for i, lv in enumerate(leaves):
            want = torch.cat([lv[0].detach(), lv[1].detach()])
            got = store.wait(store.bring(f"u{i}.master", Tier.HOST)).clone()
            assert torch.equal(got, want), f"shard {i} master differs"
            if lowp:
                assert torch.equal(store.wait(store.bring(f"u{i}.param", Tier.HOST)), as_bf16(want))
            for k, name in ((0, "exp_avg"), (1, "exp_avg_sq")):
                st = [opt.state[lv[0]][name], opt.state[lv[1]][name]]
                assert torch.equal(store.wait(store.bring(f"u{i}.{name}", Tier.HOST)), torch.cat(st))
        s = store.stats()
        assert s["peak_bytes"]["host"] <= host_kib * 1024
        if home == "nvme":
            shard_bytes = NUMEL * 4
            written = (3 * shard_bytes + (NUMEL * 2 if lowp else 0)) * n * steps
            # every step writes each changed state home exactly once, grads excluded (also the
            # test's own grad write-backs: n * steps * shard_bytes)
            assert s["moved_bytes"]["host->nvme"] >= written
            assert s["evictions"]["host"] > 0, "the host budget should have forced evictions"


def test_stress_many_small_shards_tiny_budget(tmp_path):
    """64 tiny shards, a host budget of ~3 shards' states, lookahead 3: contents verified."""
    n = 64
    global NUMEL
    saved, NUMEL = NUMEL, 1024
    try:
        with _store(tmp_path, 3 * 5 * 4096 + 8 * 4096) as store:
            params, jobs = _make(store, n, "nvme", False, seed=3)
            tracer = Tracer()
            tracer.record_step(1)
            pipe = AdamPipeline(store, CpuAdamW(threads=2, chunk_numel=256), lookahead=3, tracer=tracer)
            ref = [p.clone() for p in params]
            ms = [torch.zeros(NUMEL) for _ in range(n)]
            vs = [torch.zeros(NUMEL) for _ in range(n)]
            ref_adam = CpuAdamW(threads=1)
            for step in range(1, 4):
                tracer.begin_step()
                grads = _set_grads(store, n, step)
                for i in range(n):
                    half = NUMEL // 2
                    ref_adam.step_(ref[i][:half], grads[i][:half], ms[i][:half], vs[i][:half], step=step, **HYPER[0])
                    ref_adam.step_(ref[i][half:], grads[i][half:], ms[i][half:], vs[i][half:], step=step, **HYPER[1])
                pipe.run(jobs, lambda gi, step=step: dict(HYPER[gi], step=step))
                tracer.end_step()
            for i in range(n):
                assert torch.equal(store.wait(store.bring(f"u{i}.master", Tier.HOST)), ref[i]), f"shard {i}"
            lanes = {e["tid"] for e in tracer.events()}
            assert len(lanes) >= 3, "trace should show compute, swap-in and swap-out lanes"
    finally:
        NUMEL = saved


def test_budget_too_small_raises(tmp_path):
    with _store(tmp_path, 3 * NUMEL * 4 + 4096) as store:   # less than one shard's four fp32 tensors
        _, jobs = _make(store, 2, "nvme", False)
        pipe = AdamPipeline(store, CpuAdamW(threads=1), lookahead=1)
        with pytest.raises(Exception, match="host tier"):
            pipe.run(jobs, lambda gi: dict(HYPER[gi], step=1))


def test_error_mid_step_leaves_nothing_pinned(tmp_path):
    """An update that raises (here: shard 2 names a param group the hyper-parameters lack) fails the
    step; every key stays usable (nothing left pinned by the swap-in thread)."""
    with _store(tmp_path, 4096 * 1024) as store:
        _, jobs = _make(store, 4, "nvme", False)
        jobs[2].ranges = [(7, 0, NUMEL)]
        pipe = AdamPipeline(store, CpuAdamW(threads=1), lookahead=2)
        with pytest.raises(IndexError):
            pipe.run(jobs, lambda gi: dict(HYPER[gi], step=1))
        for key in store.keys():
            store.release(key)   # refused for a pinned copy
        assert store.keys() == []


def test_device_tensors_cross_through_the_copier(tmp_path):
    """Stored states with the gradient and the bf16 parameter in device memory (stage 1-2, optimizer
    offloaded): with CPU tensors routed as CUDA ones are, gradients are staged to host by the swap-in
    thread, parameters copied back off the compute thread, on_done sees each final parameter in order.
    Their host staging buffers are page-locked (recorded) at exactly their sizes, all given back to the
    staging pool after each step, bounded by the lookahead, reused rather than locked per shard, and
    unlocked when the pipeline closes."""
    n, steps = 5, 2
    with _store(tmp_path, 4096 * 1024) as store:
        params, jobs = _make(store, n, "nvme", False)
        grads_dev = [torch.zeros(NUMEL) for _ in range(n)]
        params_dev = [p.to(torch.bfloat16) for p in params]
        done = []
        for i, job in enumerate(jobs):
            job.grad, job.param_out = grads_dev[i], params_dev[i]
            job.on_done = lambda p, i=i: done.append((i, p.clone()))
        ref = [p.clone() for p in params]
        ms, vs = [torch.zeros(NUMEL) for _ in range(n)], [torch.zeros(NUMEL) for _ in range(n)]
        ref_adam = CpuAdamW(threads=1)
        reg = RecordingRegistrar()
        pipe = AdamPipeline(store, CpuAdamW(threads=1, chunk_numel=4096), lookahead=2, copy_cpu_tensors=True,
                            host_registrar=reg)
        locked_after = []
        half = NUMEL // 2
        for step in range(1, steps + 1):
            for i in range(n):
                grads_dev[i].copy_(torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * step + i)))
                for gi, (lo, hi) in enumerate(((0, half), (half, NUMEL))):
                    ref_adam.step_(ref[i][lo:hi], grads_dev[i][lo:hi].clone(), ms[i][lo:hi], vs[i][lo:hi],
                                   step=step, **HYPER[gi])
            done.clear()
            pipe.run(jobs, lambda gi, step=step: dict(HYPER[gi], step=step))
            assert [i for i, _ in done] == list(range(n))
            for i, p in done:
                assert torch.equal(p, as_bf16(ref[i])), f"step {step}: on_done saw a stale shard {i}"
            staging = pipe._staging.stats()
            assert staging["in_use_bytes"] == 0, f"step {step}: staging buffers were not given back"
            assert staging["pinned_bytes"] == reg.locked_bytes == pipe.last_stats["staging_pinned_bytes"] > 0
            locked_after.append((reg.locked_bytes, sum(c[0] == "register" for c in reg.calls)))
        assert pipe._copier is not None, "the device path was not taken"
        assert {c[2] for c in reg.calls if c[0] == "register"} <= {NUMEL * 4, NUMEL * 2}   # fp32 grad, bf16 param
        lookahead, shard_bytes = 2, NUMEL * 4 + NUMEL * 2
        assert max(b for b, _ in locked_after) <= (lookahead + 1) * shard_bytes < n * shard_bytes, locked_after
        assert locked_after[-1][1] < steps * n, f"staging buffers were locked per shard, not reused: {locked_after}"
        pipe.close()
        assert reg.locked_bytes == 0, "closing the pipeline left staging memory page-locked"
        for i in range(n):
            assert torch.equal(params_dev[i], as_bf16(ref[i]))
            assert torch.equal(store.wait(store.bring(f"u{i}.master", Tier.HOST)), ref[i])


def as_bf16(t: torch.Tensor) -> torch.Tensor:
    """A master rounded to bf16 the way every master format rounds it (ties away from zero)."""
    return round_bf16_(t.contiguous(), torch.empty(t.shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("param_home", ["nvme", "device"])
def test_a_split_master_job_is_bitwise_the_fp32_master_job(tmp_path, param_home):
    """A job whose master is the int16 remainder of its bf16 parameter (``master_is_remainder``) reads the
    parameter, stored (brought, not claimed) or in device memory (staged to host before the update): two
    steps give the fp32-master job's parameters, moments and, joined, its master bit for bit."""
    from infinity.optim.split_master import join_bf16_, split_bf16_

    n, steps = 3, 2
    with _store(tmp_path / "fp32", 4096 * 1024) as ref_store, _store(tmp_path / "split", 4096 * 1024) as store:
        params, ref_jobs = _make(ref_store, n, "nvme", True)
        jobs, dev = [], []
        for i, p in enumerate(params):
            bf16, remainder = torch.empty(NUMEL, dtype=torch.bfloat16), torch.empty(NUMEL, dtype=torch.int16)
            split_bf16_(p.clone(), bf16, remainder)
            store.wait(store.register(f"u{i}.master", remainder, home="nvme"))
            for name in ("exp_avg", "exp_avg_sq", "grad"):
                store.wait(store.register(f"u{i}.{name}", (NUMEL,), dtype=torch.float32, home="nvme"))
            if param_home == "nvme":
                store.wait(store.register(f"u{i}.param", bf16, home="nvme"))
            dev.append(bf16)
            jobs.append(ShardJob(f"u{i}", f"u{i}.master", f"u{i}.exp_avg", f"u{i}.exp_avg_sq", f"u{i}.grad",
                                 f"u{i}.param" if param_home == "nvme" else bf16,
                                 [(0, 0, NUMEL // 2), (1, NUMEL // 2, NUMEL)], master_is_remainder=True))
        # the fp32 reference's parameters start as the same rounding of the master
        for i, p in enumerate(params):
            with ref_store.use(f"u{i}.param", Tier.HOST, dirty=True) as t:
                t.copy_(dev[i])
        ref_pipe = AdamPipeline(ref_store, CpuAdamW(threads=2, chunk_numel=4096), lookahead=2)
        pipe = AdamPipeline(store, CpuAdamW(threads=2, chunk_numel=4096), lookahead=2,
                            copy_cpu_tensors=param_home == "device", host_registrar=RecordingRegistrar())
        for step in range(1, steps + 1):
            _set_grads(ref_store, n, step)
            _set_grads(store, n, step)
            if param_home == "nvme":   # only on disk: the update must read it, a claim would see stale bytes
                for i in range(n):
                    store.wait(store.evict(f"u{i}.param", Tier.HOST))
            for p_, j in ((ref_pipe, ref_jobs), (pipe, jobs)):
                p_.run(j, lambda gi, step=step: dict(HYPER[gi], step=step))
        for i in range(n):
            want_param = ref_store.wait(ref_store.bring(f"u{i}.param", Tier.HOST))
            got_param = store.wait(store.bring(f"u{i}.param", Tier.HOST)) if param_home == "nvme" else dev[i]
            assert torch.equal(got_param.view(torch.int16), want_param.view(torch.int16)), f"shard {i} parameter"
            master = join_bf16_(got_param.clone(), store.wait(store.bring(f"u{i}.master", Tier.HOST)).clone(),
                                torch.empty(NUMEL))
            assert torch.equal(master, ref_store.wait(ref_store.bring(f"u{i}.master", Tier.HOST))), f"shard {i} master"
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(store.wait(store.bring(f"u{i}.{name}", Tier.HOST)),
                                   ref_store.wait(ref_store.bring(f"u{i}.{name}", Tier.HOST)))
        ref_pipe.close()
        pipe.close()


JOB_BYTES = 4 * NUMEL * 4   # one shard's master, moments and gradient, fp32


def test_the_look_ahead_lives_in_a_room_set_aside_when_the_step_starts(tmp_path):
    """Another party pins host memory for the whole step: the pipeline's room is what the tier can free
    beside it (one job here), its jobs run one at a time inside it, and the result is bitwise the one with
    the tier to itself. While the step runs nobody else can take the room; when it ends, the room's bytes
    go back to the tier. A tier that cannot free one job is refused at start, naming the room."""
    results = {}
    for crowded in (False, True):
        budget = JOB_BYTES + NUMEL * 4 if crowded else 8 * JOB_BYTES
        with _store(tmp_path / str(crowded), budget) as store:
            _, jobs = _make(store, 3, "nvme", False)
            _set_grads(store, 3, 0)
            store.wait(store.register("x", (NUMEL,), dtype=torch.float32, home="nvme"))
            store.wait(store.bring("x", Tier.HOST, pin=True, owner="other"))
            pipe = AdamPipeline(store, CpuAdamW(threads=1), lookahead=2, job_bytes=JOB_BYTES)
            evicted = store.stats()["evictions"]["host"]
            pipe.run(jobs, lambda gi: dict(HYPER[gi], step=1))
            assert store.stats()["set_aside_bytes"]["host"] == 0
            if crowded:   # a room of one job beside the pin: each job's copies made way for the next one's
                assert store.stats()["evictions"]["host"] - evicted >= 2 * 4
            results[crowded] = [store.wait(store.bring(f"u{i}.master", Tier.HOST)).clone() for i in range(3)]
            store.unpin("x", Tier.HOST, "other")
            pipe.close()
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)
    with _store(tmp_path / "full", JOB_BYTES) as store:
        _, jobs = _make(store, 1, "nvme", False)
        store.wait(store.register("x", (NUMEL,), dtype=torch.float32, home="nvme"))
        store.wait(store.bring("x", Tier.HOST, pin=True, owner="other"))
        pipe = AdamPipeline(store, CpuAdamW(threads=1), lookahead=1, job_bytes=JOB_BYTES)
        with pytest.raises(BudgetError, match="look-ahead"):
            pipe.run(jobs, lambda gi: dict(HYPER[gi], step=1))
        assert not pipe.running and store.stats()["set_aside_bytes"]["host"] == 0
        store.unpin("x", Tier.HOST, "other")
        pipe.close()


def test_an_updated_job_holds_none_of_its_tensors_while_the_step_runs_on():
    """During an overlapped backward the caller takes the landed jobs only in finish(); meanwhile the
    store frees the buffers of what it dropped or discarded. So once a job is updated, nothing of the
    pipeline may keep its tensors alive (it did: every landed parameter waited in the caller's queue,
    1.5 GB of host copies outside every budget at GPT-2 2.7B). Jobs with no on_done hand the caller
    their name only; with one, the parameter it is given."""
    g = torch.Generator().manual_seed(0)
    given = []
    pipe = AdamPipeline(None, CpuAdamW(threads=1), lookahead=1)
    pipe.start(lambda gi: dict(HYPER[0], step=1))
    refs = []
    for i in range(3):
        tensors = [torch.randn(NUMEL, generator=g) for _ in range(4)] + [torch.zeros(NUMEL, dtype=torch.bfloat16)]
        on_done = given.append if i == 1 else None
        pipe.submit(ShardJob(f"u{i}", *tensors, [(0, 0, NUMEL)], on_done))
        refs.append([weakref.ref(t) for t in tensors])
        del tensors
    deadline = time.monotonic() + 30
    while len(pipe.updated) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipe.updated == ["u0", "u1", "u2"]
    # the compute thread lands the last job and waits for the next one: give it time, not a fixed sleep
    while any(r() is not None for r in refs[0] + refs[2]) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    # job 0 (no on_done) and job 2 (the last one, which the threads may not hold while they wait) are gone
    assert [r() is None for r in refs[0]] == [True] * 5
    assert [r() is None for r in refs[2]] == [True] * 5
    pipe.finish()
    assert len(given) == 1 and given[0] is refs[1][4]()   # job 1's on_done got its updated parameter
