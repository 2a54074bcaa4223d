"""The device copier's lanes: one per direction, FIFO within a lane, bounded, and independent of each
other, so a copy to the device never waits behind copies to the host. On CPU the copies are plain
memory copies on the lanes' threads; a gate stands in for the CUDA event a copy must follow."""

from __future__ import annotations

import threading

import pytest
import torch

from infinity.store.device_copy import DeviceCopier

WAIT_S = 30   # generous: only a hang reaches it


class Gate:
    """A stand-in for the event a copy must follow: ``synchronize()`` blocks until ``open()``."""

    def __init__(self):
        self._event = threading.Event()

    def open(self):
        self._event.set()

    def synchronize(self):
        assert self._event.wait(WAIT_S), "gate never opened"


@pytest.fixture
def copier():
    c = DeviceCopier(torch.device("cpu"), max_pending=3)
    yield c
    c.close()


def test_copies_in_a_lane_land_in_the_order_they_were_asked_for(copier):
    landed, futures = [], []
    src = [torch.full((1000,), float(i)) for i in range(20)]
    dst = [torch.empty(1000) for _ in range(20)]
    for i in range(20):
        f = copier.to_host(dst[i], src[i])
        f.add_done_callback(lambda _f, i=i: landed.append(i))
        futures.append(f)
    for f in futures:
        f.result(WAIT_S)
    assert landed == list(range(20))
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


def test_a_full_lane_blocks_its_caller_until_a_copy_lands(copier):
    gate = Gate()
    src, dst = torch.arange(8.0), [torch.empty(8) for _ in range(4)]
    first = copier.to_host(dst[0], src, after=gate)
    rest = [copier.to_host(dst[i], src) for i in (1, 2)]        # 3 pending: the lane is full
    assert copier._to_host.pending() == 3
    fourth = {}
    caller = threading.Thread(target=lambda: fourth.setdefault("f", copier.to_host(dst[3], src)))
    caller.start()
    caller.join(0.5)
    assert caller.is_alive() and "f" not in fourth, "a fourth copy was queued past the bound of 3"
    gate.open()
    caller.join(WAIT_S)
    assert not caller.is_alive()
    for f in [first, *rest, fourth["f"]]:
        f.result(WAIT_S)
    assert all(torch.equal(d, src) for d in dst)
    assert copier.stats()["peak_pending"]["to_host"] == 3


def test_copies_to_the_device_do_not_wait_behind_copies_to_the_host(copier):
    gate = Gate()
    held = copier.to_host(torch.empty(4), torch.ones(4), after=gate)
    param = torch.empty(4)
    copier.to_device(param, torch.full((4,), 7.0)).result(WAIT_S)   # lands while the to-host lane is stuck
    assert torch.equal(param, torch.full((4,), 7.0)) and not held.done()
    gate.open()
    held.result(WAIT_S)


def test_a_copier_thread_queueing_the_next_copy_never_blocks_on_a_full_lane():
    """A transfer's next hop is started from the previous hop's completion, on a copier thread: it must
    be queued at once even past the bound, or the lane that would drain it could be the one waiting."""
    c = DeviceCopier(torch.device("cpu"), max_pending=1)
    try:
        gate = Gate()
        stuck = c.to_device(torch.empty(2), torch.ones(2), after=gate)   # the to-device lane is full
        queued = threading.Event()
        nxt = {}

        def next_hop(_f):
            nxt["f"] = c.to_device(torch.empty(2), torch.ones(2))
            queued.set()
        c.to_host(torch.empty(2), torch.ones(2)).add_done_callback(next_hop)
        assert queued.wait(WAIT_S), "the copier thread blocked on the full lane"
        assert not stuck.done()
        gate.open()
        nxt["f"].result(WAIT_S)
    finally:
        c.close()


def test_a_failed_copy_fails_its_future_and_the_lane_goes_on(copier):
    bad = copier.to_host(torch.empty(3), torch.ones(5))
    with pytest.raises(RuntimeError):
        bad.result(WAIT_S)
    out = torch.empty(5)
    copier.to_host(out, torch.ones(5)).result(WAIT_S)
    assert torch.equal(out, torch.ones(5)) and copier._to_host.pending() == 0


def test_close_runs_what_is_queued_then_refuses_more():
    c = DeviceCopier(torch.device("cpu"))
    gate = Gate()
    dst = torch.empty(4)
    f = c.to_device(dst, torch.ones(4), after=gate)
    closer = threading.Thread(target=c.close)
    closer.start()
    gate.open()
    closer.join(WAIT_S)
    assert f.done() and torch.equal(dst, torch.ones(4))
    with pytest.raises(RuntimeError, match="closed"):
        c.to_host(torch.empty(1), torch.ones(1))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: side streams and events")
SLEEP_CYCLES = 2_000_000   # ~1 ms: longer than the copies, so a missing wait reads stale bytes


@pytest.mark.cuda
@CUDA
def test_cuda_lanes_run_on_the_copiers_device_and_their_own_streams():
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    c = DeviceCopier(dev)
    try:
        seen = {}

        def where(name):
            return lambda _f: seen.setdefault(name, (torch.cuda.current_device(), torch.cuda.current_stream()))
        c.to_device(torch.empty(4, device=dev), torch.ones(4)).add_done_callback(where("to_device"))
        c.to_host(torch.empty(4), torch.ones(4, device=dev)).add_done_callback(where("to_host"))
        c.close()
        assert seen["to_device"] == (dev.index, c._to_device.stream)
        assert seen["to_host"] == (dev.index, c._to_host.stream)
        assert c._to_device.stream != c._to_host.stream != torch.cuda.default_stream(dev)
    finally:
        c.close()


@pytest.mark.cuda
@CUDA
def test_cuda_delayed_producer_and_copy_streams_give_bitwise_the_produced_bytes():
    """The producer's kernels are queued behind a sleep, then a copy to host is asked for at once: it must
    wait for them. The copy stream is kept busy before a copy to the device: the future must not be done
    before the bytes have landed."""
    dev = torch.device("cuda", torch.cuda.current_device())
    c = DeviceCopier(dev)
    try:
        host = torch.empty(1 << 20, pin_memory=True)
        x = torch.zeros(1 << 20, device=dev)
        for k in range(16):
            torch.cuda._sleep(SLEEP_CYCLES)
            x.fill_(k + 1.0)
            c.to_host(host, x).result(WAIT_S)
            assert torch.equal(host, torch.full_like(host, k + 1.0)), f"round {k}: read before the producer wrote"
            host.fill_(-k - 1.0)
            with torch.cuda.stream(c._to_device.stream):
                torch.cuda._sleep(SLEEP_CYCLES)
            c.to_device(x, host).result(WAIT_S)
            assert torch.equal(x.cpu(), torch.full((1 << 20,), -k - 1.0)), f"round {k}: done before it landed"
    finally:
        c.close()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: a context on GPU 0 is the failure")
def test_cuda_a_copier_on_another_gpu_creates_no_context_on_gpu_0():
    code = ("import torch\n"
            "from infinity.store.device_copy import DeviceCopier\n"
            "torch.cuda.set_device(1)\n"
            "c = DeviceCopier(torch.device('cuda', 1))\n"
            "x = torch.ones(1024, device='cuda:1'); h = torch.empty(1024)\n"
            "c.to_host(h, x).result(); c.to_device(x, h).result(); c.close()\n"
            "print(torch._C._cuda_hasPrimaryContext(0))\n")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "the copier created a CUDA context on GPU 0"


def test_a_lane_drops_its_tensors_once_their_copy_is_done(copier):
    """The worker must not keep the last copy's tensors alive while it waits for the next one: the store
    frees a copy's memory once its hop is done, and an idle lane holding it would keep it allocated."""
    import weakref

    src, dst = torch.ones(1000), torch.empty(1000)
    gone = weakref.ref(src)
    copier.to_host(dst, src).result(WAIT_S)
    del src
    deadline = threading.Event()
    for _ in range(100):          # the worker drops them right after completing the future
        if gone() is None:
            break
        deadline.wait(0.01)
    assert gone() is None, "the idle lane still holds the source of its last copy"
