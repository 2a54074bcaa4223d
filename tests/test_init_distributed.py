"""Under a launcher on CUDA, each rank sets its own device (LOCAL_RANK) before NCCL starts, and binds the
process group to it; on CPU it starts gloo; either way with ``dist.timeout_s``. torch.cuda and
torch.distributed are stubbed, so this runs without a GPU or other ranks."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from infinity import initialization
from infinity.config import Config

CFG = Config()
TIMEOUT = timedelta(seconds=CFG.dist.timeout_s)


@pytest.fixture
def launched(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    for k, v in dict(WORLD_SIZE="4", RANK="3", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    return calls


def test_cuda_rank_sets_its_device_before_nccl_and_binds_the_group_to_it(launched, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device = initialization._init_distributed(CFG)
    assert device == torch.device("cuda", 1)
    assert launched == [("set_device", torch.device("cuda", 1)),
                        ("init", "nccl", {"timeout": TIMEOUT, "device_id": torch.device("cuda", 1)})]


def test_cpu_rank_starts_gloo_and_sets_no_device(launched, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert initialization._init_distributed(CFG) == torch.device("cpu")
    assert launched == [("init", "gloo", {"timeout": TIMEOUT})]
