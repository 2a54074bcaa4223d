"""Child process of test_pretrained: save a GPT-2 (weights of 0.01: values do not matter for memory), then load
it with initialize_pretrained (what --model hf:PATH runs), everything on NVMe, and print the peak RSS growth.

argv: model dir, swap dir, n_layer, n_embd. Prints one JSON line.
"""
import gc
import json
import os
import sys

import torch
import transformers

import infinity
from infinity.models.pretrained import initialize_pretrained

torch.set_num_threads(1)

path, swap, n_layer, n_embd = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=8, n_positions=128, vocab_size=512,
                              bos_token_id=0, eos_token_id=0)
with torch.device("meta"):
    m = transformers.GPT2LMHeadModel(cfg)
m.to_empty(device="cpu")
for p in m.parameters():
    p.data.fill_(0.01)   # random init of 150M parameters would cost more than the load
m.save_pretrained(path, max_shard_size="64MB")
state_bytes = sum(p.numel() * 4 for p in m.parameters())
del m, p
gc.collect()


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


HOST_BYTES = 224 * 2**20   # about the least a step of this model needs (initialize refuses less)
CACHE_BYTES = 64 * 2**20   # the host block cache keeps freed blocks up to this (infinity.store.host_cache)
unit_bytes = 12 * n_embd * n_embd * 4   # one block's fp32 weights, about: the unit being materialized
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")          # reset VmHWM: the peak below is the loading's own
config = {"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "params": "nvme", "grads": "nvme"},
          "tiers": {"nvme_path": swap, "host_bytes": HOST_BYTES, "host_cache_bytes": CACHE_BYTES}}
model, optimizer = initialize_pretrained(path, config)
peak = status("VmHWM:")
infinity.engine_of(model).close()
print(json.dumps({"state_bytes": state_bytes, "host_bytes": HOST_BYTES, "cache_bytes": CACHE_BYTES,
                  "unit_bytes": unit_bytes, "rss_before": before, "peak": peak, "growth": peak - before,
                  "files": len([f for f in os.listdir(path) if f.endswith(".safetensors")])}))
