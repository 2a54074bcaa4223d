"""Offloaded training matches plain single-process torch.optim.AdamW.

Optimizer on host and NVMe, params on host and NVMe, grads on host, at world
sizes 1 and 2; the GPT case has tied weights (wte / lm_head) and two param
groups with their own lr and weight decay. Host/device budgets are small
enough that states are evicted and re-read from NVMe every step (asserted).
fp32: loss within 1e-5 relative, every parameter element within what fp32
rounding can move it (``zero_cases.RoundingDrift``, as in
tests/zero/test_equivalence.py: the CPU Adam is torch's fused kernel; only
reduction order differs). bf16 compute: loss
within 5e-3 relative and at most 25% of the reference's update off, as in
tests/zero/test_equivalence.py.
"""

from __future__ import annotations

import pytest
import torch

import offload_cases
from zero_cases import BF16_TOL, FP32_TOL, compare

BASE = dict(model="gpt", steps=3, batch=8, lr=1e-2, groups=True)

# GPT test model: 2 blocks of ~12.6K params + root ~4.6K; shards are 4096-element padded (world size 1:
# 52 KiB per block unit in fp32, 20 KiB root; all states ~380 KiB; budgets are divided by the world size,
# padding is not, so they keep some slack). A host budget of 192 KiB holds one unit's master + moments
# (156 KiB) but not two, so every step re-reads states from NVMe; host-homed gradients (~124 KiB) come
# on top of it.
SMALL = dict(host_bytes=192 * 1024, device_bytes=64 * 1024, prefetch_bytes=20 * 1024)
SMALL_GRADS_ON_HOST = dict(SMALL, host_bytes=(192 + 124) * 1024)

CASES = [
    ("opt-host-s1", dict(stage=1, offload=dict(optimizer="host", params="none", grads="none"))),
    ("opt-nvme-s2", dict(stage=2, offload=dict(optimizer="nvme", params="none", grads="none"), **SMALL)),
    ("grads-host-s2", dict(stage=2, offload=dict(optimizer="host", params="none", grads="host"))),
    ("params-host-s3", dict(stage=3, offload=dict(optimizer="none", params="host", grads="none"))),
    ("all-nvme-s3", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host"),
                         **SMALL_GRADS_ON_HOST)),
]

_REF: dict = {}


def reference(spec: dict) -> dict:
    key = (spec["model"], spec["steps"], spec["batch"], spec["lr"], spec.get("groups"), spec.get("clip"))
    if key not in _REF:
        _REF[key] = offload_cases.reference_run(spec)
    return _REF[key]


def _specs(tmp_path, cases, **extra):
    return [dict(BASE, **c, **extra, tmp=str(tmp_path / name)) for name, c in cases]


@pytest.mark.parametrize("world_size", (1, 2))
def test_fp32_every_placement(worlds, tmp_path, world_size):
    specs = _specs(tmp_path, CASES)
    results = worlds(world_size).run(offload_cases.many, specs)[0]
    for (name, _), spec, got in zip(CASES, specs, results):
        try:
            compare(got, reference(spec), **FP32_TOL)
        except AssertionError as e:
            raise AssertionError(f"case {name}, world size {world_size}: {e}") from None
        moved = got["stats"][-1]["offload"]["moved_bytes"]
        if "nvme" in spec["offload"].values():
            assert moved.get("nvme->host", 0) > 0, f"{name}: states were never re-read from NVMe ({moved})"
            assert moved.get("host->nvme", 0) > 0, f"{name}: nothing written to NVMe ({moved})"


def test_accumulation_and_clipping_with_stored_grads(worlds, tmp_path):
    """Two micro-batches per step (the second adds into the stored shard) and clip_grad_norm_ over
    gradients on NVMe: norms and results match the reference."""
    case = ("grads-nvme-s3", dict(stage=3, offload=dict(optimizer="host", params="host", grads="nvme")))
    specs = _specs(tmp_path, [case], accum=2, clip=0.5)
    got = worlds(2).run(offload_cases.many, specs)[0][0]
    assert len(got["norms"]) == BASE["steps"]
    compare(got, reference(specs[0]), **FP32_TOL)


@pytest.mark.parametrize("world_size", (1, 2))
def test_the_clip_norm_taken_at_the_fold_reads_no_gradient_back(worlds, tmp_path, world_size):
    """With ``schedule.clip_grad_norm`` set, each unit's squared sums are taken at its last fold while the
    gradient is in memory, and clip_grad_norm_ reads no stored gradient back (at 2.7B with NVMe gradients
    that read is 5.4 GB a step): norms, losses and parameters are bitwise those of the same run told
    nothing, which reads every gradient back. NVMe gradients cut into chunks (an accumulation's fold
    sees one chunk at a time), two micro-batches: ``accum_steps`` 2 takes the sums in the second backward
    only, 1 in both (the second fold's replace the first's)."""
    case = dict(BASE, stage=3, offload=dict(optimizer="nvme", params="nvme", grads="nvme", chunk_bytes=96 * 1024),
                accum=2, clip=0.05, **SMALL)
    told = [dict(case, schedule={"clip_grad_norm": 0.05, "accum_steps": n}, tmp=str(tmp_path / f"told{n}"))
            for n in (2, 1)]
    plain = dict(case, tmp=str(tmp_path / "plain"))
    told2, told1, reads = worlds(world_size).run(offload_cases.many, [*told, plain])[0]
    clipped = [n > 0.05 for n in reads["norms"]]
    assert any(clipped), reads["norms"]
    assert reads["most_chunks"] > 1   # the block units' shards are chunked
    assert reads["norm_reads"] == 3 * BASE["steps"]   # every unit's gradient read back, every step
    for got, what in ((told2, "accum_steps 2"), (told1, "accum_steps 1")):
        assert got["norm_reads"] == 0, what
        assert got["norms"] == reads["norms"] and got["losses"] == reads["losses"], what
        for n, p in reads["params"].items():
            assert torch.equal(got["params"][n], p), f"{what}: parameter {n}"


def test_bf16_nvme(worlds, tmp_path):
    specs = _specs(tmp_path, [CASES[-1]], dtype="bf16")
    got = worlds(2).run(offload_cases.many, specs)[0][0]
    compare(got, reference(specs[0]), **BF16_TOL)


def test_unit_order_changes_between_steps(worlds, tmp_path):
    """Blocks run in another order in steps 2 and 4: results match, the trace is re-recorded on every rank."""
    case = ("reorder", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host"),
                            **SMALL_GRADS_ON_HOST))
    specs = _specs(tmp_path, [case], model="reorder", steps=5, groups=False)
    per_rank = worlds(2).run(offload_cases.many, specs)
    got = per_rank[0][0]
    compare(got, reference(specs[0]), **FP32_TOL)
    traces = [[s["offload"]["prefetch_trace"] for s in r[0]["stats"]] for r in per_rank]
    assert traces[0] == traces[1], f"ranks disagree on the prefetch trace: {traces}"
    # steps 2, 3 (back to the old order, which differs from step 2's) and 4 leave the trace
    assert per_rank[0][0]["diverged"] == per_rank[1][0]["diverged"] == 3


def test_stress_many_units_tiny_budgets(worlds, tmp_path):
    """24 tiny units, device tier ~4 shards, prefetching up to 3 ahead: transfers everywhere, results exact."""
    case = ("many", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host"),
                         host_bytes=160 * 1024, device_bytes=16 * 1024, prefetch_bytes=12 * 1024,
                         max_live=24 * 1024))   # world size 2: root + one block in use + one gathered ahead
    specs = _specs(tmp_path, [case], model="many", steps=3, groups=False)
    got = worlds(2).run(offload_cases.many, specs)[0][0]
    compare(got, reference(specs[0]), **FP32_TOL)
    s = got["store"]
    assert s["evictions"]["device"] > 0 and s["evictions"]["host"] > 0, s["evictions"]
    assert s["peak_bytes"]["device"] <= s["budget_bytes"]["device"]
    assert s["peak_bytes"]["host"] <= s["budget_bytes"]["host"]


def test_chrome_trace_of_a_chosen_step(worlds, tmp_path):
    """Step 1 is traced: one lane per thread/stream (compute, swap-in, swap-out, comm), valid Chrome JSON."""
    import json
    specs = _specs(tmp_path, [CASES[-1]], trace_step=1, steps=2)
    worlds(1).run(offload_cases.many, specs)
    doc = json.loads((tmp_path / CASES[-1][0] / "trace_rank0.json").read_text())
    lanes = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "swap-in", "swap-out", "comm"} <= lanes, lanes
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["name"].split(" ")[0] for e in spans}
    assert {"adam", "write", "all-gather", "issue"} <= names, names
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


GRADS_NVME = ("fp16-grads-nvme-s3", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="nvme"),
                                         **SMALL_GRADS_ON_HOST))


def test_fp16_overflow_with_stored_grads_skips_and_counts(worlds, tmp_path):
    """fp16 with gradients on NVMe: overflow is seen as shards are reduced (never by re-reading them),
    all ranks skip the same steps, parameters stay put on those, the scale halves / doubles as in memory."""
    spec = dict(BASE, **GRADS_NVME[1], steps=8, scale=2.0 ** 22, window=2, tmp=str(tmp_path / "fp16"))
    per_rank = worlds(2).run(offload_cases.fp16_case, spec)
    r = per_rank[0]
    assert per_rank[1]["skipped"] == r["skipped"]
    assert r["skipped"][:2] == [1, 1], r["skipped"]
    assert 0 in r["skipped"], r["skipped"]
    assert r["moved"] == [not x for x in r["skipped"]]
    assert r["scaler_skipped"] == sum(r["skipped"])
    scale, good, expected = 2.0 ** 22, 0, []
    for skipped in r["skipped"]:
        scale, good = (scale / 2, 0) if skipped else (scale, good + 1)
        scale = scale * 2 if not skipped and good % 2 == 0 else scale
        expected.append(scale)
    assert r["scales"] == expected


def test_fp16_stored_grads_accumulation_and_clipping(worlds, tmp_path):
    """fp16 compute, gradients on NVMe, two micro-batches and clipping: the unscale and the clip factor
    ride with the step (the shards are not rewritten) and training stays close to the fp32 reference."""
    specs = _specs(tmp_path, [GRADS_NVME], dtype="fp16", accum=2, clip=0.5)
    got = worlds(2).run(offload_cases.many, specs)[0][0]
    assert len(got["norms"]) == BASE["steps"] and all(n == n and n < float("inf") for n in got["norms"])
    compare(got, reference(specs[0]), **BF16_TOL)   # norms too, within 5e-3 relative
