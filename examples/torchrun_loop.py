"""Your own training loop under ``torchrun``, with checkpoint and resume.

The built-in GPT on the embedded corpus (the Python standard library's source, byte tokens), ZeRO-3 with
parameters and optimizer in NVMe files; every rank trains on its share of each global batch. Stop it at
any point and run the same command again: it resumes from the newest checkpoint in ``--save-dir``, at
any world size.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_loop.py --steps 20 --save-dir ckpt
    python examples/torchrun_loop.py --steps 20 --save-dir ckpt          # one process, no torchrun

On several nodes: ``torchrun --nnodes 2 --node-rank I --master-addr ADDR --master-port PORT ...`` on each
(see docs/getting-started.md); give each node its own ``--swap-dir`` on a local disk.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import infinity
from infinity.data import TokenDataset
from infinity.models import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="total optimizer steps (resumed ones included)")
    ap.add_argument("--batch-size", type=int, default=8, help="global sequences a step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--save-dir", default="ckpt", help="checkpoints go here; a run resumes from its newest")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--swap-dir", default="infinity_swap", help="this node's directory for the NVMe tier")
    args = ap.parse_args()

    config = {
        "zero": {"stage": 3},
        "precision": {"param_dtype": "auto"},   # bf16 where this machine computes it natively, else fp32
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "tiers": {"nvme_path": args.swap_dir},
        "schedule": {"clip_grad_norm": 1.0},
    }
    torch.manual_seed(0)   # the same initial weights everywhere (initialize also broadcasts rank 0's)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=args.seq_len))
    # under torchrun this sets up the process group (gloo on CPU, NCCL on CUDA)
    model, optimizer = infinity.initialize(model, config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    data = TokenDataset.default(args.seq_len)

    start = 0
    if os.path.exists(os.path.join(args.save_dir, "latest")):
        start = infinity.load_checkpoint(args.save_dir, model, optimizer)["step"]
        if rank == 0:
            print(f"resumed at step {start}")
    for step in range(start, args.steps):
        for input_ids, labels in data.micro_batches(step, args.batch_size, 0, rank, world):
            loss = model(input_ids, labels=labels).loss   # labels are the inputs shifted by one token
            loss.backward()   # the engine's hooks reduce each unit's gradient shard as its backward ends
        optimizer.clip_grad_norm_(1.0)   # gradients live in the engine's shards: clip through the optimizer
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            infinity.save_checkpoint(args.save_dir, model, optimizer, keep_last=2)   # sharded, atomic
    infinity.engine_of(model).close()   # stops its threads and removes its swap files


if __name__ == "__main__":
    main()
