"""Child process of test_rss_bound and test_nvme_soak: RSS is a whole-process figure, so each runs alone.

``bound SWAP HOST...``: for each host budget in turn, a GPT (8 x 256, vocab 512) trained 3 steps at stage 3
with everything on NVMe: the bound :func:`infinity.estimate.peak_rss.bound_for_model` predicts (baseline = RSS
just before ``initialize``, torch warmed), the peak during ``initialize`` (VmHWM, reset first) and each step's memory
report. ``soak SWAP STEPS``: a small GPT trained STEPS steps the same way, recording RSS and the swap files'
size on disk after every step, and after step 20 and the last step also RSS once glibc's free heap pages
are returned (``malloc_trim``: what is left is memory in use, not how fragmented the heap happens to be).
Prints one JSON line.
"""
import ctypes
import ctypes.util
import gc
import json
import os
import sys

import torch

import infinity
from infinity.config import Config
from infinity.estimate.peak_rss import bound_for_model
from infinity.models import GPT, GPTConfig, gpt_init_
from infinity.zero.memory_report import read_peak_rss, reset_peak_rss, rss_bytes, warm_torch

torch.set_num_threads(1)
BATCH, SEQ = 2, 64


def config(swap: str, host: str, device: str, max_live: str) -> dict:
    return {"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "params": "nvme", "grads": "nvme"},
            # a small host block cache, so the bound's term for it stays small beside the others
            "tiers": {"device_bytes": device, "host_bytes": host, "nvme_path": swap, "host_cache_bytes": "8MiB"},
            "prefetch": {"bytes": "1MiB", "max_live_bytes": max_live},
            "io": {"block_bytes": "1MiB", "queue_depth": 4, "threads": 2}, "optimizer": {"threads": 1}}


def forward(model):
    ids = torch.zeros((BATCH, SEQ), dtype=torch.long, device=next(model.parameters()).device)
    return model(input_ids=ids, labels=ids).loss


def train(cfg: GPTConfig, conf: dict, steps: int, after_step) -> int:
    """Initialize, enable the memory report, train, calling ``after_step(step, engine)``; returns the
    peak RSS of ``initialize`` (VmHWM: reset it before)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model, opt = infinity.initialize(model, conf, init_fn=lambda m: gpt_init_(m, cfg))
    init_peak = read_peak_rss()
    engine = infinity.engine_of(model)
    engine.memory.enable()
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(steps):
            ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            after_step(step, engine)
    finally:
        engine.close()
    return init_peak


def disk_bytes(path: str) -> dict:
    """Every file under ``path``: apparent size and blocks allocated on disk."""
    size = blocks = 0
    for root, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(root, f))
            size, blocks = size + st.st_size, blocks + st.st_blocks * 512
    return {"size": size, "allocated": blocks}


def bound_mode(swap: str, hosts: list) -> dict:
    cfg = GPTConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=512, block_size=SEQ)
    warm_torch()   # the baseline holds torch's runtime (the bound's definition)
    runs = []
    for host in hosts:
        conf = config(os.path.join(swap, host), host, "4MiB", "7MiB")
        gc.collect()
        baseline = rss_bytes()
        bound, need = bound_for_model(lambda: GPT(cfg), Config.from_dict(conf), forward=forward,
                                      baseline_bytes=baseline)
        if not reset_peak_rss():
            return {"skip": "/proc/self/clear_refs is not writable: the peak of each run cannot be isolated"}
        reports = []
        init_peak = train(cfg, conf, 3, lambda step, engine: reports.append(engine.memory_report()))
        runs.append({"host": host, "bound": bound.to_dict(), "min_host": need[next(iter(need))][0],
                     "init_peak": init_peak, "reports": reports})
    return {"runs": runs}


def soak_mode(swap: str, steps: int) -> dict:
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=SEQ)
    conf = config(swap, "4MiB", "1MiB", "3MiB")
    rss, disk, nvme_reads, trimmed = [], [], [], {}
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    trim = getattr(libc, "malloc_trim", None)   # glibc only

    def after_step(step, engine):   # keeps a few numbers a step: their growth is negligible
        rss.append(engine.memory_report()["rss_bytes"])
        disk.append(disk_bytes(swap))
        nvme_reads.append(engine.stats.last_step["offload"]["moved_bytes"].get("nvme->host", 0))
        if step + 1 in (20, steps) and trim is not None:
            trim(0)
            trimmed[step + 1] = rss_bytes()

    train(cfg, conf, steps, after_step)
    return {"rss": rss, "disk": disk, "nvme_reads": nvme_reads, "trimmed_rss": trimmed}


if __name__ == "__main__":
    mode, swap = sys.argv[1], sys.argv[2]
    out = bound_mode(swap, sys.argv[3:]) if mode == "bound" else soak_mode(swap, int(sys.argv[3]))
    print(json.dumps(out))
