"""``tiers.*_bytes: auto``: the host budget is shared by the ranks of a machine and leaves the OS its
reserve; the device budget leaves room for the working set, activations and a slack. Measured values
(``psutil.virtual_memory``, the cgroup grant, ``torch.cuda.mem_get_info``) are stubbed, so the CUDA rule runs on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infinity.config import TiersConfig
from infinity.store import Tier
from infinity.store import budget, memory_grant
from infinity.store.budget import DeviceHeadroom, auto_device_bytes, auto_host_bytes, resolve_budgets

GiB = 2**30


@pytest.fixture
def machine(monkeypatch):
    """A 64 GiB machine with 60 GiB available, no cgroup memory grant, and an 80 GiB GPU with 79 GiB free
    (stubbed)."""
    monkeypatch.setattr(memory_grant.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=64 * GiB, available=60 * GiB))
    monkeypatch.setattr(memory_grant, "find_grant", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def mem_get_info(device):
        calls.append(device)
        return 79 * GiB, 80 * GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return calls


def test_host_auto_is_half_of_what_the_os_reserve_leaves_shared_by_the_local_ranks(machine, monkeypatch):
    one = resolve_budgets(TiersConfig(), torch.device("cuda", 0))[Tier.HOST]
    os_reserve = int(0.10 * 64 * GiB)              # 6.4 GiB > the 2 GiB minimum
    assert one == (60 * GiB - os_reserve) // 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    eight = resolve_budgets(TiersConfig(), torch.device("cuda", 3))[Tier.HOST]
    assert eight == one // 8
    assert 8 * eight <= 60 * GiB - os_reserve, "the node's ranks together plan for more RAM than is available"


def test_device_auto_leaves_the_working_set_activations_and_slack(machine):
    dev = torch.device("cuda", 2)
    plain = resolve_budgets(TiersConfig(), dev)[Tier.DEVICE]
    assert machine == [dev], "mem_get_info was not asked about the engine's own device"
    slack = max(1 * GiB, int(0.05 * 80 * GiB))      # 4 GiB
    assert plain == 79 * GiB - int(0.25 * 80 * GiB) - slack
    measured = resolve_budgets(TiersConfig(), dev, DeviceHeadroom(working_set_bytes=6 * GiB,
                                                                  activation_bytes=10 * GiB))[Tier.DEVICE]
    assert measured == 79 * GiB - 6 * GiB - 10 * GiB - slack


def test_device_auto_is_not_divided_by_ranks_but_cpu_device_auto_is(machine, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cuda = resolve_budgets(TiersConfig(), torch.device("cuda", 0))[Tier.DEVICE]
    assert cuda == 79 * GiB - 20 * GiB - 4 * GiB    # each rank has a GPU of its own
    cpu = resolve_budgets(TiersConfig(host_bytes=1 * GiB), torch.device("cpu"))[Tier.DEVICE]
    assert cpu == 16 * GiB // 4                     # the CPU "device" is the shared RAM


def test_a_cpu_device_tier_is_carved_out_of_the_host_half_when_both_are_auto(machine, monkeypatch):
    """On a CPU both tiers are the same RAM: with both auto they share the host half (the device at most
    half of it), so together they never take more than a CUDA run's host tier; the process keeps its half."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    half = resolve_budgets(TiersConfig(), torch.device("cuda", 0))[Tier.HOST]
    got = resolve_budgets(TiersConfig(), torch.device("cpu"))
    assert got[Tier.HOST] + got[Tier.DEVICE] == half
    assert got[Tier.DEVICE] == min(16 * GiB // 4, half // 2) == half // 2   # 64 GiB / 4 ranks caps at 4 GiB
    small = resolve_budgets(TiersConfig(device_bytes=256 * 2**20), torch.device("cpu"))
    assert small == {Tier.DEVICE: 256 * 2**20, Tier.HOST: half}   # an explicit device tier is not carved out


def test_explicit_budgets_are_taken_as_given(machine, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    got = resolve_budgets(TiersConfig(device_bytes=3 * GiB, host_bytes=5 * GiB), torch.device("cuda", 0))
    assert got == {Tier.DEVICE: 3 * GiB, Tier.HOST: 5 * GiB} and machine == []


def test_a_full_device_or_host_gives_a_zero_budget_not_a_negative_one():
    assert auto_device_bytes(2 * GiB, 80 * GiB, DeviceHeadroom()) == 0
    assert auto_host_bytes(1 * GiB, 64 * GiB, 1) == 0


@pytest.mark.parametrize("bad", ["zero", "0", "-2"])
def test_a_bad_local_world_size_is_named(machine, monkeypatch, bad):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        resolve_budgets(TiersConfig(), torch.device("cuda", 0))


@given(total=st.integers(4 * GiB, 2048 * GiB), used=st.floats(0, 1), ranks=st.integers(1, 16),
       working=st.integers(0, 64 * GiB), activations=st.one_of(st.none(), st.integers(0, 64 * GiB)))
def test_auto_budgets_never_plan_past_what_is_there(total, used, ranks, working, activations):
    available = int(total * (1 - used))
    host = auto_host_bytes(available, total, ranks)
    assert 0 <= host * ranks <= max(0, available - budget.OS_RESERVE_MIN_BYTES) // 2
    device = auto_device_bytes(available, total, DeviceHeadroom(working, activations))
    assert 0 <= device <= max(0, available - working - budget.DEVICE_SLACK_MIN_BYTES)
