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
