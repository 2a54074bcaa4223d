"""Run under torchrun (tests/zero/test_torchrun.py): initialize must set up gloo from the env vars itself."""

import sys

import torch
import torch.distributed as dist

import infinity
from zero_cases import build_model, global_batch

torch.set_num_threads(1)
stage = int(sys.argv[1])
assert not dist.is_initialized()
model, opt = infinity.initialize(build_model("gpt"), {"zero": {"stage": stage}})
rank, world = dist.get_rank(), dist.get_world_size()
ids = global_batch(0, 2 * world).chunk(world)[rank]
model(ids, labels=ids).loss.backward()
opt.step()
engine = infinity.engine_of(model)
print(f"rank {rank}/{world} backend {dist.get_backend()} stage {stage} "
      f"shard_world {engine.shard_world} steps {engine.stats.last_step['steps']}", flush=True)
dist.destroy_process_group()
