"""The tiered tensor store: round trips, residency rules, budgets, eviction, failures, threads."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import random
import tempfile
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_registrar import RecordingRegistrar
from infinity.config import IOConfig, TiersConfig
from infinity.io import ChecksumError, ExtentFile, SwapIOError
from infinity.store import (BudgetError, Candidate, HostBufferPool, IllegalTransition, LRUPolicy, Residency,
                            StoreError, TensorStore, Tier)
from infinity.store.residency import check_transition

KiB = 1024
R = Residency


def make(tmp_path, device_bytes=1 << 20, host_bytes=1 << 20, **kw) -> TensorStore:
    return TensorStore(TiersConfig(device_bytes=device_bytes, host_bytes=host_bytes), IOConfig(),
                       swap_dir=str(tmp_path), **kw)


@pytest.fixture
def store(tmp_path):
    s = make(tmp_path)
    yield s
    s.close()


def sample(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-128, 127, shape, generator=g).to(dtype)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8)
                       if b.numel() else b)


# ---------------------------------------------------------------- round trips

SHAPES = [(0,), (0, 3), (), (1,), (7,), (1025,), (33, 65), (4096,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_nvme_host_device_and_back(store, dtype):
    originals = {f"k{i}": sample(shape, dtype, seed=i) for i, shape in enumerate(SHAPES)}
    for key, x in originals.items():
        store.register(key, x.clone()).result()
    for key, x in originals.items():
        store.evict(key, Tier.HOST).result()          # clean staging copy: dropped, no I/O
        assert store.residency(key) == {Tier.DEVICE: R.ABSENT, Tier.HOST: R.ABSENT, Tier.NVME: R.RESIDENT}
        host = store.bring(key, Tier.HOST).result()
        assert_bitwise_equal(host, x)
        dev = store.bring(key, Tier.DEVICE).result()
        assert_bitwise_equal(dev, x)
        assert dev.data_ptr() != host.data_ptr() or x.numel() == 0
        dev.copy_(dev * 2 if dtype.is_floating_point else dev // 2)
        store.mark_dirty(key, Tier.DEVICE)
        assert store.is_dirty(key)
        with pytest.raises(StoreError, match="stale"):
            store.get(key, Tier.HOST)                   # host no longer holds the newest bytes
        store.write_back(key).result()
        assert not store.is_dirty(key)
        assert_bitwise_equal(store.get(key, Tier.HOST), dev)   # refreshed on the way home
        expected = dev.clone()
        store.evict(key, Tier.DEVICE).result()
        store.evict(key, Tier.HOST).result()
        assert_bitwise_equal(store.bring(key, Tier.HOST).result(), expected)   # re-read from the file
        store.release(key)
        assert key not in store
        store.register(key, expected).result()          # the same key can come back after release
        store.evict(key, Tier.HOST).result()
        assert_bitwise_equal(store.bring(key, Tier.DEVICE).result(), expected)
    assert store.stats()["io"]["failed"] == 0


@pytest.mark.parametrize("home", [Tier.HOST, Tier.DEVICE])
def test_memory_homes(store, home):
    x = sample((129,), torch.float32)
    store.register("w", x, home=home).result()
    assert store.residency("w")[home] is R.RESIDENT and store.residency("w")[Tier.NVME] is R.ABSENT
    with pytest.raises(StoreError, match="slower than the home tier"):
        store.bring("w", Tier.NVME)
    if home is Tier.HOST:
        dev = store.bring("w", Tier.DEVICE).result()
        dev.add_(1)
        store.mark_dirty("w", Tier.DEVICE)
        store.evict("w", Tier.DEVICE).result()          # only newest copy: written home first
        assert_bitwise_equal(store.get("w", Tier.HOST), x + 1)
    store.register("z", (3, 5), torch.bfloat16, home=home).result()
    assert torch.equal(store.get("z", home), torch.zeros(3, 5, dtype=torch.bfloat16))
    assert store.stats()["io"] is None                  # no key on NVMe: no swap file was made


def test_register_copies_the_callers_tensor(store):
    x = torch.ones(100)
    fut = store.register("a", x)
    x.zero_()                                            # allowed at once: the store took a copy
    fut.result()
    store.evict("a", Tier.HOST).result()
    assert torch.equal(store.bring("a", Tier.HOST).result(), torch.ones(100))



@pytest.mark.parametrize("home", [Tier.HOST, Tier.NVME])
def test_register_copy_async_lands_before_the_future(store, home):
    """copy_async: the copy runs on the store's copy thread; the future (and any bring) waits for it."""
    xs = [torch.randn(4096 + i) for i in range(8)]
    futs = [store.register(f"g{i}", x, home=home, copy_async=True) for i, x in enumerate(xs)]
    got = [store.wait(store.bring(f"g{i}", Tier.HOST)).clone() for i in range(8)]   # may overtake the futures
    for f in futs:
        f.result()
    for i, x in enumerate(xs):
        assert torch.equal(got[i], x)
        if home is Tier.NVME:
            store.evict(f"g{i}", Tier.HOST).result()   # re-read from the file
        assert torch.equal(store.wait(store.bring(f"g{i}", Tier.HOST)), x)


# ---------------------------------------------------------------- residency rules

def test_transition_table_rejects_undefined_moves():
    check_transition("k", Tier.HOST, R.ABSENT, R.FILLING, "bring")
    for old, new in [(R.ABSENT, R.DRAINING), (R.FILLING, R.DRAINING), (R.DRAINING, R.ABSENT),
                     (R.DRAINING, R.FILLING), (R.ABSENT, R.ABSENT)]:
        with pytest.raises(IllegalTransition) as e:
            check_transition("layer3.w", Tier.DEVICE, old, new, "evict")
        assert "layer3.w" in str(e.value) and old.name in str(e.value) and "evict" in str(e.value)


def test_misuse_is_refused_naming_key_state_and_op(store):
    store.register("a", torch.arange(10.0)).result()
    cases = [
        (lambda: store.evict("a", Tier.NVME), "evict refused for the nvme copy, which is RESIDENT.*home copy"),
        (lambda: store.get("a", Tier.DEVICE), "get refused for the device copy, which is ABSENT"),
        (lambda: store.get("a", Tier.NVME), "file extent"),
        (lambda: store.mark_dirty("a", Tier.DEVICE), "mark_dirty refused for the device copy, which is ABSENT"),
        (lambda: store.unpin("a", Tier.HOST), "unpin refused .* not pinned"),
        (lambda: store.register("a", torch.zeros(1)), "already registered"),
        (lambda: store.bring("nope", Tier.HOST), "unknown key 'nope'"),
        (lambda: store.bring("a", "gpu"), "unknown tier 'gpu'"),
        (lambda: store.register("b", (4,)), "needs a dtype"),
    ]
    for call, pattern in cases:
        with pytest.raises(StoreError, match=pattern):
            call()
    store.bring("a", Tier.DEVICE).result()
    store.mark_dirty("a", Tier.DEVICE)
    with pytest.raises(StoreError, match="mark_dirty refused for the host copy, which is RESIDENT, stale"):
        store.mark_dirty("a", Tier.HOST)               # would fork the history
    with store.use("a", Tier.DEVICE):
        with pytest.raises(StoreError, match="evict refused .* pinned"):
            store.evict("a", Tier.DEVICE)
        with pytest.raises(StoreError, match="release refused .* pinned"):
            store.release("a")
    store.release("a")
    with pytest.raises(StoreError, match="unknown key 'a'"):
        store.get("a", Tier.HOST)


class Gated:
    """Wraps ExtentFile.write (or read) so each call waits for ``gate`` before reaching the disk."""

    def __init__(self, monkeypatch, method: str = "write"):
        self.gate = threading.Event()
        self.started = threading.Event()
        real = getattr(ExtentFile, method)
        gate, started = self.gate, self.started

        def gated(self_file, key, tensor):
            out: cf.Future = cf.Future()

            def later():
                started.set()
                gate.wait(10)
                real(self_file, key, tensor).add_done_callback(
                    lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(None))
            threading.Thread(target=later, daemon=True).start()
            return out
        monkeypatch.setattr(ExtentFile, method, gated)


def test_discard_drops_newest_host_copy_unwritten_and_reverts_to_home(store):
    """A claimed, changed host copy discarded: nothing is written, the key reads its home bytes again,
    and its host room is free; the home copy and a pinned copy are refused."""
    old, new = sample((1024,), torch.float32, 1), sample((1024,), torch.float32, 2)
    store.wait(store.register("g", old, home=Tier.NVME))
    store.wait(store.evict("g", Tier.HOST))
    written = store.stats()["moved_bytes"].get("host->nvme", 0)
    t = store.wait(store.claim("g", Tier.HOST, pin=True))
    t.copy_(new)
    store.mark_dirty("g", Tier.HOST)
    assert store.is_dirty("g")
    with pytest.raises(StoreError, match="pinned"):
        store.discard("g", Tier.HOST)
    store.unpin("g", Tier.HOST)
    with pytest.raises(StoreError, match="home copy"):
        store.discard("g", Tier.NVME)
    store.discard("g", Tier.HOST)
    assert not store.is_dirty("g") and store.residency("g")[Tier.HOST] is Residency.ABSENT
    assert store.stats()["tier_bytes"]["host"] == 0
    assert store.stats()["moved_bytes"].get("host->nvme", 0) == written, "a discarded copy was written"
    assert_bitwise_equal(store.wait(store.bring("g", Tier.HOST)), old)
    store.discard("g", Tier.DEVICE)   # an absent copy: nothing to do


def test_hand_over_gives_a_working_copy_to_another_key_without_moving_bytes(store):
    """A brought, pinned host copy of ``a`` becomes ``b``'s newest copy: the same tensor, its pin and its
    room; ``a`` reads its home bytes again and was never changed; ``b`` is dirty, and once changed and
    written back reads the new bytes. Refused: a copy whose bytes exist nowhere else, a pinned target,
    another shape, a home copy."""
    old, spare = sample((1024,), torch.float32, 1), sample((1024,), torch.float32, 2)
    store.wait(store.register("a", old, home=Tier.NVME))
    store.wait(store.register("b", spare, home=Tier.NVME))
    store.wait(store.register("c", (512,), dtype=torch.float32, home=Tier.NVME))
    for k in ("a", "b", "c"):
        store.wait(store.evict(k, Tier.HOST))
    host_bytes, moved = store.stats()["tier_bytes"]["host"], dict(store.stats()["moved_bytes"])
    t = store.wait(store.bring("a", Tier.HOST, pin=True))
    with pytest.raises(StoreError, match="another shape|is not"):
        store.hand_over("a", "c", Tier.HOST)
    with pytest.raises(StoreError, match="current working copy"):
        store.hand_over("a", "b", Tier.NVME)
    got = store.hand_over("a", "b", Tier.HOST)
    assert got is t and store.stats()["tier_bytes"]["host"] == host_bytes + 4096
    assert store.residency("a")[Tier.HOST] is Residency.ABSENT and not store.is_dirty("a")
    assert store.is_dirty("b")
    got.mul_(2)
    store.mark_dirty("b", Tier.HOST)
    store.unpin("b", Tier.HOST)   # the pin came with the copy
    store.wait(store.evict("b", Tier.HOST))
    assert store.stats()["moved_bytes"]["nvme->host"] == moved.get("nvme->host", 0) + 4096   # a's one read
    assert_bitwise_equal(store.wait(store.bring("a", Tier.HOST)), old)
    assert_bitwise_equal(store.wait(store.bring("b", Tier.HOST)), old * 2)
    # a dirty copy (its bytes nowhere else) cannot leave its key; nor can a copy go to a pinned one
    store.wait(store.claim("c", Tier.HOST))
    t = store.wait(store.bring("a", Tier.HOST))
    store.mark_dirty("a", Tier.HOST)
    with pytest.raises(StoreError, match="bytes are also held elsewhere"):
        store.hand_over("a", "b", Tier.HOST)
    store.wait(store.write_back("a"))
    store.pin("b", Tier.HOST)
    with pytest.raises(StoreError, match="pinned"):
        store.hand_over("a", "b", Tier.HOST)


def test_copy_in_motion_is_never_handed_out(store, monkeypatch):
    x = torch.arange(1000.0)
    store.register("a", x).result()
    dev = store.bring("a", Tier.DEVICE).result()
    dev.neg_()
    store.mark_dirty("a", Tier.DEVICE)
    gated = Gated(monkeypatch)
    fut = store.write_back("a")
    assert gated.started.wait(10)
    assert store.residency("a") == {Tier.DEVICE: R.RESIDENT, Tier.HOST: R.DRAINING, Tier.NVME: R.FILLING}
    with pytest.raises(StoreError, match="get refused for the host copy, which is DRAINING.*in motion"):
        store.get("a", Tier.HOST)
    assert store.write_back("a") is fut                  # the same operation, shared
    assert store.get("a", Tier.DEVICE) is dev            # at rest and current: fine
    gated.gate.set()
    fut.result(timeout=10)
    assert not store.is_dirty("a")
    assert_bitwise_equal(store.get("a", Tier.HOST), -x)


def test_mark_dirty_during_write_back_keeps_key_dirty(store, monkeypatch):
    store.register("a", torch.zeros(64)).result()
    gated = Gated(monkeypatch)
    host = store.get("a", Tier.HOST)
    host.fill_(1)
    store.mark_dirty("a", Tier.HOST)
    fut = store.write_back("a")
    assert gated.started.wait(10)
    host.fill_(2)                                        # a writer racing the write-back...
    store.mark_dirty("a", Tier.HOST)                     # ...says so: the transfer carries the old version
    gated.gate.set()
    fut.result(timeout=10)
    assert store.is_dirty("a")
    store.write_back("a").result(timeout=10)
    store.evict("a", Tier.HOST).result()
    assert torch.equal(store.bring("a", Tier.HOST).result(), torch.full((64,), 2.0))


def test_same_bring_in_flight_is_shared_and_pins_each_caller(store, monkeypatch):
    store.register("a", torch.arange(50.0)).result()
    store.evict("a", Tier.HOST).result()
    gated = Gated(monkeypatch, "read")
    first = store.bring("a", Tier.DEVICE, pin=True)
    assert gated.started.wait(10)
    assert store.residency("a")[Tier.HOST] is R.FILLING and store.residency("a")[Tier.DEVICE] is R.FILLING
    assert store.bring("a", Tier.DEVICE, pin=True) is first
    gated.gate.set()
    assert torch.equal(first.result(timeout=10), torch.arange(50.0))
    with pytest.raises(StoreError, match="pinned x2"):
        store.evict("a", Tier.DEVICE)
    store.unpin("a", Tier.DEVICE)
    store.unpin("a", Tier.DEVICE)
    store.evict("a", Tier.DEVICE).result()
    assert store.stats()["moved_bytes"]["nvme->host"] == 200      # one read served both callers


def test_a_pin_belongs_to_its_owner_token_not_to_a_thread(store):
    """Pinned under an owner token on one thread, unpinned with it from another (as a gather pinned in a
    backward hook on autograd's device thread is released from the caller's); a wrong token is refused;
    a refresh the pin's owner itself would wait on is an error, another owner's waits."""
    store.register("a", torch.arange(8.0), home=Tier.HOST).result()
    with cf.ThreadPoolExecutor(1) as other:
        other.submit(lambda: store.bring("a", Tier.DEVICE, pin=True, owner=("gather", 3)).result()).result()
        with pytest.raises(StoreError, match=r"owner \('gather', 4\) holds no pin"):
            store.unpin("a", Tier.DEVICE, owner=("gather", 4))
        store.get("a", Tier.HOST).fill_(1)   # the pinned device copy is stale now
        store.mark_dirty("a", Tier.HOST)
        with pytest.raises(StoreError, match=r"owner \('gather', 3\) has it pinned"):
            other.submit(lambda: store.bring("a", Tier.DEVICE, owner=("gather", 3))).result()
        waiting = other.submit(lambda: store.bring("a", Tier.DEVICE, owner=("gather", 5)).result(timeout=10))
        with pytest.raises(cf.TimeoutError):
            waiting.result(timeout=0.2)   # another owner's refresh waits for the pin to go
        store.unpin("a", Tier.DEVICE, owner=("gather", 3))   # this thread never pinned it
        assert torch.equal(waiting.result(timeout=10), torch.ones(8))
    assert store.residency("a")[Tier.DEVICE] is R.RESIDENT
    store.evict("a", Tier.DEVICE).result()   # no pin left behind


def test_evict_of_copy_marked_dirty_while_draining_keeps_it(store, monkeypatch):
    store.register("a", torch.zeros(10)).result()
    store.bring("a", Tier.DEVICE).result().fill_(1)
    store.mark_dirty("a", Tier.DEVICE)
    gated = Gated(monkeypatch)
    fut = store.evict("a", Tier.DEVICE)
    assert gated.started.wait(10)
    assert store.residency("a")[Tier.DEVICE] is R.DRAINING   # stays so until home has the bytes
    with pytest.raises(StoreError, match="pin refused .* DRAINING"):
        store.pin("a", Tier.DEVICE)
    store.mark_dirty("a", Tier.DEVICE)                   # a racing writer got there first
    gated.gate.set()
    with pytest.raises(StoreError, match="marked dirty while being written back; it was kept"):
        fut.result(timeout=10)
    assert store.residency("a")[Tier.DEVICE] is R.RESIDENT and store.is_dirty("a")


def test_refreshing_a_stale_copy_waits_for_its_other_reader(store):
    store.register("a", torch.zeros(10)).result()
    store.bring("a", Tier.DEVICE).result()
    holding, done = threading.Event(), threading.Event()

    def reader():
        with store.use("a", Tier.HOST) as h:             # an old snapshot, read by another thread
            holding.set()
            done.wait(10)
            assert torch.equal(h, torch.zeros(10))       # never overwritten under the reader

    with cf.ThreadPoolExecutor(1) as pool:
        r = pool.submit(reader)
        assert holding.wait(10)
        store.get("a", Tier.DEVICE).fill_(5)
        store.mark_dirty("a", Tier.DEVICE)
        with cf.ThreadPoolExecutor(1) as pool2:
            wb = pool2.submit(lambda: store.write_back("a").result(timeout=10))
            with pytest.raises(cf.TimeoutError):
                wb.result(timeout=0.2)                   # host is pinned by the reader: wait
            done.set()
            wb.result(timeout=10)
        r.result(timeout=10)
    assert torch.equal(store.get("a", Tier.HOST), torch.full((10,), 5.0)) and not store.is_dirty("a")
    with store.use("a", Tier.HOST):                      # this thread's own pin: waiting would deadlock
        store.get("a", Tier.DEVICE).fill_(6)
        store.mark_dirty("a", Tier.DEVICE)
        with pytest.raises(StoreError, match="this thread has it pinned"):
            store.write_back("a")


def test_release_waits_for_operation_in_flight_and_close_removes_swap_file(tmp_path, monkeypatch):
    s = make(tmp_path)
    s.register("a", torch.ones(10)).result()
    s.get("a", Tier.HOST).fill_(3)
    s.mark_dirty("a", Tier.HOST)
    gated = Gated(monkeypatch)
    fut = s.write_back("a")
    assert gated.started.wait(10)
    with cf.ThreadPoolExecutor(1) as pool:
        rel = pool.submit(s.release, "a")
        with pytest.raises(cf.TimeoutError):
            rel.result(timeout=0.2)
        gated.gate.set()
        rel.result(timeout=10)
    fut.result()
    assert "a" not in s and s.stats()["tier_bytes"] == {"device": 0, "host": 0, "nvme": 0}
    monkeypatch.undo()
    s.register("b", torch.ones(10)).result()
    assert os.listdir(tmp_path)                          # the private swap directory
    s.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(StoreError, match="closed"):
        s.bring("b", Tier.HOST)
    s.close()                                            # idempotent


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host buffers and side-stream copies")
def test_cuda_round_trip_pinned_and_side_stream(tmp_path):
    s = TensorStore(TiersConfig(device_bytes=64 * KiB, host_bytes=64 * KiB), IOConfig(), device="cuda",
                    swap_dir=str(tmp_path))
    try:
        x = sample((3001,), torch.bfloat16)
        s.register("a", x).result()
        assert s.get("a", Tier.HOST).is_pinned()
        s.evict("a", Tier.HOST).result()
        dev = s.bring("a", Tier.DEVICE).result()
        assert dev.is_cuda and torch.equal(dev.cpu(), x)
        dev.mul_(2)                                      # queued on the compute stream...
        s.mark_dirty("a", Tier.DEVICE)
        s.evict("a", Tier.DEVICE).result()               # ...which the side stream waits for
        s.evict("a", Tier.HOST).result()
        assert torch.equal(s.bring("a", Tier.HOST).result(), x * 2)
    finally:
        s.close()


# ---------------------------------------------------------------- budgets and eviction

def test_lru_policy_prefers_stale_then_oldest():
    c = [Candidate("a", Tier.HOST, 10, 5, False), Candidate("b", Tier.HOST, 10, 1, False),
         Candidate("c", Tier.HOST, 10, 9, True), Candidate("d", Tier.HOST, 10, 1, False)]
    assert [x.key for x in LRUPolicy().choose(c, 15)] == ["c", "b"]
    assert [x.key for x in LRUPolicy().choose(c, 35)] == ["c", "b", "d", "a"]


def test_device_oversubscribed_evicts_lru_and_keeps_contents(tmp_path):
    s = make(tmp_path, device_bytes=3 * 4 * KiB, host_bytes=4 * 4 * KiB)
    try:
        xs = {f"k{i}": sample((KiB,), torch.float32, seed=i) for i in range(6)}
        for k, x in xs.items():
            s.register(k, x).result()
        assert s.stats()["evictions"]["host"] == 2      # 6 staging copies through a 4-buffer host tier
        for _ in range(3):
            for k, x in xs.items():
                assert_bitwise_equal(s.bring(k, Tier.DEVICE).result(), x)
        st_ = s.stats()
        assert st_["peak_bytes"]["device"] <= 3 * 4 * KiB and st_["peak_bytes"]["host"] <= 4 * 4 * KiB
        assert st_["host_pool"]["peak_allocated_bytes"] <= 4 * 4 * KiB
        assert st_["evictions"]["device"] == 18 - 3      # cyclic walk through 3 slots: every miss evicts
        device_victims = [k for k, t in s.recent_evictions if t is Tier.DEVICE]
        assert device_victims[-3:] == ["k0", "k1", "k2"]   # the last round's misses pushed out the oldest
        assert st_["moved_bytes"]["host->device"] == 18 * 4 * KiB
    finally:
        s.close()


def test_pinned_and_dirty_copies_are_not_evicted(tmp_path):
    s = make(tmp_path, device_bytes=2 * 4 * KiB)
    try:
        for k in "abc":
            s.register(k, torch.full((KiB,), float(ord(k)))).result()
        with s.use("a", Tier.DEVICE, dirty=True) as a:
            a.add_(1)
            with s.use("b", Tier.DEVICE):
                with pytest.raises(BudgetError) as e:
                    s.bring("c", Tier.DEVICE)
        msg = str(e.value)
        assert "device tier" in msg and "budget 8192 bytes" in msg and "in use 8192" in msg
        assert "4096 bytes" in msg and "pinned" in msg
        assert s.is_dirty("a")
        s.bring("c", Tier.DEVICE).result()             # b is unpinned and clean now: it goes, not a
        assert s.residency("b")[Tier.DEVICE] is R.ABSENT and s.residency("a")[Tier.DEVICE] is R.RESIDENT
        with s.use("c", Tier.DEVICE, dirty=True) as c:
            c.zero_()
        # a and c both dirty, nothing clean to drop: the store writes the newest (c) home, then drops it
        s.bring("b", Tier.DEVICE).result()
        assert s.stats()["spills"]["device"] == 1
        assert s.residency("c")[Tier.DEVICE] is R.ABSENT and not s.is_dirty("c")
        assert s.is_dirty("a") and s.residency("a")[Tier.DEVICE] is R.RESIDENT
        s.write_back("a").result()
        s.evict("c", Tier.HOST).result()
        s.evict("a", Tier.DEVICE).result()
        s.evict("a", Tier.HOST).result()
        assert torch.equal(s.bring("a", Tier.HOST).result(), torch.full((KiB,), 98.0))
        assert torch.equal(s.bring("c", Tier.HOST).result(), torch.zeros(KiB))
    finally:
        s.close()


def test_a_room_is_set_aside_and_only_its_party_uses_it(tmp_path):
    """open_room sizes: ``want`` when there is that much, else what the tier can free less ``leave``, at
    least ``least`` (refused, naming the room, when the tier cannot give that beside the other rooms).
    What was free at open (less ``leave``) is set aside at once; the rest is taken as needed. Copies
    brought and pinned within the room are charged to it, up to its size; a shared copy pinned within it
    moves in; a copy whose last pin goes returns to the shared pool; scratch can be charged to it. Closed,
    its set-aside bytes return to the tier."""
    B = 4 * KiB
    s = make(tmp_path, host_bytes=8 * B)
    try:
        for k in "abcdefgh":
            s.register(k, torch.full((KiB,), float(ord(k)))).result()   # NVMe homes; host copies cached clean
        s.wait(s.bring("a", Tier.HOST, pin=True, owner="other"))
        for k in "gh":
            s.evict(k, Tier.HOST).result()
        big = s.open_room(Tier.HOST, "big", want=None, leave=3 * B)   # 7 B beside a's pin, 2 B free
        assert big.size_bytes == 4 * B and s.stats()["set_aside_bytes"]["host"] == 0   # the free 2 B left to others
        s.close_room(big)
        big = s.open_room(Tier.HOST, "big", want=None, leave=1 * B)
        assert big.size_bytes == 6 * B and s.stats()["set_aside_bytes"]["host"] == B   # free 2 B less 1 B left
        s.close_room(big)
        big = s.open_room(Tier.HOST, "big", want=4 * B)
        with pytest.raises(BudgetError, match="room 'more' needs at least"):
            s.open_room(Tier.HOST, "more", least=4 * B)                      # 3 B left beside the room and a
        s.close_room(big)
        assert s.stats()["set_aside_bytes"]["host"] == 0
        for k in "gh":
            s.wait(s.bring(k, Tier.HOST))
        room = s.open_room(Tier.HOST, "update", want=2 * B)
        assert room.size_bytes == 2 * B and s.stats()["set_aside_bytes"]["host"] == 0   # nothing free yet
        for k in "bc":
            s.evict(k, Tier.HOST).result()
        s.wait(s.bring("b", Tier.HOST, pin=True, owner="u", within=room))   # backed by the free bytes
        s.wait(s.bring("c", Tier.HOST, pin=True, owner="u", within=room))
        assert room.used_bytes == 2 * B and s.stats()["set_aside_bytes"]["host"] == 0
        with pytest.raises(BudgetError, match="room 'update' holds"):      # its size: nothing of its own to drop
            s.bring("d", Tier.HOST, pin=True, owner="u", within=room)
        s.unpin("b", Tier.HOST, "u")                                         # let go: b is the shared pool's
        assert room.used_bytes == B
        s.wait(s.bring("d", Tier.HOST, pin=True, owner="u", within=room))   # a shared copy pinned within moves in
        assert room.used_bytes == 2 * B and s.residency("d")[Tier.HOST] is R.RESIDENT
        s.evict("b", Tier.HOST).result()                                     # the shared pool's to drop
        with pytest.raises(BudgetError, match="room 'update'"):
            s.host_scratch(100, within=room)
        s.unpin("c", Tier.HOST, "u")
        buf = s.host_scratch(100, within=room)                               # c's bytes left the room: room for it
        assert room.used_bytes == 2 * B
        s.release_scratch(buf)
        assert room.used_bytes == B and s.stats()["set_aside_bytes"]["host"] == 0   # no floor: bytes go back
        s.close_room(room)
        assert s.stats()["set_aside_bytes"]["host"] == 0
        s.unpin("d", Tier.HOST, "u")
        s.unpin("a", Tier.HOST, "other")
        for k in "bcd":
            s.wait(s.bring(k, Tier.HOST))
        assert s.stats()["tier_bytes"]["host"] <= 8 * B
        for k in "abcdefgh":
            assert torch.equal(s.wait(s.bring(k, Tier.HOST)), torch.full((KiB,), float(ord(k))))
    finally:
        s.close()


def test_short_of_room_the_store_writes_home_the_newest_dirty_copies(tmp_path):
    """Host full of dirty copies: a bring writes home the most recently used unpinned ones (as many bytes
    as it needs), waits for them, then fits by dropping them; a pinned one is never written for room;
    nothing is lost."""
    s = make(tmp_path, host_bytes=4 * 4 * KiB)
    try:
        for k in "abcde":
            s.register(k, torch.full((KiB,), float(ord(k)))).result()
        for k in "abcd":   # fill the host tier with dirty copies; d is used last, a is pinned
            with s.use(k, Tier.HOST, dirty=True) as t:
                t.add_(1)
        s.pin("a", Tier.HOST)
        s.wait(s.bring("e", Tier.HOST))
        assert s.stats()["spills"] == {"device": 0, "host": 1}
        assert not s.is_dirty("d") and s.is_dirty("b") and s.is_dirty("c")   # the newest went, only as much as asked
        assert s.residency("d")[Tier.HOST] is R.ABSENT                 # the spilled copy gave its room
        with s.use("e", Tier.HOST, dirty=True) as t:
            t.add_(1)
        s.wait(s.bring("d", Tier.HOST))                                # e, then c: the most recent first
        assert not s.is_dirty("e") and s.is_dirty("b") and s.is_dirty("c") and s.is_dirty("a")
        s.pin("b", Tier.HOST)
        s.pin("c", Tier.HOST)
        s.pin("d", Tier.HOST)
        with pytest.raises(BudgetError, match="pinned"):               # only pinned copies left: refused
            s.bring("e", Tier.HOST)
        for k in "abcd":
            s.unpin(k, Tier.HOST)
        for k in "abcde":
            s.evict(k, Tier.HOST).result()
            want = float(ord(k) + 1)
            assert torch.equal(s.wait(s.bring(k, Tier.HOST)), torch.full((KiB,), want))
            s.evict(k, Tier.HOST).result()
    finally:
        s.close()

def test_budget_smaller_than_one_tensor_is_a_clear_error(tmp_path):
    s = make(tmp_path, device_bytes=1000, host_bytes=64 * KiB)
    try:
        s.register("big", torch.zeros(1000)).result()
        with pytest.raises(BudgetError) as e:
            s.bring("big", Tier.DEVICE)
        assert "device tier" in str(e.value) and "4000 bytes" in str(e.value) and "budget 1000" in str(e.value)
        assert "'big' alone is bigger than the whole tier" in str(e.value)
        assert s.residency("big")[Tier.DEVICE] is R.ABSENT and s.stats()["tier_bytes"]["device"] == 0
        with pytest.raises(BudgetError, match="host tier: cannot fit 131072 bytes"):
            s.register("huge", (32 * KiB,), torch.float32)
        assert "huge" not in s
    finally:
        s.close()


def test_bring_waits_for_an_eviction_in_flight(tmp_path, monkeypatch):
    s = make(tmp_path, device_bytes=4 * KiB)
    try:
        s.register("a", torch.ones(KiB)).result()
        s.register("b", torch.full((KiB,), 2.0)).result()
        s.bring("a", Tier.DEVICE).result()
        s.mark_dirty("a", Tier.DEVICE)
        gated = Gated(monkeypatch)
        evicting = s.evict("a", Tier.DEVICE)            # device -> host, then host -> nvme (gated)
        assert gated.started.wait(10)
        assert s.residency("a")[Tier.DEVICE] is R.DRAINING
        with cf.ThreadPoolExecutor(1) as pool:
            waiter = pool.submit(lambda: s.bring("b", Tier.DEVICE).result(timeout=10))
            with pytest.raises(cf.TimeoutError):
                waiter.result(timeout=0.2)              # no room until the eviction lands
            gated.gate.set()
            assert torch.equal(waiter.result(timeout=10), torch.full((KiB,), 2.0))
        evicting.result(timeout=10)
        assert s.residency("a")[Tier.DEVICE] is R.ABSENT and s.stats()["wait_s"] > 0
        s.evict("a", Tier.HOST).result()
        assert torch.equal(s.bring("a", Tier.HOST).result(), torch.ones(KiB))
    finally:
        s.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.sampled_from([0, 1, 700, 1024, 1500, 3000]), min_size=2, max_size=5),
       homes=st.lists(st.sampled_from(list(Tier)), min_size=5, max_size=5),
       ops=st.lists(st.tuples(st.sampled_from(["bring_d", "bring_h", "dirty", "evict_d", "evict_h", "write_back",
                                               "release"]), st.integers(0, 4)), max_size=30),
       device_kib=st.sampled_from([8, 12, 24]), host_kib=st.sampled_from([16, 24, 48]))
def test_budgets_never_exceeded_and_runs_deterministic(tmp_path, sizes, homes, ops, device_kib, host_kib):
    def run():
        with tempfile.TemporaryDirectory(dir=tmp_path) as d:
            s = TensorStore(TiersConfig(device_bytes=device_kib * KiB, host_bytes=host_kib * KiB), IOConfig(),
                            swap_dir=d)
            outcomes, versions = [], {}
            try:
                for i, n in enumerate(sizes):
                    try:
                        s.register(f"k{i}", torch.full((n,), float(i)), home=homes[i]).result()
                        versions[f"k{i}"] = float(i)
                    except BudgetError:
                        outcomes.append(("register", i, "budget"))
                for step, (op, i) in enumerate(ops):
                    key = f"k{i % len(sizes)}"
                    if key not in versions:
                        continue
                    home = s.home(key)
                    try:
                        if op in ("bring_d", "bring_h"):
                            tier = Tier.DEVICE if op == "bring_d" else Tier.HOST
                            if tier.rank <= home.rank:
                                s.bring(key, tier).result()
                        elif op == "dirty":
                            with s.use(key, Tier.DEVICE, dirty=True) as t:
                                t.fill_(float(100 + step))
                            versions[key] = float(100 + step)
                        elif op in ("evict_d", "evict_h"):
                            tier = Tier.DEVICE if op == "evict_d" else Tier.HOST
                            if tier is not home:
                                s.evict(key, tier).result()
                        elif op == "write_back":
                            s.write_back(key).result()
                        elif op == "release":
                            s.release(key)
                            del versions[key]
                        outcomes.append((op, key, "ok"))
                    except BudgetError:
                        outcomes.append((op, key, "budget"))
                    st_ = s.stats()
                    assert st_["tier_bytes"]["device"] <= device_kib * KiB
                    assert st_["tier_bytes"]["host"] <= host_kib * KiB
                final = {}
                # Memory homes first and released after the check, so NVMe-homed keys then fit in host.
                for key in sorted(versions, key=lambda k: (s.home(k).rank, k)):
                    s.write_back(key).result()
                    assert not s.is_dirty(key)
                    for t in (Tier.DEVICE, Tier.HOST):
                        if t is not s.home(key):
                            s.evict(key, t).result()
                    where = Tier.HOST if s.home(key) is Tier.NVME else s.home(key)
                    final[key] = s.wait(s.bring(key, where)).clone()
                    assert torch.equal(final[key], torch.full_like(final[key], versions[key]))
                    s.release(key)
                st_ = s.stats()
                assert st_["peak_bytes"]["device"] <= device_kib * KiB
                assert st_["peak_bytes"]["host"] <= host_kib * KiB
                assert st_["host_pool"]["peak_allocated_bytes"] <= host_kib * KiB
                return outcomes, list(s.recent_evictions), final, st_["moved_bytes"]
            finally:
                s.close()

    first, second = run(), run()
    assert first[0] == second[0] and first[1] == second[1] and first[3] == second[3]
    assert first[2].keys() == second[2].keys()
    assert all(torch.equal(first[2][k], second[2][k]) for k in first[2])


# ---------------------------------------------------------------- failures

def test_corrupt_swap_byte_is_a_checksum_error_naming_the_key(store):
    x = sample((3000,), torch.float16)
    store.register("layers.0.exp_avg", x).result()
    store.evict("layers.0.exp_avg", Tier.HOST).result()
    extents = store._extents
    offset = extents._table["layers.0.exp_avg"].offset
    fd = os.open(extents.path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset + 1234)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset + 1234)
    finally:
        os.close(fd)
    with pytest.raises(ChecksumError, match="layers.0.exp_avg") as e:
        store.bring("layers.0.exp_avg", Tier.DEVICE).result()
    assert any("layers.0.exp_avg" in n for n in getattr(e.value, "__notes__", []))
    assert store.residency("layers.0.exp_avg") == {Tier.DEVICE: R.ABSENT, Tier.HOST: R.ABSENT,
                                                   Tier.NVME: R.RESIDENT}
    assert store.stats()["tier_bytes"] == {"device": 0, "host": 0, "nvme": 6000}


def test_failed_write_back_leaves_key_dirty_and_data_safe(store):
    x = sample((5000,), torch.bfloat16)
    store.register("a", x).result()
    dev = store.bring("a", Tier.DEVICE).result()
    dev.mul_(3)
    store.mark_dirty("a", Tier.DEVICE)
    before = store.stats()["moved_bytes"].get("host->nvme", 0)
    store._engine.syscalls.inject("pwritev", errno.EIO)
    with pytest.raises(SwapIOError) as e:
        store.evict("a", Tier.DEVICE).result()
    assert e.value.errno == errno.EIO and any("evict of key 'a'" in n for n in e.value.__notes__)
    assert store.is_dirty("a")
    assert store.residency("a") == {Tier.DEVICE: R.RESIDENT, Tier.HOST: R.RESIDENT, Tier.NVME: R.RESIDENT}
    assert_bitwise_equal(store.get("a", Tier.DEVICE), x * 3)   # the newest bytes are still here
    assert_bitwise_equal(store.get("a", Tier.HOST), x * 3)     # the first hop landed and stays valid
    assert store.stats()["moved_bytes"].get("host->nvme", 0) == before
    store.evict("a", Tier.DEVICE).result()              # retry works
    store.evict("a", Tier.HOST).result()
    assert_bitwise_equal(store.bring("a", Tier.HOST).result(), x * 3)


def test_failed_read_and_failed_register_roll_back(store):
    store.register("a", torch.arange(100.0)).result()
    store.evict("a", Tier.HOST).result()
    store._engine.syscalls.inject("preadv", errno.EIO)
    with pytest.raises(SwapIOError, match="Input/output error"):
        store.bring("a", Tier.DEVICE).result()
    assert store.residency("a")[Tier.HOST] is R.ABSENT and store.stats()["tier_bytes"]["host"] == 0
    assert torch.equal(store.bring("a", Tier.DEVICE).result(), torch.arange(100.0))
    store._engine.syscalls.inject("pwritev", errno.ENOSPC)
    with pytest.raises(SwapIOError, match="No space left"):
        store.register("b", torch.ones(10)).result()
    assert "b" not in store
    assert store.stats()["tier_bytes"]["nvme"] == 400
    store.register("b", torch.ones(10)).result()        # nothing left behind: it registers cleanly


def test_no_swap_dir_is_a_clear_error():
    s = TensorStore(TiersConfig(device_bytes=KiB, host_bytes=4 * KiB), IOConfig())
    try:
        with pytest.raises(StoreError, match="no swap directory; set tiers.nvme_path"):
            s.register("a", torch.zeros(1))
        s.register("a", torch.zeros(1), home="host").result()
    finally:
        s.close()


# ---------------------------------------------------------------- threads

def test_concurrent_random_operations_keep_contents(tmp_path):
    torch.set_num_threads(1)
    s = make(tmp_path, device_bytes=10 * 4 * KiB, host_bytes=12 * 4 * KiB)
    n_threads, keys_per_thread, numel = 4, 4, KiB
    owners = {t: [f"t{t}k{j}" for j in range(keys_per_thread)] for t in range(n_threads)}
    all_keys = [k for ks in owners.values() for k in ks]
    latest = {k: 0.0 for k in all_keys}
    errors, refused = [], []

    def evict(key, tier) -> bool:
        try:
            s.wait(s.evict(key, tier))
            return True
        except StoreError as e:   # another thread is using that copy: a refusal, not a failure
            assert "pinned" in str(e), e
            refused.append(key)
            return False

    def worker(t: int):
        rng = random.Random(t)
        try:
            for step in range(60):
                key = rng.choice(all_keys)
                op = rng.choice(["bring", "bring", "use", "evict", "write_back", "write"])
                tier = rng.choice([Tier.DEVICE, Tier.HOST])
                if op == "write" and key in owners[t]:
                    value = float(t * 1000 + step + 1)
                    with s.use(key, tier, dirty=True) as x:
                        x.fill_(value)
                    latest[key] = value
                    # Always leave it clean, so dirty copies cannot pile up and fill a tier.
                    if rng.random() < 0.5 or not evict(key, tier):
                        s.wait(s.write_back(key))
                elif op == "use" or op == "write":
                    with s.use(key, tier) as x:
                        assert bool((x == x[0]).all()), f"torn copy of {key}"  # never half-written
                elif op == "bring":
                    s.wait(s.bring(key, tier))
                elif op == "evict":
                    evict(key, tier)
                else:
                    s.wait(s.write_back(key))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        for k in all_keys:
            s.register(k, torch.zeros(numel)).result()
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        assert all(not th.is_alive() for th in threads)
        for k in all_keys:
            s.write_back(k).result()
            s.evict(k, Tier.DEVICE).result()
            s.evict(k, Tier.HOST).result()
            assert torch.equal(s.bring(k, Tier.HOST).result(), torch.full((numel,), latest[k])), k
        st_ = s.stats()
        assert st_["peak_bytes"]["device"] <= 10 * 4 * KiB and st_["peak_bytes"]["host"] <= 12 * 4 * KiB
        assert st_["evictions"]["device"] + st_["evictions"]["host"] > 0
    finally:
        s.close()


# ---------------------------------------------------------------- host buffer pool

def test_host_pool_reuses_aligned_buffers_within_capacity():
    pool = HostBufferPool(4 * 4096)
    a = pool.acquire(100)
    assert a.numel() == 4096 and a.data_ptr() % 4096 == 0
    ptr = a.data_ptr()
    pool.release(a)
    b = pool.acquire(4000)
    assert b.data_ptr() == ptr and pool.stats()["hits"] == 1       # same rounded size: reused
    c = pool.acquire(3 * 4096)                                       # fills the capacity exactly
    with pytest.raises(StoreError, match="cannot hand out 4096 bytes: 16384 of 16384"):
        pool.acquire(1)
    pool.release(b)
    pool.release(c)
    d = pool.acquire(2 * 4096)                                       # new size: cached buffers trimmed
    st_ = pool.stats()
    assert st_["peak_allocated_bytes"] <= 4 * 4096 and st_["in_use_bytes"] == 2 * 4096
    assert st_["in_use_bytes"] + st_["cached_bytes"] <= 4 * 4096
    pool.release(d)
    assert pool.trim() == st_["cached_bytes"] + 2 * 4096 and pool.stats()["cached_bytes"] == 0


def test_host_pool_end_window_gives_back_what_the_step_no_longer_holds():
    """A pool that filled its budget once gives it back at the window's end: unpinned, every cached
    buffer; pinned (costly to make), down to the most the window had in use at once."""
    pool = HostBufferPool(8 * 4096)
    bufs = [pool.acquire(4096) for _ in range(6)]                    # a first step fills the budget
    for b in bufs:
        pool.release(b)
    assert pool.stats()["cached_bytes"] == 6 * 4096
    assert pool.end_window() == 6 * 4096 and pool.stats()["cached_bytes"] == 0
    held = pool.acquire(4096)                                        # in use across the window's end
    pool.release(pool.acquire(4096))
    assert pool.end_window() == 4096 and pool.stats()["in_use_bytes"] == 4096

    pinned = HostBufferPool(8 * 4096, registrar=RecordingRegistrar())   # page-locking recorded, not done
    two = [pinned.acquire(4096), pinned.acquire(2 * 4096)]           # 3 pages in use at once
    for b in two:
        pinned.release(b)
    pinned.release(pinned.acquire(3 * 4096))                         # 3 more: 6 pages allocated
    assert pinned.stats()["cached_bytes"] == 6 * 4096
    assert pinned.end_window() == 3 * 4096                           # oldest first, down to the 3 at once
    assert pinned.stats()["cached_bytes"] == 3 * 4096
    assert pinned.end_window() == 3 * 4096                           # a window that used nothing: all go
    pool.release(held)


def test_peak_bytes_per_window(tmp_path):
    """take_peak_bytes: each tier's most bytes since the last call (host, and a CPU device: the pool, cached
    buffers too); the next window starts from what is held then, whatever the all-time peak was."""
    s = make(tmp_path, device_bytes=8 * 4 * KiB, host_bytes=8 * 4 * KiB)
    try:
        for i in range(4):
            s.register(f"k{i}", sample((KiB,), torch.float32, seed=i), home=Tier.NVME).result()
        s.take_peak_bytes()
        for i in range(4):
            s.bring(f"k{i}", Tier.DEVICE).result()
        first = s.take_peak_bytes()
        assert first["device"] == 4 * 4 * KiB and 4 * 4 * KiB <= first["host"] <= 8 * 4 * KiB
        for i in range(4):
            s.evict(f"k{i}", Tier.DEVICE).result()
        s.take_peak_bytes()
        second = s.take_peak_bytes()   # nothing brought in this window: only what is still held
        # on a CPU device the evicted copies' buffers are cached for reuse until the step's trim
        assert second["device"] == 4 * 4 * KiB == s.device_pool.stats()["cached_bytes"]
        assert s.stats()["peak_bytes"]["device"] == 4 * 4 * KiB
        assert second["host"] == s.pool.stats()["in_use_bytes"] + s.pool.stats()["cached_bytes"]
        s.trim_host_buffers()
        s.take_peak_bytes()
        assert s.take_peak_bytes()["device"] == 0 == s.device_pool.stats()["cached_bytes"]
    finally:
        s.close()


# ---------------------------------------------------------------- claim (overwrite without reading)

def test_claim_reads_nothing_and_becomes_the_newest_version(store, monkeypatch):
    old = torch.arange(3000.0)
    store.register("p", old).result()
    store.evict("p", Tier.HOST).result()          # only the NVMe extent holds the key now
    moved_before = dict(store.stats()["moved_bytes"])

    def no_reads(*a, **kw):
        raise AssertionError("claim must not read the old contents")

    monkeypatch.setattr(store._extents, "read", no_reads)
    t = store.claim("p", Tier.HOST, pin=True).result(timeout=10)
    assert torch.count_nonzero(t) == 0           # lands zeroed, not with the old bytes
    assert store.is_dirty("p")                   # home is stale from the moment of the claim
    assert dict(store.stats()["moved_bytes"]) == moved_before
    t.copy_(-old)
    store.mark_dirty("p", Tier.HOST)
    store.unpin("p", Tier.HOST)
    store.write_back("p").result(timeout=10)
    monkeypatch.undo()
    store.evict("p", Tier.HOST).result(timeout=10)
    assert_bitwise_equal(store.bring("p", Tier.HOST).result(timeout=10), -old)


def test_claim_of_a_current_copy_returns_it(store):
    x = torch.arange(100.0)
    store.register("q", x, home=Tier.HOST).result()
    assert store.claim("q", Tier.HOST).result() is store.get("q", Tier.HOST)


def test_claim_refuses_nvme_and_slower_than_home(store):
    store.register("r", torch.zeros(10), home=Tier.HOST).result()
    with pytest.raises(StoreError, match="claim refused.*no slower than home"):
        store.claim("r", Tier.NVME)


def test_a_claim_from_a_source_tensor_holds_its_key_until_the_copy_lands(tmp_path):
    """claim(src=...) copies on the copier's lane, off the caller's thread: it returns before the bytes
    land, every other operation on the key waits for them, and a source of another shape is refused."""
    from gated_copier import GatedCopier

    copier = GatedCopier(open_gate=False)
    s = make(tmp_path, copier=copier)
    try:
        s.register("g", (8,), dtype=torch.float32).result()
        with pytest.raises(StoreError, match=r"src is \(4,\) torch.float32, the key \(8,\)"):
            s.claim("g", Tier.HOST, src=torch.ones(4))
        claimed = s.claim("g", Tier.HOST, src=torch.arange(8.0))
        assert not claimed.done()
        with cf.ThreadPoolExecutor(1) as pool:
            reader = pool.submit(lambda: s.bring("g", Tier.HOST).result(timeout=10).clone())
            with pytest.raises(cf.TimeoutError):
                reader.result(timeout=0.2)   # the key is busy until the claimed bytes have landed
            copier.gate.set()
            assert torch.equal(reader.result(timeout=10), torch.arange(8.0))
        assert torch.equal(claimed.result(timeout=10), torch.arange(8.0)) and s.is_dirty("g")
        # with write_home the same operation writes the bytes home: the key ends clean, its copy evictable
        s.claim("g", Tier.HOST, src=torch.full((8,), 2.0), write_home=True).result(timeout=10)
        assert not s.is_dirty("g")
        s.evict("g", Tier.HOST).result(timeout=10)
        assert torch.equal(s.bring("g", Tier.HOST).result(timeout=10), torch.full((8,), 2.0))   # from disk
        with pytest.raises(StoreError, match="write_home needs src"):
            s.claim("g", Tier.HOST, write_home=True)
    finally:
        s.close()
        copier.close()


def test_host_scratch_is_counted_in_the_host_budget_and_made_room_for(tmp_path):
    """A scratch buffer reserves host-tier bytes like a key's copy: a clean cached copy is evicted for
    it, pinned copies are not (BudgetError), and giving it back frees the bytes."""
    s = make(tmp_path, host_bytes=8 * KiB)
    try:
        s.register("a", torch.zeros(1024)).result()   # NVMe home, 4 KiB host copy cached (clean)
        s.register("b", torch.zeros(1024)).result()
        buf = s.host_scratch(4 * KiB)
        st_ = s.stats()
        assert st_["scratch_bytes"] == 4 * KiB and st_["tier_bytes"]["host"] == 8 * KiB
        assert st_["evictions"]["host"] == 1
        with s.use("b", Tier.HOST):
            with pytest.raises(BudgetError, match="host tier"):
                s.host_scratch(4 * KiB)
        s.release_scratch(buf)
        assert s.stats()["scratch_bytes"] == 0 and s.stats()["scratch_peak_bytes"] == 4 * KiB
    finally:
        s.close()


def test_a_cpu_device_tiers_working_copies_reuse_their_buffers_and_a_device_home_does_not(tmp_path):
    """On a CPU device an evicted working copy's buffer goes back to the device pool and the next
    copy of that size gets it (no new pages); the data is each key's own; a key homed on the device
    is allocated plainly (callers may keep views of a home copy)."""
    s = make(tmp_path, device_bytes=8 * 4 * KiB, host_bytes=8 * 4 * KiB)
    try:
        values = [sample((KiB,), torch.float32, seed=i) for i in range(3)]
        for i, v in enumerate(values):
            s.register(f"k{i}", v, home=Tier.NVME).result()
        addresses = []
        for i, v in enumerate(values):
            s.bring(f"k{i}", Tier.DEVICE).result()
            assert torch.equal(s.get(f"k{i}", Tier.DEVICE), v)
            addresses.append(s.get(f"k{i}", Tier.DEVICE).data_ptr())
            s.evict(f"k{i}", Tier.DEVICE).result()
        pool = s.device_pool.stats()
        assert pool["misses"] == 1 and pool["hits"] == 2 and len(set(addresses)) == 1
        s.register("home", sample((KiB,), torch.float32, seed=9), home=Tier.DEVICE).result()
        assert s.device_pool.stats()["in_use_bytes"] == 0
        assert s.get("home", Tier.DEVICE).data_ptr() not in addresses
    finally:
        s.close()
