"""``--model hf:PATH``: a local transformers checkpoint, built on meta and filled unit by unit from safetensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.cli import main
from infinity.config import Config
from infinity.models.pretrained import PretrainedError, SafetensorsWeights, meta_model_from_pretrained
from infinity.train import TrainOptions
from infinity.train.loop import _build
from infinity.train.resolve import resolve

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def _save_gpt2(path: Path, **shape) -> "transformers.GPT2LMHeadModel":
    """A random GPT-2 (no dropout, so train-mode logits are eval-mode logits), sharded into several files."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**{"n_layer": 3, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 300,
                                     "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                     "attn_pdrop": 0.0, **shape})
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(path, max_shard_size="60KB")
    return model


def test_first_step_logits_equal_from_pretrained(tmp_path):
    path = tmp_path / "gpt2"
    _save_gpt2(path)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) >= 3 and (path / "model.safetensors.index.json").is_file()
    config = tmp_path / "nvme.json"   # fp32 so the comparison is exact; parameters and optimizer on NVMe
    config.write_text(json.dumps({"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "params": "nvme"},
                                  "tiers": {"nvme_path": str(tmp_path / "swap")}}))
    run = resolve(TrainOptions(model=f"hf:{path}", config=str(config), save=False), 1)
    assert run.model.kind == "pretrained" and run.seq_len == 64   # the model's 64 positions, not 256
    model, optimizer, loss_fn, _ = _build(run, Config.from_dict(run.config))   # what `infinity train` runs
    try:
        reference = transformers.AutoModelForCausalLM.from_pretrained(path)
        x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
        got = model(input_ids=x).logits
        assert torch.equal(got, reference(input_ids=x).logits)
        # tied: lm_head is wte, one parameter filled once
        assert model.lm_head.weight is model.transformer.wte.weight
    finally:
        infinity.engine_of(model).close()


def test_fine_tune_then_consolidate_loads_with_from_pretrained(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "gpt2"
    original = _save_gpt2(path)
    rc = main(["train", "--model", f"hf:{path}", "--steps", "3", "--batch-size", "4", "--seq-len", "32",
               "--lr", "1e-3", "--no-progress", "--json", "--save-dir", "ck", "--eval-every", "0"])
    assert rc == 0
    rc = main(["consolidate", "ck", "out", "--json"])
    assert rc == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    before, after = original.state_dict(), tuned.state_dict()
    assert before.keys() == after.keys()
    assert all(before[k].shape == after[k].shape for k in before)
    assert not torch.equal(before["transformer.h.0.mlp.c_fc.weight"], after["transformer.h.0.mlp.c_fc.weight"])
    assert tuned.lm_head.weight.data_ptr() == tuned.transformer.wte.weight.data_ptr()   # still tied
    # a few steps of Adam at 1e-3 move each weight by a few lr: trained, not replaced
    assert (before["transformer.wpe.weight"] - after["transformer.wpe.weight"]).abs().max() < 0.05


def test_bad_directories_are_named(tmp_path):
    with pytest.raises(PretrainedError, match="no config.json"):
        meta_model_from_pretrained(tmp_path)
    path = tmp_path / "gpt2"
    _save_gpt2(path)
    other = _save_gpt2(tmp_path / "wide", n_embd=32, n_head=2)
    del other
    model = meta_model_from_pretrained(path)
    with pytest.raises(PretrainedError, match=r"'transformer.wte.weight' has shape \[300, 32\], the model's "):
        SafetensorsWeights(tmp_path / "wide", model)
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(PretrainedError, match="no model.safetensors or model.safetensors.index.json"):
        SafetensorsWeights(path, model)
    rc = main(["train", "--model", f"hf:{tmp_path / 'missing'}", "--no-save"])
    assert rc == 2


def test_loading_peak_rss_is_a_fraction_of_the_weights(tmp_path):
    """150M parameters (609 MB of fp32 in 12 files), everything on NVMe: loading grows RSS by no more than the
    host budget (the store's cache of registered shards) plus two units' fp32 weights (the unit being filled
    and its shards on the way), one unit at a time, each file unmapped after use, plus the freed blocks the
    host block cache may keep (its cap, 64 MiB here); that bound is well under the weights, so the state dict
    is never in memory."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "pretrained_rss_script.py"), str(tmp_path / "m"),
                          str(tmp_path / "swap"), "12", "1024"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["files"] >= 5 and r["state_bytes"] > 600e6
    bound = r["host_bytes"] + 2 * r["unit_bytes"]
    assert r["state_bytes"] > 1.75 * bound, r   # the model is big enough for the bound to mean something
    assert r["growth"] < bound + r["cache_bytes"], r
