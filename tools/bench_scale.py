"""Scale benchmark: a GPT-2 whose training state is far larger than memory, beside its baselines, in one run.

    python tools/bench_scale.py --size 2.7b --json [--peer deepspeed] [--precision auto] [--host-bytes 3GiB] [--dry-run]

The workload is the one of ../shared/peers/README.md, so figures compare with the peers': transformers'
``GPT2LMHeadModel`` from ``GPT2Config`` (vocab 50257, n_positions 1024, tied embeddings, dropout 0, sdpa
attention) built on the meta device and materialized unit by unit by ``infinity.initialize`` with the GPT-2
init (normal 0.02, residual ``c_proj`` 0.02/sqrt(2 n_layer), LayerNorm 1/0; seed 1234, drawn in module
order as the DeepSpeed peer's zero.Init path draws them); synthetic tokens uniform in [0, 1024), sequence
256, micro-batch 2, one rank, 2 threads; fp32 master; AdamW lr 6e-4, betas (0.9, 0.95), eps 1e-8, weight
decay 0.01; ZeRO-3 with parameters, gradients and optimizer on NVMe (``--set`` changes the config, e.g.
``--set optimizer.update_at=auto``).

Precision (``--precision``, default ``auto``, or the ``--config`` file's ``precision.param_dtype``): infinity's
``precision.param_dtype``; ``auto`` is resolved by :mod:`infinity.precision` (bf16 where this CPU's matmul probe
finds it faster than fp32; else fp32 compute over bf16-stored parameters). The compute floor and the DeepSpeed
peer compute in infinity's compute dtype (``peers.sh ... bf16|fp32``): on a CPU without native bf16 both sides
run fp32, where bf16 would run some 50-90x slower and say nothing of either system. The JSON's ``precision``
says what each side used, ``hardware`` the machine (:func:`infinity.precision.hardware_record`).

What it prints, all measured in this invocation, one after the other, each in its own process:
- step: median wall time of the measured steps (forward + backward + optimizer step and zero_grad) and
  its phases, timed around the three calls as the peer times its own; the losses;
- compute floor: forward + backward in the compute dtype with all weights in RAM, no optimizer: what no
  offload beats. Where its weights + grads exceed --floor-max-bytes it is measured at two smaller depths and
  extrapolated linearly per layer (the output says so);
- disk: O_DIRECT 8 MiB blocks on the swap directory's file system: writes alone, reads alone, then reads
  and writes at once (io.threads threads a side, time-boxed);
- I/O bound = max(R / read bandwidth at once, W / write bandwidth at once), R and W the bytes the store
  read from and wrote to NVMe per step: the step if the disk were its only limit and reads and writes
  always overlapped; beside it the serial figure R / read alone + W / write alone, and the lower bound:
  the best split between overlapped and alone (min of the two schedules at the ends: the time is linear
  in the overlapped part), which on a disk whose mixed total is below its alone rates is the serial one;
- peak RSS: the training process's VmHWM over the steps (warm-up included, as the peer's), reset after
  set-up through /proc/self/clear_refs (the output says when it could not be), with
  engine.memory_report()'s breakdown when the engine has it, else engine.resident_bytes();
- bytes moved per step per tier pair (the store's counters) and the process's disk bytes (/proc/self/io);
  the swap directory's size after set-up and after the steps;
- with --peer deepspeed: DeepSpeed ZeRO-Infinity on the same workload through ../shared/peers/peers.sh
  (config E, pipelined, below 1B params; F0 from 1B) in the same compute dtype, and the ratios infinity /
  DeepSpeed (none where the two computed in different dtypes).
The machine may be shared: the load average and other processes' CPU share per step are recorded.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch

from hardware_note import line as hardware_line
from infinity.config import Config, ConfigError, format_size, parse_size
from infinity.plan.auto import read_auto, wants_auto
from infinity.precision import hardware_record, resolve_precision
from infinity.store import Tier
from infinity.zero.engine import DTYPES
from infinity.zero.memory_report import reset_peak_rss
from infinity.zero.placement import Placement
from infinity.zero.stage import StagePolicy

SIZES = {  # layers, width, heads: the peers' table, and 4b = 4.07B params, the first >= 4.0B at width 2560;
    # 7b = 6.65B params, Llama-2-7B's depth and width (32 x 4096) in GPT-2's blocks
    "tiny": (2, 128, 2), "small": (12, 768, 12), "medium": (24, 1024, 16), "1b": (24, 2048, 16),
    "2.7b": (32, 2560, 32), "3.3b": (40, 2560, 32), "4b": (50, 2560, 32), "7b": (32, 4096, 32),
}
PEER_SIZES = ("tiny", "small", "medium", "1b", "2.7b", "3.3b")   # what ../shared/peers/common.py knows
VOCAB, POSITIONS, DATA_VOCAB = 50257, 1024, 1024
GIB = 2**30
median = statistics.median
DS_SETUP = """DeepSpeed is not installed in {root}/venv ($PEERS_ROOT). Set it up once (see {peers}/README.md):
  python3.11 -m venv {root}/venv
  {root}/venv/bin/pip install torch==2.13.0 numpy ninja setuptools psutil pyyaml
  apt-get install -y libaio-dev
  DS_BUILD_OPS=0 {root}/venv/bin/pip install --no-build-isolation deepspeed==0.19.8
  {root}/venv/bin/pip install --no-build-isolation transformers==5.24.0
  {python} {tool} --fix-deepspeed-set-dtype   # for fp32: DeepSpeed's Init._set_dtype fix ({peers}/README.md)
  PEERS_ROOT={root} {peers}/peers.sh E tiny bf16 1 -- --warmup 1 --steps 1   # JIT-builds its ops: throw away"""
# DeepSpeed 0.19.8's zero.Init._set_dtype, given a dtype or no config: `dtype or torch.float16 if <fp16 supported> else
# torch.bfloat16 if <is_bf16_supported, never called> else torch.float32`. By precedence a given dtype only
# counts where the accelerator supports fp16, and the uncalled method is always true: on a CPU without fp16
# kernels a ZeRO-3 model asked for in fp32 is cast to bf16. The fix (../shared/peers/README.md) parenthesises
# the fallback and calls the method.
DS_SET_DTYPE_BUG = re.compile(r"dtype or torch\.float16 if get_accelerator\(\)\.is_fp16_supported\(\s*\)\s*else "
                              r"torch\.bfloat16 if get_accelerator\(\)\.is_bf16_supported else torch\.float32")
DS_SET_DTYPE_FIXED = ("dtype or (torch.float16 if get_accelerator().is_fp16_supported() else torch.bfloat16 "
                      "if get_accelerator().is_bf16_supported() else torch.float32)")
PRECISIONS = ("auto", "bf16", "fp32")   # --precision: infinity's precision.param_dtype


# ---------------------------------------------------------------- the workload

def model_config(a, n_layer=None):
    from transformers import GPT2Config
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=max(POSITIONS, a.seq), n_layer=n_layer or a.n_layer,
                     n_embd=a.n_embd, n_head=a.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    return cfg


def layer_numel(n_embd):
    return 12 * n_embd**2 + 13 * n_embd   # attention 4 d^2 + MLP 8 d^2, biases and two LayerNorms


def param_count(n_layer, n_embd, seq):
    """Tied head: token + position embeddings, final LayerNorm, n_layer blocks."""
    return (VOCAB + max(POSITIONS, seq)) * n_embd + 2 * n_embd + n_layer * layer_numel(n_embd)


def batch(step, a):
    """The peers' batch of (step, rank 0): tokens uniform in [0, DATA_VOCAB); labels are the inputs."""
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 1009)
    return torch.randint(0, DATA_VOCAB, (a.mbs, a.seq), generator=g)


@torch.no_grad()
def gpt2_init_(module, n_layer):
    """GPT-2 init of one unit, or one other module holding parameters, in named_modules order."""
    from transformers.pytorch_utils import Conv1D
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Embedding):
            m.weight.normal_(0.0, 0.02)
        elif isinstance(m, torch.nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
        elif isinstance(m, Conv1D):
            m.weight.normal_(0.0, 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj") else 0.02)
            m.bias.zero_()


WORKLOAD_OPTIMIZER = {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}


def builtin_config(a) -> dict:
    """The workload's own config: ZeRO-3, ``--precision``, everything on NVMe, the grant as tier budgets."""
    return {"zero": {"stage": 3}, "precision": {"param_dtype": a.precision},
            "optimizer": {**WORKLOAD_OPTIMIZER, "threads": a.threads},
            "offload": {"optimizer": "nvme", "params": "nvme", "grads": "nvme"},
            "tiers": {"host_bytes": a.host_bytes, "device_bytes": a.device_bytes, "nvme_path": a.swap_dir}}


def infinity_config(a) -> dict:
    """The built-in config, or ``--config``'s file with the workload's optimizer hyper-parameters, threads and
    swap directory put in (an ``offload: auto`` file gets the grant as its ``plan`` section's memory: the
    planner then picks the rest at ``initialize``; ``--precision``, where given, replaces the file's
    ``precision.param_dtype``), then the ``--set`` overrides."""
    import yaml
    if a.config:
        with open(a.config) as f:
            conf = yaml.safe_load(f) or {}
        conf.setdefault("optimizer", {}).update(WORKLOAD_OPTIMIZER, threads=a.threads)
        if a.precision is None:   # the file's, else the default's
            a.precision = (conf.get("precision") or {}).get("param_dtype", "auto")
        conf.setdefault("precision", {})["param_dtype"] = a.precision
        conf.setdefault("tiers", {})["nvme_path"] = a.swap_dir
        if wants_auto(conf):
            conf["plan"] = {**(conf.get("plan") or {}), "host_bytes": a.host_bytes, "device_bytes": a.device_bytes}
        else:
            conf["tiers"].update(host_bytes=a.host_bytes, device_bytes=a.device_bytes)
    else:
        a.precision = a.precision or "auto"
        conf = builtin_config(a)
    for item in a.set:   # section.key=value, the value read as YAML (true, 2GiB, 4, [0.9, 0.95])
        key, eq, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not (eq and dot and name):
            sys.exit(f"--set {item!r}: expected section.key=value, e.g. optimizer.update_at=auto")
        conf.setdefault(section, {})[name] = yaml.safe_load(value)
    try:   # unknown keys and bad values are refused here, before anything runs
        if wants_auto(conf):
            Config.from_dict(read_auto(conf)[0])
        else:
            Config.from_dict(conf)
    except ConfigError as e:
        sys.exit(f"{'--config / --set' if a.config else '--set'}: {e}")
    return conf


def disk_need(a) -> dict:
    """Swap bytes of each system (ours: every class the placement homes on NVMe, in its stored format, as
    the engine counts it, with a speculative update's spares) and of the disk test; they run one after
    the other, each removing its files, so the largest counts, plus the peers' 4 GiB. An ``offload: auto``
    config is counted as the built-in one (everything on NVMe, fp32 master: the most the planner can store)."""
    config = Config.from_dict(builtin_config(a) if wants_auto(a.conf) else a.conf)
    placement = Placement.from_config(config)
    sizes = placement.of((), StagePolicy.of(config.zero.stage), DTYPES[a.dtypes["infinity_stored"]].itemsize,
                         DTYPES[config.precision.reduce_dtype].itemsize).stored_itemsizes()
    # update_at speculative: each class Adam writes has a spare copy beside it (Placement.copies)
    per_param = sum(n * placement.copies(cls) for cls, n in sizes.items() if placement.home(cls) is Tier.NVME)
    ours = int(a.n_params * per_param) + GIB   # the swap file grows in steps of up to 1 GiB (int8: 65/64 B)
    peer = a.n_params * 18 if a.peer else 0      # DeepSpeed: bf16 params, fp32 master, m, v and grads
    return {"infinity_swap": ours, "deepspeed_swap": peer, "disk_test": 2 * a.disk_bytes,
            "total": max(ours, peer, 2 * a.disk_bytes) + 4 * GIB}


def predicted_rss(a, baseline_bytes=None):
    """infinity.estimate.peak_rss's peak-RSS bound and initialize's minimum budgets for this model and config, with
    activations left out (transformers' GPT-2 forward cannot run on meta tensors to count them); None when
    this infinity has no infinity.estimate.peak_rss."""
    try:
        from infinity.estimate.peak_rss import SLACK_FRACTION, bound_for_model
    except ImportError:
        return None
    from transformers import GPT2LMHeadModel
    try:
        bound, need = bound_for_model(lambda: GPT2LMHeadModel(model_config(a)), Config.from_dict(a.conf),
                                      baseline_bytes=baseline_bytes)
    except Exception as e:  # noqa: BLE001 - an optional figure must not stop the benchmark
        return {"error": f"{type(e).__name__}: {e}"}
    return {"bound_without_activations": bound.to_dict(), "slack_fraction": SLACK_FRACTION,
            "min_budgets": {t.value: {"bytes": b, "why": why} for t, (b, why) in (need or {}).items()}}


def resolve_dtypes(a) -> dict:
    """What each side stores and computes in. infinity: its config's ``precision``, ``auto`` resolved by
    :func:`infinity.precision.resolve_precision` on this CPU (the matmul probe at the model's shapes, cached
    per machine: the training child's ``initialize`` finds the same answer). The compute floor and the peer
    compute in infinity's compute dtype: DeepSpeed has no bf16-stored, fp32-computed mode, so where auto
    stores bf16 and computes fp32 (a CPU without fast bf16) the peer runs fp32, and bf16 where bf16 is fast."""
    from transformers import GPT2LMHeadModel
    config = Config.from_dict(read_auto(a.conf)[0] if wants_auto(a.conf) else a.conf)
    with torch.device("meta"):
        model = GPT2LMHeadModel(model_config(a))
    resolved, choice = resolve_precision(config, model, torch.device("cpu"), announce=False)
    stored, compute = resolved.precision.param_dtype, resolved.precision.compute_dtype
    return {"requested": a.precision, "infinity_stored": stored, "infinity_compute": compute,
            "floor": compute, "deepspeed": compute if a.peer else None,
            "auto_reason": choice.reason if choice else None, "probe_gflops": choice.gflops if choice else None}


def precision_line(d: dict) -> str:
    infinity = (d["infinity_compute"] if d["infinity_stored"] == d["infinity_compute"] else
                f"{d['infinity_compute']} compute over {d['infinity_stored']}-stored parameters")
    text = f"precision {d['requested']}: infinity {infinity}, compute floor {d['floor']}"
    if d.get("deepspeed"):
        text += f", DeepSpeed {d['deepspeed']}"
    return text + (f" (auto: {d['auto_reason']})" if d.get("auto_reason") else "")


# ---------------------------------------------------------------- what /proc says

def proc_status(key="VmHWM"):
    """A /proc/self/status figure in bytes: VmHWM (peak RSS) or VmRSS (now)."""
    m = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def proc_io():
    d = dict(line.split(":") for line in Path("/proc/self/io").read_text().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


def cpu_mark():
    """(machine jiffies, machine busy jiffies, this process's jiffies)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    s = Path("/proc/self/stat").read_text()
    return sum(v), sum(v) - v[3] - v[4], sum(int(x) for x in s[s.rfind(")") + 2:].split()[11:13])


def foreign_share(m0, m1):
    """Share of the machine's CPU other processes used between two cpu_marks."""
    dt = m1[0] - m0[0]
    return round(max(0.0, ((m1[1] - m0[1]) - (m1[2] - m0[2])) / dt), 3) if dt > 0 else 0.0


def fs_type(path):
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        mnt, typ = line.split()[1:3]
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, typ
    return kind


def dir_bytes(path):
    return sum(os.stat(os.path.join(r, f)).st_blocks * 512 for r, _, fs in os.walk(path) for f in fs)


# ---------------------------------------------------------------- disk bandwidth

def disk_bandwidth(root, nbytes, seconds, threads, block=8 << 20) -> dict:
    """O_DIRECT writes alone, reads alone (``threads`` each), then both at once for ``seconds``."""
    from infinity.io import aligned_empty, probe_direct_io
    from infinity.io.syscalls import O_DIRECT
    direct = probe_direct_io(root)
    nblocks = max(threads, nbytes // block)
    bufs = [aligned_empty(block).fill_(0x5A) for _ in range(2 * threads)]
    paths = [os.path.join(root, f"disk_{w}.bin") for w in "ab"]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | (O_DIRECT if direct else 0), 0o600) for p in paths]
    try:
        for fd in fds:
            os.posix_fallocate(fd, 0, nblocks * block)

        def worker(fd, write, buf, first, stop=None):   # blocks first, first + threads, ... (cycling if stop)
            view, done, i = memoryview(buf.numpy()), 0, first
            while (i < nblocks) if stop is None else not stop.is_set():
                (os.pwritev if write else os.preadv)(fd, [view], (i % nblocks) * block)
                done, i = done + block, i + threads
            return done

        def alone(write):
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(threads) as pool:
                n = sum(pool.map(lambda t: worker(fds[0], write, bufs[t], t), range(threads)))
            if write:
                os.fdatasync(fds[0])
            return n / (time.perf_counter() - t0)

        write_alone = alone(True)   # also fills file a, which every read below reads
        read_alone = alone(False)
        stop = threading.Event()
        with cf.ThreadPoolExecutor(2 * threads) as pool:
            t0 = time.perf_counter()
            reads = [pool.submit(worker, fds[0], False, bufs[t], t, stop) for t in range(threads)]
            writes = [pool.submit(worker, fds[1], True, bufs[threads + t], t, stop) for t in range(threads)]
            time.sleep(seconds)
            stop.set()
            read = sum(f.result() for f in reads)
            dt_read = time.perf_counter() - t0
            written = sum(f.result() for f in writes)
            os.fdatasync(fds[1])   # a write counts once it is on the disk
            dt_write = time.perf_counter() - t0
    finally:
        for fd, p in zip(fds, paths):
            os.close(fd)
            os.unlink(p)
    return {"direct": direct, "block_bytes": block, "threads_each_side": threads, "file_bytes": nblocks * block,
            "write_alone_Bps": write_alone, "read_alone_Bps": read_alone,
            "mixed_read_Bps": read / dt_read, "mixed_write_Bps": written / dt_write, "mixed_s": round(dt_write, 2)}


# ---------------------------------------------------------------- the measurements run in children

def floor_depths(a) -> list:
    """[n_layer] when weights + grads in the floor's dtype (2 x its itemsize a param) fit in --floor-max-bytes,
    else two smaller depths."""
    per_param = 2 * DTYPES[a.dtypes["floor"]].itemsize
    fit = int((a.floor_max_bytes / per_param - param_count(0, a.n_embd, a.seq)) // layer_numel(a.n_embd))
    return [a.n_layer] if fit >= a.n_layer else [max(1, fit // 2), max(2, fit)]


def child_floor(a) -> dict:
    from transformers import GPT2LMHeadModel
    depths, times, fastest, foreign = floor_depths(a), {}, {}, []
    for depth in depths:
        torch.manual_seed(a.seed)
        torch.set_default_dtype(DTYPES[a.dtypes["floor"]])   # built in its dtype: no other copy ever exists
        model = GPT2LMHeadModel(model_config(a, depth)).train()
        torch.set_default_dtype(torch.float32)
        ts = []
        for step in range(a.warmup + a.steps):
            x, cpu0 = batch(step, a), cpu_mark()
            t0 = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            ts.append(time.perf_counter() - t0)
            foreign.append(foreign_share(cpu0, cpu_mark()))
            model.zero_grad(set_to_none=False)   # keep the gradient buffers, as a real step would
        times[depth], fastest[depth] = median(ts[a.warmup:]), min(ts[a.warmup:])
        del model
    lo, hi = depths[0], depths[-1]
    at_depth = lambda t: t[hi] + (a.n_layer - hi) * ((t[hi] - t[lo]) / (hi - lo) if hi > lo else 0)
    return {"floor_s": at_depth(times), "floor_min_s": at_depth(fastest), "dtype": a.dtypes["floor"],
            "extrapolated": len(depths) > 1,
            "measured_depths": depths, "median_s_at_depths": times, "foreign_cpu": foreign}


def child_train(a) -> dict:
    from transformers import GPT2LMHeadModel

    import infinity
    rss0 = proc_status("VmRSS")
    predicted = predicted_rss(a, rss0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(model_config(a)).train()
    torch.manual_seed(a.seed)   # right before materializing: the draws follow module order, as the peer's
    t0 = time.perf_counter()
    model, opt = infinity.initialize(model, a.conf, init_fn=lambda m: gpt2_init_(m, a.n_layer))
    engine = infinity.engine_of(model)
    setup_s, setup_hwm, swap_after_setup = time.perf_counter() - t0, proc_status(), dir_bytes(a.swap_dir)
    ctypes.CDLL("libc.so.6").malloc_trim(0)   # as the peers do after set-up: freed heap is not the steps'
    rss_before_steps, hwm_reset = proc_status("VmRSS"), reset_peak_rss()
    if hasattr(getattr(engine, "memory", None), "enable"):
        engine.memory.enable()   # the engine's per-step breakdown; it resets VmHWM after each step itself
    rows, reports = [], []
    for step in range(a.warmup + a.steps):
        x, io0, cpu0 = batch(step, a), proc_io(), cpu_mark()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        io1, last = proc_io(), engine.stats.last_step   # last: the step just ended (its bytes per tier pair)
        offload = last.get("offload") or {}
        reports.append(engine.memory_report() if hasattr(engine, "memory_report") else None)
        # the step's own peak: the memory report resets VmHWM as each step ends, so VmHWM read now is only
        # the time since that reset (about the RSS at the step's end)
        step_peak = (reports[-1] or {}).get("peak_rss_bytes") or proc_status()
        rows.append({"loss": round(loss.item(), 4), "step_s": t3 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1,
                     "optimizer_s": t3 - t2, "disk_read_bytes": io1[0] - io0[0], "disk_write_bytes": io1[1] - io0[1],
                     "moved_bytes": offload.get("moved_bytes", {}),
                     "host_resident_bytes": offload.get("host_resident_bytes", 0),
                     **{k: offload.get(k) for k in ("spills", "swap_in_wait_s", "adam_s")},
                     "foreign_cpu": foreign_share(cpu0, cpu_mark()), "peak_rss_bytes": step_peak})
        print(f"[infinity] step {step}{' (warm-up)' if step < a.warmup else ''} loss {rows[-1]['loss']:.4f} "
              f"{t3 - t0:.2f}s (fwd {t1 - t0:.2f} bwd {t2 - t1:.2f} step {t3 - t2:.2f}) peak RSS "
              f"{step_peak / GIB:.2f} GiB, spills {rows[-1]['spills']}, Adam's swap-in wait "
              f"{rows[-1]['swap_in_wait_s'] or 0:.1f}s, other processes' CPU {rows[-1]['foreign_cpu']:.0%}", file=sys.stderr,
              flush=True)
    meas = rows[a.warmup:]
    peak_rss, source = proc_status(), "engine.resident_bytes() (this engine has no memory_report)"
    breakdown = engine.resident_bytes()
    if any(reports):   # the step with the highest peak; the run's peak since enable(), i.e. after set-up
        breakdown = max((r for r in reports if r), key=lambda r: r.get("peak_rss_bytes") or 0)
        peak_rss, source = reports[-1].get("run_peak_rss_bytes") or peak_rss, "engine.memory_report(), peak step"
        if predicted and "error" not in predicted:   # the bound with the activations this run saved (and their share of the slack) put in
            act = max(r.get("activation_bytes") or 0 for r in reports if r)
            predicted["bound_bytes"] = predicted["bound_without_activations"]["total_bytes"] + \
                int(act * (1 + predicted["slack_fraction"]))
    store = engine.store.stats()
    out = {"n_params": sum(p.numel() for p in model.parameters()), "setup_s": setup_s, "rss_before_model": rss0,
           "engine_config": engine.config.to_dict(),   # what ran: an auto config's choice
           "setup_hwm": setup_hwm, "rss_before_steps": rss_before_steps, "hwm_reset_after_setup": hwm_reset,
           "peak_rss": peak_rss, "memory_breakdown": {"source": source, "report": breakdown}, "predicted": predicted,
           "losses": [r["loss"] for r in rows], "steps": rows, "step_s": median([r["step_s"] for r in meas]),
           "phases_s": {k: median([r[k] for r in meas]) for k in ("forward_s", "backward_s", "optimizer_s")},
           "moved_bytes_per_step": {k: median([r["moved_bytes"].get(k, 0) for r in meas])
                                    for k in sorted({k for r in meas for k in r["moved_bytes"]})},
           "disk_read_bytes_per_step": median([r["disk_read_bytes"] for r in meas]),
           "disk_write_bytes_per_step": median([r["disk_write_bytes"] for r in meas]),
           "store": {k: store[k] for k in ("budget_bytes", "peak_bytes", "evictions")},
           "max_live_bytes": engine.max_live_bytes,
           "swap_dir_bytes": {"after_setup": swap_after_setup, "after_steps": dir_bytes(a.swap_dir)}}
    engine.close()
    return out


def run_child(kind, a) -> dict:
    """This file again, as a child (its own VmHWM): its JSON comes back through a file, its log to stderr."""
    path = os.path.join(a.swap_root, f"{kind}.json")
    t0 = time.perf_counter()
    args = json.dumps(dict(vars(a), child=kind, child_out=path))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-args", args], check=False,
                       stdout=sys.stderr, timeout=a.timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"the {kind} child exited with {p.returncode} (its log is above)")
    return dict(json.loads(Path(path).read_text()), wall_s=time.perf_counter() - t0)


# ---------------------------------------------------------------- the DeepSpeed peer

def peers_root() -> str:
    return os.environ.get("PEERS_ROOT", "/work/peers-out")


def ds_partition_parameters(py: str) -> Path | None:
    """The peers venv's ``deepspeed/runtime/zero/partition_parameters.py`` (found without importing
    DeepSpeed), or None where DeepSpeed is not there."""
    find = "import importlib.util as u; s = u.find_spec('deepspeed'); print(s.origin if s else '')"
    p = subprocess.run([py, "-c", find], check=False, capture_output=True, text=True)
    origin = p.stdout.strip() if p.returncode == 0 else ""
    return Path(origin).parent / "runtime" / "zero" / "partition_parameters.py" if origin else None


def ds_set_dtype_state(path: Path | None) -> str:
    """``"fixed"``, ``"unfixed"`` (a given fp32 dtype is lost on a CPU without fp16 kernels: DS_SET_DTYPE_BUG)
    or ``"unknown"`` (neither text: another DeepSpeed; or no such file)."""
    if path is None or not path.exists():
        return "unknown"
    text = path.read_text()
    return "unfixed" if DS_SET_DTYPE_BUG.search(text) else "fixed" if DS_SET_DTYPE_FIXED in text else "unknown"


def fix_deepspeed_set_dtype() -> int:
    """``--fix-deepspeed-set-dtype``: the peers README's fix of DeepSpeed's Init._set_dtype, applied to
    $PEERS_ROOT/venv (the old file kept beside it as .orig)."""
    py = os.path.join(peers_root(), "venv", "bin", "python")
    path = ds_partition_parameters(py) if os.path.exists(py) else None
    if path is None or not path.exists():
        print(f"no DeepSpeed in {peers_root()}/venv ($PEERS_ROOT): set it up first", file=sys.stderr)
        return 1
    state = ds_set_dtype_state(path)
    if state != "unfixed":
        print(f"{path}: Init._set_dtype {'already fixed' if state == 'fixed' else 'not the 0.19.8 text: not changed'}")
        return 0 if state == "fixed" else 1
    text = path.read_text()
    shutil.copy2(path, str(path) + ".orig")
    path.write_text(DS_SET_DTYPE_BUG.sub(lambda m: DS_SET_DTYPE_FIXED, text, count=1))
    print(f"{path}: Init._set_dtype fixed (a given dtype is kept; the original is {path.name}.orig beside it)")
    return 0


def run_deepspeed(a) -> dict:
    root, dtype = peers_root(), a.dtypes["deepspeed"]
    py, config = os.path.join(root, "venv", "bin", "python"), "E" if a.n_params < 1e9 else "F0"
    if not os.path.exists(py) or subprocess.run([py, "-c", "import deepspeed"], check=False,
                                                capture_output=True).returncode:
        return {"error": DS_SETUP.format(root=root, peers=a.peers_dir, python=sys.executable,
                                         tool=os.path.abspath(__file__))}
    if a.size not in PEER_SIZES or a.n_layer != SIZES[a.size][0]:
        return {"error": f"the peers' scripts know {', '.join(PEER_SIZES)} at their own depth, not {a.size} "
                         f"with {a.n_layer} layers"}
    if dtype not in ("bf16", "fp32"):
        return {"error": f"infinity computes in {dtype}; the peers' scripts run bf16 or fp32 only"}
    set_dtype = ds_set_dtype_state(ds_partition_parameters(py))
    if dtype == "fp32" and set_dtype == "unfixed":
        return {"error": f"DeepSpeed in {root}/venv would cast the fp32 model to bf16 (Init._set_dtype, "
                         f"{a.peers_dir}/README.md); fix it once: PEERS_ROOT={root} {sys.executable} "
                         f"{os.path.abspath(__file__)} --fix-deepspeed-set-dtype"}
    name = f"bench_scale_{config}_{a.size}_{dtype}"
    env = dict(os.environ, PEERS_ROOT=root, PEERS_NAME=name, PEERS_SWAP=os.path.join(a.swap_root, "deepspeed"),
               PEERS_IDLE_WAIT_S=os.environ.get("PEERS_IDLE_WAIT_S", "0"),   # no idle gate: measured as we are
               PEERS_MAX_EXTRA=os.environ.get("PEERS_MAX_EXTRA", "0"))       # and over as many steps
    cmd = [os.path.join(a.peers_dir, "peers.sh"), config, a.size, dtype, "1", "--", "--warmup", str(a.warmup),
           "--steps", str(a.steps), "--threads", str(a.threads), "--seq", str(a.seq), "--mbs", str(a.mbs)]
    print(f"[deepspeed] {' '.join(cmd)}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, check=False, env=env, stdout=sys.stderr, timeout=a.timeout_s)
    path = Path(os.environ.get("PEERS_RESULTS", os.path.join(root, "results")), name + ".json")
    res = json.loads(path.read_text()) if path.exists() else {}
    if p.returncode or "step_median_s" not in res:
        return {"error": f"peers.sh {config} failed (exit {p.returncode}); its log: {root}/logs/{name}.log"}
    return {"config": config, "dtype": dtype, "set_dtype_fix": set_dtype, "step_s": res["step_median_s"],
            "losses": res.get("losses"),
            "phases_s": {"forward_s": res["fwd_median_s"], "backward_s": res["bwd_median_s"],
                         "optimizer_s": res["opt_median_s"]},
            "peak_rss": res["peak_rss_train_per_rank"][0], "peak_rss_incl_setup": res["peak_rss_per_rank"][0],
            "disk_read_bytes_per_step": res["swap_read_bytes_per_step"],
            "disk_write_bytes_per_step": res["swap_write_bytes_per_step"],
            "swap_dir_bytes": res.get("swap_dir_bytes_on_disk"), "foreign_cpu": res.get("foreign_cpu_share_per_step"),
            "result_file": str(path)}


# ---------------------------------------------------------------- the run

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=list(SIZES))
    ap.add_argument("--n-layer", type=int, help="another depth at the size's width (--dry-run says what fits)")
    ap.add_argument("--host-bytes", default="3GiB")
    ap.add_argument("--device-bytes", default="1GiB", help="on CPU the device tier is host RAM too")
    ap.add_argument("--nvme-path", help="where the fresh swap directory goes (default: the repo's parent, or /tmp)")
    ap.add_argument("--warmup", type=int, help="default 2 below 1B params, else 1")
    ap.add_argument("--steps", type=int, help="measured steps; default 5 below 1B params, else 3")
    ap.add_argument("--config", help="a config file instead of the built-in one, e.g. configs/auto.yaml (the planner "
                    "picks at initialize within --host-bytes / --device-bytes, which an auto config takes as all the "
                    "device memory the engine may use); the workload's optimizer hyper-parameters are kept")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="infinity config override")
    ap.add_argument("--precision", choices=PRECISIONS, help="infinity's precision.param_dtype (default: the --config "
                    "file's, else auto: measured on this CPU); the compute floor and the peer compute in infinity's "
                    "compute dtype (auto on a CPU without fast bf16: fp32)")
    ap.add_argument("--peer", choices=["deepspeed"], help="also run DeepSpeed ZeRO-Infinity (../shared/peers)")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", os.path.join(os.path.dirname(REPO), "shared",
                                                                                  "peers")))
    ap.add_argument("--disk-bytes", type=parse_size, default=parse_size("2GiB"), help="disk test file size")
    ap.add_argument("--disk-seconds", type=float, default=5.0, help="length of the reads-and-writes-at-once test")
    ap.add_argument("--floor-max-bytes", type=parse_size, default=parse_size("6GiB"),
                    help="most bf16 weights + grads the floor holds; past it, two depths extrapolated")
    ap.add_argument("--timeout-s", type=float, default=4 * 3600, help="per child process")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout (the progress goes to stderr)")
    ap.add_argument("--dry-run", action="store_true", help="print the config, parameters and disk check; run nothing")
    ap.add_argument("--fix-deepspeed-set-dtype", action="store_true", help="apply the peers README's fix of "
                    "DeepSpeed's Init._set_dtype to $PEERS_ROOT/venv (fp32 peer runs need it) and exit")
    a = ap.parse_args(argv)
    _, a.n_embd, a.n_head = SIZES[a.size]
    a.n_layer = a.n_layer or SIZES[a.size][0]
    a.seq, a.mbs, a.seed, a.threads = 256, 2, 1234, 2
    a.n_params = param_count(a.n_layer, a.n_embd, a.seq)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.n_params >= 1e9 else 2)
    a.steps = a.steps if a.steps is not None else (3 if a.n_params >= 1e9 else 5)
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    return a


def swap_parent(a):
    """A directory on a disk (not tmpfs) for the fresh swap directory, and its file system type."""
    for cand in [a.nvme_path] if a.nvme_path else [os.path.dirname(REPO), tempfile.gettempdir()]:
        kind = fs_type(os.path.realpath(cand))
        if kind not in ("tmpfs", "ramfs"):
            return cand, kind
    sys.exit(f"{a.nvme_path or 'the repo parent and /tmp'}: on {kind}, which is RAM; give --nvme-path on a disk")


def code_version() -> str:
    """HEAD, and whether infinity/ differs from it (other work in the same checkout changes what runs)."""
    def git(*cmd):
        return subprocess.run(["git", "-C", REPO, *cmd], check=False, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes in infinity/"
                                                  if git("status", "--porcelain", "infinity") else "")


def report(r):
    """The human-readable summary of the JSON ``r``."""
    g, w, i, d, f = (lambda n: f"{n / 1e9:.2f} GB"), r["workload"], r["infinity"], r["disk"], r["floor"]
    phases = "fwd {forward_s:.2f} / bwd {backward_s:.2f} / step {optimizer_s:.2f}".format
    print(hardware_line(r["hardware"]))
    print(f"GPT-2 {w['size']} ({w['n_layer']}x{w['n_embd']}x{w['n_head']}, {w['n_params'] / 1e9:.3f}B params), seq "
          f"{w['seq']} x {w['mbs']}, fp32 master, ZeRO-3, params + grads + optimizer on NVMe; {w['warmup']} "
          f"warm-up + {w['steps']} measured steps (medians); code {r['code']}")
    print(precision_line(r["precision"]))
    print(f"budgets: host {r['budgets']['host_bytes']}, device {r['budgets']['device_bytes']} (RAM on CPU); swap on "
          f"{r['swap_fs']}; load average before {' '.join(r['load_before'])}, after {' '.join(r['load_after'])}")
    print(f"disk ({'O_DIRECT' if d['direct'] else 'buffered'} 8 MiB, {d['threads_each_side']} threads a side): write "
          f"{g(d['write_alone_Bps'])}/s, read {g(d['read_alone_Bps'])}/s alone; at once: read "
          f"{g(d['mixed_read_Bps'])}/s + write {g(d['mixed_write_Bps'])}/s")
    how = f", measured at {f['measured_depths']} layers and extrapolated per layer" if f["extrapolated"] else ""
    print(f"compute floor: {f['floor_s']:.2f} s (fastest step {f['floor_min_s']:.2f} s), {f['dtype']} forward + "
          f"backward, weights in RAM{how}; other processes' CPU per step {f['foreign_cpu']}")
    b, m = r["io_bound"], i["memory_breakdown"]
    if wants_auto(r["infinity_config"]):
        c = i["engine_config"]
        print(f"auto chose: stage {c['zero']['stage']}, offload {c['offload']}, optimizer master "
              f"{c['optimizer']['master']} / moments {c['optimizer']['moments']}, update at "
              f"{c['optimizer']['update_at']}, checkpointing {c['zero']['activation_checkpointing']}, "
              f"tiers {c['tiers']['host_bytes']} / {c['tiers']['device_bytes']}")
    print(f"infinity: step {i['step_s']:.2f} s ({phases(**i['phases_s'])}); losses {i['losses']}; other "
          f"processes' CPU per step {[s['foreign_cpu'] for s in i['steps']]}")
    print(f"  peak RSS {i['peak_rss'] / GIB:.2f} GiB over the steps (VmHWM "
          f"{'reset after set-up' if i['hwm_reset_after_setup'] else 'NOT reset: includes set-up'}), set-up "
          f"{i['setup_hwm'] / GIB:.2f} GiB; predicted bound (infinity.estimate.peak_rss + the activations measured) "
          f"{(i['predicted'] or {}).get('bound_bytes', 0) / GIB:.2f} GiB\n  {m['source']}: "
          f"{json.dumps(m['report'], default=str)}")
    print("  bytes per step: " + ", ".join(f"{k} {g(v)}" for k, v in i["moved_bytes_per_step"].items())
          + f"; /proc/self/io read {g(i['disk_read_bytes_per_step'])}, write {g(i['disk_write_bytes_per_step'])}; "
          f"swap dir {g(i['swap_dir_bytes']['after_setup'])} after set-up, {g(i['swap_dir_bytes']['after_steps'])} "
          "after the steps")
    print(f"  I/O bound {b['io_bound_s']:.2f} s = max(R / read at once, W / write at once) = max({g(b['read_bytes'])} "
          f"/ {g(d['mixed_read_Bps'])}/s, {g(b['write_bytes'])} / {g(d['mixed_write_Bps'])}/s); serial R / read "
          f"alone + W / write alone {b['serial_s']:.2f} s; the best mix of both {b['lower_bound_s']:.2f} s; step / "
          f"max(floor, I/O bound) {b['step_over_bound']:.2f}")
    p = r.get("deepspeed")
    if p and "error" in p:
        print(f"deepspeed: NOT MEASURED: {p['error']}")
    elif p:
        print(f"deepspeed ({p['config']}, {p['dtype']}): step {p['step_s']:.2f} s ({phases(**p['phases_s'])}); "
              f"peak RSS {p['peak_rss'] / GIB:.2f} GiB; disk read {g(p['disk_read_bytes_per_step'])}, write "
              f"{g(p['disk_write_bytes_per_step'])} per step; I/O bound {p['io_bound_s']:.2f} s; losses {p['losses']}; "
              f"other processes' CPU per step {p['foreign_cpu']}")
        print("infinity / deepspeed: " + (", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items())
                                          if "ratios" in r else r["ratios_withheld"]))


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--child-args":
        a = argparse.Namespace(**json.loads(sys.argv[2]))
        torch.set_num_threads(a.threads)
        Path(a.child_out).write_text(json.dumps(child_floor(a) if a.child == "floor" else child_train(a), default=str))
        return 0
    a = parse_args(argv)
    if a.fix_deepspeed_set_dtype:
        return fix_deepspeed_set_dtype()
    torch.set_num_threads(a.threads)   # the record says the threads the children run with
    hardware = hardware_record(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    print(hardware_line(hardware), file=sys.stderr, flush=True)
    parent, fs = swap_parent(a)
    a.swap_dir = os.path.join(parent, "bench_scale_<fresh>")   # named for real once the run starts
    a.conf = infinity_config(a)
    a.dtypes = resolve_dtypes(a)
    print(precision_line(a.dtypes), file=sys.stderr, flush=True)
    need, free = disk_need(a), shutil.disk_usage(parent).free
    per_param = max(need["infinity_swap"], need["deepspeed_swap"]) / a.n_params
    largest = int(((free - 5 * GIB) / per_param - param_count(0, a.n_embd, a.seq)) // layer_numel(a.n_embd))
    workload = {k: getattr(a, k) for k in ("size", "n_layer", "n_embd", "n_head", "n_params", "seq", "mbs", "seed",
                                           "threads", "warmup", "steps")}
    if a.dry_run:
        from transformers import GPT2LMHeadModel
        with torch.device("meta"):
            built = sum(p.numel() for p in GPT2LMHeadModel(model_config(a)).parameters())
        assert built == a.n_params, f"parameter count: formula {a.n_params}, model {built}"
        depths = floor_depths(a)
        floor = f"full depth {depths[0]}" if len(depths) == 1 else \
            f"at {depths} layers, extrapolated per layer ({a.dtypes['floor']} weights + grads past --floor-max-bytes)"
        print(json.dumps({"workload": workload, "training_state_bytes_16_per_param": 16 * a.n_params,
                          "hardware": hardware, "precision": a.dtypes, "infinity_config": a.conf,
                          "swap_parent": parent, "swap_fs": fs, "disk_need_bytes": need,
                          "disk_free_bytes": free, "largest_n_layer_for_free_disk": largest, "compute_floor": floor,
                          "predicted_rss": predicted_rss(a), "peer": a.peer and ("E" if a.n_params < 1e9 else "F0")},
                         indent=1))
    if free < need["total"]:
        print(f"refusing: {parent} has {format_size(free)} free, this run needs {format_size(need['total'])} (infinity "
              f"swap {format_size(need['infinity_swap'])}, DeepSpeed swap {format_size(need['deepspeed_swap'])}, disk "
              f"test {format_size(need['disk_test'])}, the largest of them + 4 GiB). Free space, give --nvme-path on "
              f"a larger disk, or lower --n-layer (at most {largest} at this width here)", file=sys.stderr)
        return 1
    if a.dry_run:
        return 0
    a.swap_root = tempfile.mkdtemp(prefix="bench_scale_", dir=parent)
    a.swap_dir = os.path.join(a.swap_root, "infinity")
    a.conf = infinity_config(a)
    r = {"workload": workload, "hardware": hardware, "precision": a.dtypes,
         "budgets": {"host_bytes": a.host_bytes, "device_bytes": a.device_bytes},
         "infinity_config": a.conf, "swap_fs": fs, "code": code_version(),
         "load_before": Path("/proc/loadavg").read_text().split()[:3]}
    try:
        print(f"[disk] {format_size(a.disk_bytes)} file; reads and writes at once for {a.disk_seconds} s",
              file=sys.stderr, flush=True)
        threads = a.conf.get("io", {}).get("threads", 4)   # the engine's I/O threads, on each side
        r["disk"] = d = disk_bandwidth(a.swap_root, a.disk_bytes, a.disk_seconds, threads)
        r["floor"] = run_child("floor", a)
        r["infinity"] = i = run_child("train", a)
        ran = i["engine_config"]["precision"]   # what initialize resolved, on the engine's device
        r["precision"].update(infinity_stored=ran["param_dtype"], infinity_compute=ran["compute_dtype"])
        rd, wr = i["moved_bytes_per_step"].get("nvme->host", 0), i["moved_bytes_per_step"].get("host->nvme", 0)
        bound = max(rd / d["mixed_read_Bps"], wr / d["mixed_write_Bps"])
        serial = rd / d["read_alone_Bps"] + wr / d["write_alone_Bps"]
        both = min(rd / d["mixed_read_Bps"], wr / d["mixed_write_Bps"])   # then the rest alone: T linear in both
        rest = (rd - d["mixed_read_Bps"] * both) / d["read_alone_Bps"] + (wr - d["mixed_write_Bps"] * both) / \
            d["write_alone_Bps"]
        r["io_bound"] = {"read_bytes": rd, "write_bytes": wr, "io_bound_s": bound, "serial_s": serial,
                         "lower_bound_s": min(serial, both + rest),   # the best mix of overlapped and alone
                         "formula": "max(R / mixed_read_Bps, W / mixed_write_Bps); R, W: the store's nvme->host, "
                                    "host->nvme bytes per step",
                         "step_over_bound": i["step_s"] / max(bound, r["floor"]["floor_s"])}
        r["budgets"].update(resolved=i["store"]["budget_bytes"], max_live_bytes=i["max_live_bytes"])
        if a.peer:
            r["deepspeed"] = p = run_deepspeed(a)
            if "error" not in p:
                moved = lambda x: x["disk_read_bytes_per_step"] + x["disk_write_bytes_per_step"]
                p["io_bound_s"] = max(p["disk_read_bytes_per_step"] / d["mixed_read_Bps"],
                                      p["disk_write_bytes_per_step"] / d["mixed_write_Bps"])
                if p["dtype"] == ran["compute_dtype"]:
                    r["ratios"] = {"step": i["step_s"] / p["step_s"], "peak_rss": i["peak_rss"] / p["peak_rss"],
                                   "disk_bytes": moved(i) / max(1, moved(p))}
                else:   # the engine resolved auto otherwise than this CPU's probe (it ran on another device)
                    r["ratios_withheld"] = (f"infinity computed in {ran['compute_dtype']}, DeepSpeed in "
                                            f"{p['dtype']}: no ratio between them")
    finally:
        shutil.rmtree(a.swap_root, ignore_errors=True)
    r["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    if a.json:
        print(json.dumps(r, default=str))
    else:
        report(r)
    if "error" in r.get("deepspeed", {}):
        print(f"deepspeed peer NOT MEASURED: {r['deepspeed']['error']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
