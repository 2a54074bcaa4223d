"""``zero.activation_checkpointing``: each unit's activations are recomputed in backward.

The recompute replays the unit's forward, bit for bit, so training is bitwise
the run without it, at every stage (stage 3: the recompute runs while the unit
is gathered for its backward, and must neither release it nor record it in the
trace). And it really checkpoints: the tensors autograd saves during forward
fall to a fraction.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero_cases
from zero_cases import backward_on_share, build_model, config_for, global_batch

BASE = dict(model="gpt", steps=3, batch=8, lr=1e-2)


def saved_bytes_case(spec: dict) -> int:
    """Bytes of the tensors autograd saves in one forward of this rank's share."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, opt = infinity.initialize(build_model(spec["model"]), config_for(spec))
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=global_batch(0, spec["batch"]).chunk(world)[rank],
                         labels=global_batch(0, spec["batch"]).chunk(world)[rank]).loss
        loss.backward()
        opt.step()
    finally:
        infinity.engine_of(model).close()
    return sum(saved)


def trace_case(spec: dict) -> list:
    """Stage 3: the recorded unit order after two steps (the recompute is not in it)."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, opt = infinity.initialize(build_model(spec["model"]), config_for(spec))
    engine = infinity.engine_of(model)
    for step in range(2):
        backward_on_share(model, global_batch(step, spec["batch"]), rank, world)
        opt.step()
        opt.zero_grad()
    trace = list(engine.prefetcher.trace)
    engine.close()
    return trace


@pytest.mark.parametrize("world_size", (1, 2))
def test_bitwise_equal_to_the_run_without_it(worlds, world_size):
    specs = [dict(BASE, stage=s) for s in (0, 1, 2, 3)]
    specs += [dict(BASE, stage=3, reshard=False), dict(BASE, stage=3, accum=2), dict(BASE, model="hf_gpt2", stage=3)]
    # True: every unit; 1: the first of the two only
    both = specs + [dict(s, checkpointing=True) for s in specs] + [dict(s, checkpointing=1) for s in specs]
    got = worlds(world_size).run(zero_cases.many, "train_case", both)[0]
    plain, checkpointed = got[:len(specs)], got[len(specs):]
    for spec, a, b in zip(specs + specs, plain + plain, checkpointed):
        assert a["losses"] == b["losses"], (spec, a["losses"], b["losses"])
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), (spec, name)


def test_saves_a_fraction_of_the_activations_and_keeps_the_trace(worlds):
    specs = [dict(BASE, stage=s, batch=16) for s in (0, 3)]
    plain = worlds(2).run(saved_bytes_case, specs[1])[0]
    for spec in specs:
        checkpointed = worlds(2).run(saved_bytes_case, dict(spec, checkpointing=True))[0]
        assert checkpointed < 0.5 * plain, (spec, checkpointed, plain)
        # the first of the two units only: about half of what checkpointing both drops
        first = worlds(2).run(saved_bytes_case, dict(spec, checkpointing=1))[0]
        assert checkpointed < first < plain, (spec, checkpointed, first, plain)
        assert abs((plain - first) - (first - checkpointed)) < 0.25 * (plain - checkpointed), (spec, first)
    plain_trace = worlds(2).run(trace_case, dict(BASE, stage=3))[0]
    ckpt_trace = worlds(2).run(trace_case, dict(BASE, stage=3, checkpointing=True))[0]
    assert ckpt_trace == plain_trace and len(plain_trace) > 0
