"""Stored formats of the optimizer states (``optimizer.master`` / ``optimizer.moments``).

``master: remainder`` keeps the fp32 master as an int16 remainder beside the bf16 parameter: a run
with it is bitwise the fp32-master run (losses and every parameter), at world sizes 1 and 2, stages
0-3, optimizer in memory, on host and on NVMe, with and without an overlapped update (``update_at``). ``moments:
bf16`` and ``int8`` train close to fp32 moments. The disk bytes a step moves are the placement's
accounting exactly, in each format.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import format_cases
from infinity.checkpoint.manifest import Checkpoint, unit_file
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader
from infinity.optim.moment_codes import BLOCK, decode_, encode_

BASE = dict(model="hf_gpt2", steps=3, batch=8, lr=1e-2, groups=True, dtype="bf16")
# HF GPT-2 test model (2 blocks, 32 wide): 34816 shard elements at world size 1. The host budget holds one
# unit's optimizer job beside the host-homed gradients, so NVMe-homed states stream: read and written once a step.
SMALL = dict(host_bytes=340 * 1024, device_bytes=64 * 1024, prefetch_bytes=20 * 1024)
CASES = [
    ("memory-s0", dict(stage=0)),
    ("memory-s1", dict(stage=1)),
    ("memory-s3", dict(stage=3)),
    ("opt-host-s1", dict(stage=1, offload=dict(optimizer="host"))),
    ("opt-nvme-s2", dict(stage=2, offload=dict(optimizer="nvme", grads="host"), **SMALL)),
    ("opt-nvme-s2-overlap", dict(stage=2, offload=dict(optimizer="nvme", grads="host"), overlap=True, **SMALL)),
    ("params-host-s3", dict(stage=3, offload=dict(optimizer="host", params="host"))),
    ("all-nvme-s3", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="host"), **SMALL)),
    ("all-nvme-s3-overlap", dict(stage=3, offload=dict(optimizer="nvme", params="nvme", grads="nvme"),
                                 overlap=True, **dict(SMALL, host_bytes=SMALL["host_bytes"] + 64 * 1024))),
]   # (the overlapped update's room holds one job apart: 64 KiB more keeps every deferred gradient in host memory)

# int8 moments on the paths that differ for them: in memory, on host, streamed from NVMe, chunked stage 3
INT8_CASES = ("memory-s1", "opt-host-s1", "opt-nvme-s2", "all-nvme-s3-overlap")


def _specs(tmp_path, master: str, moments: str = "fp32", only=None) -> list:
    specs = []
    for name, case in CASES:
        if only is not None and name not in only:
            continue
        case = dict(case)
        optimizer = {"master": master, "moments": moments, "update_at": "auto" if case.pop("overlap", False) else "step"}
        specs.append(dict(BASE, **case, optimizer=optimizer, tmp=str(tmp_path / f"{name}-{master}-{moments}")))
    return specs


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory):
    """``{world_size: (fp32 results, remainder results, remainder + bf16 moments results)}`` per case, and
    ``int8[world_size]``: ``{case: remainder + int8 moments result}`` for INT8_CASES; one world run per size."""
    out = {}
    for world_size in (1, 2):
        tmp = tmp_path_factory.mktemp(f"formats{world_size}")
        specs = _specs(tmp, "fp32") + _specs(tmp, "remainder") + _specs(tmp, "remainder", "bf16") + \
            _specs(tmp, "remainder", "int8", INT8_CASES)
        results = worlds(world_size).run(format_cases.many, specs)[0]
        n = len(CASES)
        out[world_size] = (results[:n], results[n:2 * n], results[2 * n:3 * n])
        out[("int8", world_size)] = dict(zip(INT8_CASES, results[3 * n:]))
    return out


@pytest.mark.parametrize("world_size", (1, 2))
def test_remainder_master_trains_bitwise_like_the_fp32_master(runs, world_size):
    for (name, _), fp32, remainder, _ in zip(CASES, *runs[world_size]):
        where = f"case {name}, world size {world_size}"
        assert remainder["losses"] == fp32["losses"], f"{where}: losses {remainder['losses']} vs {fp32['losses']}"
        assert len(set(fp32["losses"])) == len(fp32["losses"]), f"{where}: the steps changed nothing"
        for n, p in fp32["params"].items():
            assert torch.equal(remainder["params"][n], p), f"{where}: parameter {n} differs"


@pytest.mark.parametrize("world_size", (1, 2))
def test_disk_bytes_per_step_are_the_accounting(runs, world_size):
    """Every NVMe-homed class is written once a step, and (streamed, nothing host-resident) each state read
    once: exactly its elements times the stored itemsize the placement accounts for it. The remainder
    writes 2 B/element of master instead of 4, an int8 moment 65/64 B (a block's 256 codes and scale)."""
    int8 = runs[("int8", world_size)]
    for (name, _), *formats in zip(CASES, *runs[world_size]):
        for got in formats + ([int8[name]] if name in int8 else []):
            if "accounting" not in got or "nvme" not in got["accounting"]["homes"].values():
                continue
            acc = got["accounting"]
            on_nvme = {c: n for c, n in acc["itemsizes"].items() if acc["homes"][c] == "nvme"}
            moved = got["stats"][-1]["offload"]["moved_bytes"]
            # a consumed gradient is dropped unwritten (update_at auto); the rest are written home
            written = sum(n for c, n in on_nvme.items() if c != "grad") * acc["shard_numel"]
            states = sum(on_nvme[c] for c in ("master", "exp_avg", "exp_avg_sq")) * acc["shard_numel"]
            where = f"case {name}, world size {world_size}, master {acc['itemsizes']['master']} B"
            assert moved.get("host->nvme", 0) == written, f"{where}: {moved} vs {written} written"
            if "param" not in on_nvme:   # parameters re-read by forward and backward as the budget allows
                # states not streamed stay cached in host memory from one step to the next: no reads
                states = states if acc["streamed"] else 0
                assert moved.get("nvme->host", 0) == states, f"{where}: {moved} vs {states} read"
    i = [name for name, _ in CASES].index("opt-nvme-s2")
    written = [r[i]["stats"][-1]["offload"]["moved_bytes"]["host->nvme"] for r in runs[world_size]]
    written.append(int8["opt-nvme-s2"]["stats"][-1]["offload"]["moved_bytes"]["host->nvme"])
    numel = runs[world_size][0][i]["accounting"]["shard_numel"]
    # per element: 12 B of fp32 states, 10 with the remainder, 6 with bf16 moments too, 4 + 1/32 with int8
    assert written == [12 * numel, 10 * numel, 6 * numel, 4 * numel + numel // 32], (written, numel)
    assert runs[world_size][0][i]["accounting"]["streamed"], "the fp32 states were meant to stream"


@pytest.mark.parametrize("world_size", (1, 2))
def test_bf16_moments_train_close_to_fp32_moments(runs, world_size):
    """bf16 moments change the update by their rounding only (2**-8 relative per moment per step): after 3
    steps the loss is within 1e-3 relative and the parameters within a few bf16 ulps of the fp32 run's."""
    for (name, _), _, remainder, low in zip(CASES, *runs[world_size]):
        where = f"case {name}, world size {world_size}"
        for a, b in zip(low["losses"], remainder["losses"]):
            assert abs(a - b) <= 1e-3 * abs(b), f"{where}: losses {low['losses']} vs {remainder['losses']}"
        assert low["losses"] != remainder["losses"] or any(
            not torch.equal(low["params"][n], p) for n, p in remainder["params"].items()), \
            f"{where}: bf16 moments changed nothing: were they stored in bf16?"
        for n, p in remainder["params"].items():
            assert (low["params"][n] - p).abs().max() <= 0.05, f"{where}: parameter {n} moved far"


@pytest.mark.parametrize("world_size", (1, 2))
def test_int8_moments_train_close_to_fp32_moments(runs, world_size):
    """int8 moments change the update by their coding only (at most 1/16 relative per moment per step, the
    same on every path): after 3 steps the loss is within 1% and the parameters near the fp32 run's, and
    every path (memory, host, NVMe streamed, stage 3 chunked with overlap) gives the same losses."""
    int8 = runs[("int8", world_size)]
    for (name, _), _, remainder, _ in zip(CASES, *runs[world_size]):
        if name not in int8:
            continue
        low, where = int8[name], f"case {name}, world size {world_size}"
        for a, b in zip(low["losses"], remainder["losses"]):
            assert abs(a - b) <= 1e-2 * abs(b), f"{where}: losses {low['losses']} vs {remainder['losses']}"
        assert low["losses"] != remainder["losses"], f"{where}: int8 moments changed nothing: were they int8?"
        for n, p in remainder["params"].items():
            assert (low["params"][n] - p).abs().max() <= 0.1, f"{where}: parameter {n} moved far"
    by_stage = {}
    for name, got in int8.items():   # stages 1-2 and stage 3 reduce in other orders
        by_stage.setdefault(name.endswith(("s3", "s3-overlap")), []).append(got["losses"])
    for losses in by_stage.values():
        assert all(x == losses[0] for x in losses), by_stage


def test_a_checkpoint_saved_in_one_master_format_resumes_bitwise_in_the_other(worlds, tmp_path):
    """fp32 <-> remainder through a checkpoint (saved as the fp32 master; loaded as the parameter and its
    remainder, exactly): the steps after the load are bitwise those of the run that never stopped."""
    case = dict(BASE, stage=3, offload=dict(optimizer="nvme", params="host"), steps=3, save_at=2, **SMALL)
    specs = [dict(case, optimizer={"master": a}, load_optimizer={"master": b}, tmp=str(tmp_path / f"{a}-{b}"))
             for a, b in (("fp32", "fp32"), ("fp32", "remainder"), ("remainder", "fp32"),
                          ("remainder", "remainder"))]
    results = worlds(2).run(format_cases.many_resumed, specs)[0]
    straight = worlds(2).run(format_cases.many, [dict(case, optimizer={"master": "fp32"},
                                                      tmp=str(tmp_path / "straight"))])[0][0]
    for spec, got in zip(specs, results):
        where = f"{spec['optimizer']['master']} -> {spec['load_optimizer']['master']}"
        assert got["losses"] == straight["losses"], f"{where}: {got['losses']} vs {straight['losses']}"
        for n, p in straight["params"].items():
            assert torch.equal(got["params"][n], p), f"{where}: parameter {n} differs"


def test_a_checkpoint_converts_between_moment_formats(worlds, tmp_path):
    """Moments are saved in the format they are stored in (the manifest and each unit file say which):
    fp32 ones loaded as bf16 are their values rounded to nearest; bf16 ones loaded as fp32 are exactly
    what the bf16 run held, and loaded as bf16 they are bitwise what it held. int8 ones are saved as
    their F8_E4M3 codes and one F32 scale per block: loaded as fp32 they are exactly the values the int8
    run held, loaded as int8 the same values again, and fp32 ones loaded as int8 are their encoding.
    Training goes on from each. A damaged scale tensor fails the load's checks, named."""
    case = dict(BASE, stage=2, offload=dict(optimizer="nvme", grads="host"), steps=3, save_at=2, **SMALL)
    pairs = (("fp32", "bf16"), ("bf16", "fp32"), ("bf16", "bf16"), ("int8", "fp32"), ("int8", "int8"),
             ("fp32", "int8"))
    specs = [dict(case, optimizer={"moments": a}, load_optimizer={"moments": b}, tmp=str(tmp_path / f"{a}-{b}"))
             for a, b in pairs]
    results = worlds(2).run(format_cases.many_resumed, specs)[0]
    to_bf16, to_fp32, same = results[:3]
    for saved, loaded in zip(to_bf16["saved_moments"], to_bf16["loaded_moments"]):
        assert saved.dtype == torch.float32 and loaded.dtype == torch.bfloat16
        assert torch.equal(loaded, saved.to(torch.bfloat16))
    for saved, loaded in zip(to_fp32["saved_moments"], to_fp32["loaded_moments"]):
        assert saved.dtype == torch.bfloat16 and loaded.dtype == torch.float32
        assert torch.equal(loaded, saved.float())
    for saved, loaded in zip(same["saved_moments"], same["loaded_moments"]):
        assert saved.dtype == loaded.dtype == torch.bfloat16 and torch.equal(loaded, saved)
    int8_to_fp32, int8_same, to_int8 = results[3:]
    for saved, loaded in zip(int8_to_fp32["saved_moments"], int8_to_fp32["loaded_moments"]):
        assert saved.dtype == torch.uint8 and loaded.dtype == torch.float32
        assert torch.equal(loaded, _values(saved)[:loaded.numel()])
    for saved, loaded in zip(int8_same["saved_moments"], int8_same["loaded_moments"]):
        assert saved.dtype == loaded.dtype == torch.uint8 and torch.equal(_values(loaded), _values(saved))
    for saved, loaded in zip(to_int8["saved_moments"], to_int8["loaded_moments"]):
        assert saved.dtype == torch.float32 and loaded.dtype == torch.uint8
        rows = torch.zeros(loaded.shape, dtype=torch.uint8)
        assert torch.equal(loaded, encode_(saved.clone(), rows, root=True))
    assert int8_same["losses"][2] != to_fp32["losses"][2]
    for got in results:
        assert len(got["losses"]) == 3 and all(math.isfinite(x) for x in got["losses"])
    codes = {"fp32": "F32", "bf16": "BF16", "int8": "F8_E4M3"}
    for (saved_as, _), spec in zip(pairs, specs):   # what is on disk: the stored format, half the bytes for bf16
        ckpt = Checkpoint(os.path.join(spec["tmp"], "ckpt"))
        code = codes[saved_as]
        assert ckpt.manifest["shard_tensor_dtypes"] == {"master": "F32", "exp_avg": code, "exp_avg_sq": code}
        for r in range(2):
            for i in range(len(ckpt.units)):
                with TensorFileReader(ckpt.path(unit_file(r, i), r), "unit file") as f:
                    dtypes = {n: f.entry(n)[0] for n in ("master", "exp_avg", "exp_avg_sq")}
                    numel = int(ckpt.units[i]["shard_numel"])
                    narrow = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float8_e4m3fn}[saved_as]
                    assert dtypes == {"master": torch.float32, "exp_avg": narrow, "exp_avg_sq": narrow}
                    assert all(list(f.entry(n)[1]) == [numel] for n in dtypes)
                    scales = [n for n in f.entries if n.endswith("_scale")]
                    if saved_as == "int8":   # one fp32 scale per block of 256
                        assert sorted(scales) == ["exp_avg_scale", "exp_avg_sq_scale"]
                        assert all((f.entry(n)[0], list(f.entry(n)[1])) == (torch.float32, [numel // BLOCK])
                                   for n in scales)
                    else:
                        assert scales == []
    # a damaged scale tensor is caught by the checks a load runs first, naming it
    ckpt = Checkpoint(os.path.join(specs[pairs.index(("int8", "int8"))]["tmp"], "ckpt"))
    path = ckpt.path(unit_file(1, 0), 1)
    with TensorFileReader(path, "unit file") as f:
        start = f.entry("exp_avg_sq_scale")[2]
    with open(path, "r+b") as fh:
        fh.seek(start)
        byte = fh.read(1)
        fh.seek(start)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert "exp_avg_sq_scale" in ckpt.saved_tensors()
    with pytest.raises(CheckpointError, match=r"rank 1.*tensor 'exp_avg_sq_scale' CRC-32"):
        ckpt.verify(unit_file(1, 0), 1, ckpt.saved_tensors())


def _values(rows: torch.Tensor) -> torch.Tensor:
    """The second moments int8 rows hold."""
    return decode_(rows, torch.empty(rows.shape[0] * BLOCK), squared=True).clone()
