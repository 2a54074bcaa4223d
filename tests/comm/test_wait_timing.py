"""Communication waits timed on the device: under NCCL a wait returns at once on the host (it only
makes the compute stream wait), so each wait is bracketed by timing events and the snapshot reports the
device time between them. Fake events and a fake work stand in for CUDA and NCCL."""

from __future__ import annotations

import pytest

from infinity.comm.collectives import CommCounters, Pending


class FakeEvent:
    def __init__(self, clock):
        self.clock, self.at_ms, self.synced = clock, None, False

    def record(self):
        self.at_ms = self.clock.pop(0)

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        assert end.synced, "read before the later event was waited for"
        return end.at_ms - self.at_ms


class FakeWork:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


def test_each_wait_books_the_device_time_between_its_events_and_a_reset_starts_over():
    clock = [10.0, 35.0, 100.0, 101.0]   # the first wait stalled 25 ms, the second 1 ms
    counters = CommCounters(device_waits=[], make_timing_event=lambda: FakeEvent(clock))
    works = [FakeWork(), FakeWork()]
    ran = []
    for w in works:
        Pending(w, counters, then=lambda: ran.append(1)).wait()
    assert all(w.waited for w in works) and ran == [1, 1]
    snap = counters.snapshot()
    assert snap["wait_device_s"] == pytest.approx(0.026) and snap["wait_s"] >= 0
    counters.reset()
    assert counters.snapshot()["wait_device_s"] == 0.0


def test_without_nccl_no_event_is_made_and_the_device_time_is_none():
    counters = CommCounters(make_timing_event=lambda: pytest.fail("an event was made off CUDA"))
    Pending(FakeWork(), counters).wait()
    assert counters.snapshot()["wait_device_s"] is None


def test_a_launch_that_was_waited_already_books_nothing_more():
    clock = [0.0, 5.0]
    counters = CommCounters(device_waits=[], make_timing_event=lambda: FakeEvent(clock))
    p = Pending(FakeWork(), counters)
    p.wait()
    p.wait()
    assert len(counters.device_waits) == 1 and counters.snapshot()["wait_device_s"] == pytest.approx(0.005)
