"""Every ready config in configs/ loads and trains the tiny GPT a few steps (world size 1)."""

from pathlib import Path

import pytest
import torch

import infinity
from infinity.data import TokenDataset
from infinity.models import GPT, gpt_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_every_expected_config_is_there():
    names = {p.stem for p in CONFIGS}
    assert {"ddp", "zero1", "zero2", "zero3", "zero3-host", "zero3-nvme"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_trains_tiny_gpt(path, tmp_path):
    cfg = infinity.Config.from_file(path)
    if cfg.tiers.nvme_path is not None:
        (tmp_path / "swap").mkdir()  # a missing swap directory is an error, not created silently
        cfg = cfg.replace(tiers={"nvme_path": str(tmp_path / "swap")})
    cfg = cfg.replace(optimizer={"lr": 3e-3, "weight_decay": 0.0})
    torch.manual_seed(0)
    model, opt = infinity.initialize(GPT(gpt_config("tiny")), cfg)
    data = TokenDataset.default(seq_len=32, max_bytes=1 << 20)
    losses = []
    for step in range(8):
        x, y = data.global_batch(step % 2, batch_size=4, seed=0)
        loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    # the same two batches alternate, so a working optimizer drives their loss down
    assert losses[-1] < losses[0] - 0.2, losses
    infinity.engine_of(model).close()


def test_nvme_config_leaves_no_swap_files(tmp_path):
    cfg = infinity.Config.from_file(Path(__file__).parent.parent / "configs" / "zero3-nvme.yaml")
    (tmp_path / "swap").mkdir()
    # the tiny model's state would fit the host budget: keep it on the disk, where this test looks
    cfg = cfg.replace(tiers={"nvme_path": str(tmp_path / "swap")}, offload={"host_resident_bytes": 0})
    torch.manual_seed(0)
    model, opt = infinity.initialize(GPT(gpt_config("tiny")), cfg)
    x, y = TokenDataset.default(seq_len=32, max_bytes=1 << 20).global_batch(0, batch_size=2)
    model(x, labels=y).loss.backward()
    opt.step()
    assert any(p.is_file() for p in (tmp_path / "swap").rglob("*"))
    infinity.engine_of(model).close()
    assert not any(p.is_file() for p in (tmp_path / "swap").rglob("*"))
