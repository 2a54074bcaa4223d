"""``infinity estimate --seq``: the activations a micro-batch saves at each sequence length, split as
checkpointing and offload split them, counted on the meta device; equal to a real forward's count."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from infinity.cli import main
from infinity.estimate.activations import SavedBytes, count_saved
from infinity.models import GPT, gpt_config
from infinity.zero.units import choose_unit_modules


def _counted(seq: int, device: str) -> SavedBytes:
    cfg = dataclasses.replace(gpt_config("tiny"), block_size=seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    blocks = [m for _, m in choose_unit_modules(model)]

    def forward(m):
        ids = torch.zeros((2, seq), dtype=torch.long, device=device)
        return m(input_ids=ids, labels=ids).loss
    return count_saved(model, blocks, forward)


@pytest.mark.parametrize("seq", (32, 96))
def test_the_meta_count_is_a_real_forwards(seq):
    meta, real = _counted(seq, "meta"), _counted(seq, "cpu")
    assert meta == real
    cfg = gpt_config("tiny")
    assert meta.block_input == 2 * seq * cfg.n_embd * 4 and meta.blocks == cfg.n_layer
    assert meta.block > meta.block_input and meta.root > 0


def test_the_split_follows_checkpointing_and_the_tier():
    s = SavedBytes(root=100, block=1000, block_input=10, blocks=4)
    assert (s.on_device(0), s.on_device(4), s.on_device(2)) == (4100, 140, 100 + 20 + 2000)
    assert (s.on_device(4, "host"), s.in_host(4, "host"), s.on_disk(4, "host")) == (120, 40, 0)
    assert (s.on_device(4, "nvme"), s.in_host(4, "nvme", prefetch_bytes=15), s.on_disk(4, "nvme")) == (120, 35, 40)
    assert s.in_host(4, "nvme", prefetch_bytes=5) == 25
    assert s.on_device(0, "nvme") == 100 + 2000 and s.offloaded(1) == 10 + 3000
    with pytest.raises(TypeError, match="not a bool"):
        s.offloaded(True)


def test_cli_prints_each_length_and_choice(capsys):
    assert main(["estimate", "--model", "tiny", "--seq", "64,256", "--batch", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["activations"]
    assert [r["seq"] for r in rows] == [64, 256]
    for r in rows:
        s = SavedBytes(**r["saved"])
        assert r["modes"]["keep"]["device_bytes"] == s.root + s.blocks * s.block
        assert r["modes"]["recompute"]["device_bytes"] == s.root + s.blocks * s.block_input
        assert r["modes"]["recompute + nvme"]["nvme_bytes"] == s.blocks * s.block_input
        assert s.block_input == 2 * r["seq"] * gpt_config("tiny").n_embd * 2   # bf16 without a config
    assert rows[1]["saved"]["block_input"] == 4 * rows[0]["saved"]["block_input"]
    assert main(["estimate", "--model", "tiny", "--seq", "64,256"]) == 0
    out = capsys.readouterr().out
    assert "Activations saved for backward" in out and "recompute + nvme" in out


def test_cli_seq_errors_are_named(capsys):
    assert main(["estimate", "--params", "7B", "--seq", "1024"]) == 2
    assert "--seq needs --model" in capsys.readouterr().err
    assert main(["estimate", "--model", "tiny", "--seq", "1k"]) == 2
    assert "--seq: expected lengths" in capsys.readouterr().err
