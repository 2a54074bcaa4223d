"""A synthetic profile and compute figures for the planner's tests: fixed rates, nothing measured."""

from __future__ import annotations

import json

from infinity.plan.rates import ComputeRates, Rates

MiB = 2**20


def profile_dict(read_gbps=1.0, write_gbps=1.0, adam_params_per_s=2e8, memcpy_gbps=8.0, nproc=2,
                 adam_formats=None, slowdown=None, fresh_gbps=None) -> dict:
    """The sections Rates.from_profile reads, shaped as `infinity profile` writes them (``slowdown``:
    the contention section's, None: a profile without that section; ``fresh_gbps``: memcpy's
    fresh-memory figure, None: a profile without it)."""
    row = {"block_bytes": MiB, "queue_depth": 2, "threads": 2, "read_gbps": read_gbps, "write_gbps": write_gbps}
    coll = [{"op": op, "bytes": b, "algbw_gbps": 0.5} for op in ("all_reduce", "all_gather", "reduce_scatter")
            for b in (MiB, 8 * MiB, 32 * MiB)]
    return {"machine": {"cores_available": 2, "ram_available_bytes": 16 * 2**30},
            "memcpy": {"gbps": memcpy_gbps, **({"fresh_gbps": fresh_gbps} if fresh_gbps is not None else {})},
            "nvme": {"sweep": [row], "mixed": {"read_gbps": read_gbps * 0.6, "write_gbps": write_gbps * 0.6}},
            "cpu_adam": {"params_per_s": adam_params_per_s,
                         **({"formats": adam_formats} if adam_formats is not None else {})},
            "collectives": {"available": True, "rows": coll},
            "io": {"block_bytes": MiB, "queue_depth": 2, "threads": 2, "direct": False, "checksum": True},
            "settings": {"lower_bound": False},
            **({"contention": {"slowdown": slowdown}} if slowdown is not None else {})}


def write_profile(path, **kw) -> str:
    path.write_text(json.dumps(profile_dict(**kw)))
    return str(path)


def rates(**kw) -> Rates:
    return Rates.from_profile(profile_dict(**kw), source="synthetic")


def compute(blocks: int, block_s=0.01, root_s=0.005, saved=1 << 20) -> ComputeRates:
    return ComputeRates(tokens=64, dtype="bfloat16", root_forward_s=root_s, root_backward_s=2 * root_s,
                        block_forward_s=block_s, block_backward_s=2 * block_s, blocks=blocks,
                        root_saved_bytes=saved, block_saved_bytes=saved, block_input_bytes=saved // 8)


def auto_initialize(spec: dict) -> dict:
    """Rank side of the multi-rank ``offload: auto`` test: ``infinity.initialize`` a small GPT with
    ``spec["config"]`` (an auto config) in this rank's world; the config its engine got, what it logged,
    one training step's loss, or the error initialize raised (``error``: its type and message)."""
    import contextlib
    import io

    import torch

    import infinity
    from infinity.models import GPT, GPTConfig

    torch.manual_seed(0)
    log = io.StringIO()
    try:
        with contextlib.redirect_stderr(log):
            model, opt = infinity.initialize(GPT(GPTConfig(**spec["shape"])), spec["config"])
    except Exception as e:   # noqa: BLE001 - the test checks which error each rank saw
        return {"error": (type(e).__name__, str(e)), "log": log.getvalue()}
    engine = infinity.engine_of(model)
    try:
        ids = torch.randint(0, spec["shape"]["vocab_size"], (2, spec["shape"]["block_size"]),
                            generator=torch.Generator().manual_seed(engine.rank))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return {"config": engine.config.to_dict(), "log": log.getvalue(), "loss": loss.item(),
                "world_size": engine.world_size}
    finally:
        engine.close()
