"""Collective volume per step and resident bytes per rank equal the ZeRO theory (DESIGN §5).

Ψ is the padded element count (every unit's flat buffer as laid out), N the
number of ranks the state is sharded over (1 at stage 0).

Volume (elements per rank per step; an all-reduce counts 2x, reduce-scatter + all-gather):
stages 0-2 move 2Ψ; stage 3 moves 3Ψ for every unit but the root (gathered for
forward, gathered again for backward, reduce-scattered), and 2Ψ_root for the
root unit, which stays gathered from its forward through its backward (as
FSDP2's root does), so the total is 3Ψ - Ψ_root. With
``reshard_after_forward: false`` stage 3 gathers every unit once: 2Ψ.

Resident bytes after ``zero_grad`` in mixed precision (bf16 params and
gradients, fp32 master + moments): stage 0 16Ψ; 1: 2Ψ + 2Ψ + 12Ψ/N;
2: 2Ψ + 2Ψ/N + 12Ψ/N; 3: 16Ψ/N.
"""

from __future__ import annotations

import pytest

import zero_cases


def _specs():
    return [dict(stage=s, lr=1e-3, dtype="bf16", reduce="bf16") for s in (0, 1, 2, 3)] + [
        dict(stage=3, lr=1e-3, dtype="bf16", reduce="bf16", reshard=False)]


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_volume_and_resident_bytes(worlds, world_size):
    specs = _specs()
    per_rank = worlds(world_size).run(zero_cases.many, "volume_case", specs)
    for rank, results in enumerate(per_rank):
        for spec, r in zip(specs, results):
            psi, root, n, v = r["psi"], r["root_psi"], r["shard_world"], r["volume"]
            where = f"rank {rank} stage {spec['stage']} reshard={spec.get('reshard', True)}"
            assert n == (1 if spec["stage"] == 0 else world_size)
            assert psi % (n * 2048) == 0, f"{where}: Ψ={psi} does not split into 4096-byte bf16 shards"
            if spec["stage"] == 0:
                assert v == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2 * psi, "broadcast": 0}, where
            elif spec["stage"] in (1, 2):
                assert v == {"all_gather": psi, "reduce_scatter": psi, "all_reduce": 0, "broadcast": 0}, where
            elif spec.get("reshard", True):
                assert 0 < root < psi
                assert v == {"all_gather": 2 * psi - root, "reduce_scatter": psi, "all_reduce": 0,
                             "broadcast": 0}, where
            else:
                assert v == {"all_gather": psi, "reduce_scatter": psi, "all_reduce": 0, "broadcast": 0}, where
            # bf16 reduce dtype: bytes are 2 per element, for every collective kind
            assert sum(r["bytes"].values()) == 2 * sum(
                x // (2 if k == "all_reduce" else 1) for k, x in v.items()), where
            expected = {
                0: {"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi},
                1: {"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi // n},
                2: {"params": 2 * psi, "grads": 2 * psi // n, "optimizer": 12 * psi // n},
                3: {"params": 2 * psi // n, "grads": 2 * psi // n, "optimizer": 12 * psi // n},
            }[spec["stage"]]
            assert r["resident"] == expected, f"{where}: resident {r['resident']} != {expected}"


def test_fp32_stage3_master_is_the_param_shard(worlds):
    """In fp32 the master weights are the parameter shard itself: 16Ψ/N with no extra copy."""
    spec = dict(stage=3, lr=1e-3)
    r = worlds(2).run(zero_cases.volume_case, spec)[0]
    psi = r["psi"]
    assert r["resident"] == {"params": 4 * psi // 2, "grads": 4 * psi // 2, "optimizer": 8 * psi // 2}
