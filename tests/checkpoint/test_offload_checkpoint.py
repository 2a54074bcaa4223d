"""Checkpoints of an offloaded model round-trip (the checkpoint code reads and writes shards via get())."""

from __future__ import annotations

import pytest

import infinity
import offload_cases
from infinity.checkpoint import load_checkpoint, save_checkpoint
from zero_cases import build_model, global_batch


@pytest.mark.parametrize("offload", [dict(optimizer="nvme", params="nvme", grads="host"),
                                     dict(optimizer="host", params="none", grads="nvme")])
def test_save_load_round_trip_with_stored_shards(tmp_path, offload):
    spec = dict(stage=3, lr=1e-2, offload=offload, tmp=str(tmp_path), host_bytes=1 << 20,
                device_bytes=64 * 1024, dtype="bf16")

    def make():
        model = build_model("gpt")
        return infinity.initialize(model, offload_cases.offload_config(spec, 0))

    def step(model, opt, ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    a, opt_a = make()
    b, opt_b = make()   # same seed: trained differently below, then overwritten by the load
    try:
        for s in range(2):
            step(a, opt_a, global_batch(s, 4))
        step(b, opt_b, global_batch(7, 4))
        save_checkpoint(tmp_path / "ck", a, opt_a)
        load_checkpoint(tmp_path / "ck", b, opt_b)
        ids = global_batch(5, 4)
        assert b(input_ids=ids, labels=ids).loss.item() == a(input_ids=ids, labels=ids).loss.item()
        step(a, opt_a, ids)   # the moments came back too: one more step stays identical
        step(b, opt_b, ids)
        assert b(input_ids=ids, labels=ids).loss.item() == a(input_ids=ids, labels=ids).loss.item()
    finally:
        infinity.engine_of(a).close()
        infinity.engine_of(b).close()
