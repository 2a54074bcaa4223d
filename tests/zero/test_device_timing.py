"""Device-side phase times: each phase's start and stop record a timing event, and the step's end sums
the device time between each pair. Fake events with given timestamps stand in for CUDA's, so the
pairing and the sums run on CPU; a CPU engine reports host times only."""

from __future__ import annotations

import pytest
import torch

from infinity.comm.collectives import CommCounters
from infinity.zero.stats import DeviceTimer, EngineStats


class FakeEvent:
    """Records the next timestamp (ms) of a shared fake device clock; counts synchronize() calls."""

    def __init__(self, clock):
        self.clock, self.at_ms, self.synced = clock, None, 0

    def record(self):
        self.at_ms = self.clock.pop(0)

    def synchronize(self):
        assert self.at_ms is not None, "synchronize on an event never recorded"
        self.synced += 1

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.at_ms - self.at_ms


@pytest.fixture
def timed():
    clock, made = [], []

    def make():
        made.append(FakeEvent(clock))
        return made[-1]
    stats = EngineStats(CommCounters(), device_timer=DeviceTimer(torch.device("cuda", 0), make_event=make))
    return stats, clock, made


def test_phase_device_times_are_summed_per_step_and_start_over(timed):
    stats, clock, made = timed
    clock += [0.0, 40.0, 40.0, 140.0, 150.0, 175.0, 200.0, 230.0]   # fwd, bwd, a second bwd, step
    for phase in ("forward", "backward", "backward", "step"):
        stats.start(phase)
        stats.stop(phase)
    stats.end_step()
    got = {k: stats.last_step[k] for k in ("forward_device_s", "backward_device_s", "step_device_s")}
    assert got == pytest.approx({"forward_device_s": 0.040, "backward_device_s": 0.125, "step_device_s": 0.030})
    assert made[-1].synced >= 1, "the step's last event was read before it was waited for"
    assert stats.last_step["forward_s"] >= 0 and "comm_wait_s" in stats.last_step
    clock += [300.0, 310.0]
    stats.start("forward")
    stats.stop("forward")
    stats.end_step()
    assert stats.last_step["forward_device_s"] == pytest.approx(0.010)
    assert stats.last_step["backward_device_s"] == 0.0 and stats.last_step["step_device_s"] == 0.0


def test_a_stop_without_a_start_records_nothing(timed):
    stats, clock, made = timed
    stats.stop("backward")       # an aborted backward that never began
    stats.end_step()
    assert made == [] and stats.last_step["backward_device_s"] == 0.0


def test_a_cpu_engine_times_on_the_host_only():
    stats = EngineStats(CommCounters(), torch.device("cpu"))
    assert stats.device_timer is None
    stats.start("forward")
    stats.stop("forward")
    stats.end_step()
    assert "forward_device_s" not in stats.last_step and stats.last_step["forward_s"] >= 0


def test_the_compute_streams_wait_for_communication_is_in_the_step_stats():
    from infinity.comm.collectives import Pending

    clock = [0.0, 12.0]

    class Work:
        def wait(self):
            pass
    counters = CommCounters(device_waits=[], make_timing_event=lambda: FakeEvent(clock))
    stats = EngineStats(counters, torch.device("cpu"))
    Pending(Work(), counters).wait()
    stats.end_step()
    assert stats.last_step["comm_wait_device_s"] == pytest.approx(0.012)
    assert "wait_device_s" not in stats.last_step["collectives"]
    plain = EngineStats(CommCounters(), torch.device("cpu"))
    plain.end_step()
    assert "comm_wait_device_s" not in plain.last_step
