"""The stages of ``tools/gpu_check.sh``: what a first run on a GPU must show, each stage one JSON file.

``python tools/gpu_check.py STAGE --out DIR`` writes ``DIR/STAGE.json`` (``{"stage", "ok", ...}``)
and exits 0 when ``ok``:

- ``smoke``: the imports, one pinned round trip (page-locked bytes = the request rounded to pages,
  given back when freed), one world-size-1 collective (NCCL on CUDA, gloo on CPU), one offloaded
  step compared with the in-memory engine's.
- ``loss``: an offloaded run (ZeRO-3, parameters and optimizer on NVMe, gradients on host, budgets
  ``auto``, nothing host-resident) against the in-memory run, same seed and data, loss by loss; with
  the pinned bytes, the host budget, the device peak and the device budget the run ended with.
- ``race``: copies that would read stale bytes if an ordering wait were missing. The producing
  stream and the copy streams are delayed with ``torch.cuda._sleep``, and the results must be
  bitwise equal to the undelayed ones: at the copier, for gradient folds into stored shards (the
  device->host copy on the side stream, claimed or staged), and for whole offloaded training steps
  (gradients on host; and on NVMe with two micro-batches, so accumulation folds run too).
- ``profile``: one offloaded step under ``torch.profiler``; from its trace, how much of the
  host<->device copy time overlapped kernels (``copy_overlap``).

Everything but ``race`` and the profile's CUDA figures also runs on CPU (the device is then plain
memory), which is how the tests check this file. Every stage's JSON records the machine
(``hardware``: :func:`infinity.precision.hardware_record` of the compute device) and the training runs
the dtypes their engines resolved.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import inspect
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS: the race stage compares bits

import torch  # noqa: E402

STAGES = ("smoke", "loss", "race", "profile")
SLEEP_CYCLES = 2_000_000   # ~1 ms on a current GPU: longer than any copy here, so a missing wait shows


def _scratch():
    """A scratch directory for swap files and the process group's rendezvous: under $TMPDIR, never the
    output directory (a stage killed by its timeout must not leave gigabytes of swap to ship back)."""
    return tempfile.TemporaryDirectory(prefix="infinity_gpu_check_")


def compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ---------------------------------------------------------------- training runs shared by the stages

def offload_config(swap_dir: str, host_bytes="auto", device_bytes="auto", host_resident_bytes="auto") -> dict:
    return {"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "params": "nvme", "grads": "host",
                                              "host_resident_bytes": host_resident_bytes},
            "tiers": {"nvme_path": swap_dir, "host_bytes": host_bytes, "device_bytes": device_bytes},
            "optimizer": {"lr": 1e-3}}


def in_memory_config() -> dict:
    return {"zero": {"stage": 3}, "optimizer": {"lr": 1e-3}}


def batch(step: int, batch_size: int, seq_len: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(1000 + step))


def train(model_name: str, conf: dict, steps: int, batch_size: int, seq_len: int, seed: int = 0,
          params: bool = False, around_step=None, micro_batches: int = 1) -> dict:
    """``steps`` steps of the built-in GPT ``model_name``; losses, stats, memory report (and final params).
    ``around_step(step)``: a context manager entered around each step (the race's delays, the profiler).
    ``micro_batches``: backwards per step (gradient accumulation); the loss recorded is the last one's."""
    import infinity
    from infinity.models import GPT, gpt_config

    torch.manual_seed(seed)
    cfg = gpt_config(model_name)
    model, opt = infinity.initialize(GPT(cfg), conf)
    engine = infinity.engine_of(model)
    engine.memory.enable(activations=False)
    losses, step_s = [], []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            with around_step(step) if around_step is not None else contextlib.nullcontext():
                for micro in range(micro_batches):
                    ids = batch(step * micro_batches + micro, batch_size, seq_len, cfg.vocab_size).to(engine.device)
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            step_s.append(time.perf_counter() - t0)
        out = {"losses": losses, "step_s": step_s, "memory": engine.memory_report(),
               "engine": {k: v for k, v in engine.stats.last_step.items() if k.endswith("_s")},
               "precision": {"param_dtype": engine.config.precision.param_dtype,
                             "compute_dtype": engine.config.precision.compute_dtype}}
        if engine.store is not None:
            st = engine.store.stats()
            out["store"] = {"budget_bytes": st["budget_bytes"], "peak_bytes": st["peak_bytes"],
                            "pinned_bytes": st["host_pool"]["pinned_bytes"],
                            "peak_pinned_bytes": st["host_pool"]["peak_pinned_bytes"],
                            "host_pool_bytes": st["host_pool"]["in_use_bytes"] + st["host_pool"]["cached_bytes"]}
        if params:
            with engine.gathered():
                out["params"] = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return out


def compare_losses(got: list, ref: list, rel_tol: float) -> dict:
    """Step by step relative loss difference of ``got`` against ``ref``; ok when every one is within
    ``rel_tol`` and both are finite and equally long."""
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref)]
    finite = all(math.isfinite(x) for x in list(got) + list(ref))
    return {"ok": finite and len(got) == len(ref) > 0 and max(diffs, default=math.inf) <= rel_tol,
            "max_rel_diff": max(diffs, default=None), "rel_tol": rel_tol, "steps": len(got)}


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


# ---------------------------------------------------------------- stage: smoke

def pinned_round_trip(device: torch.device, nbytes: int = 64 * 2**20 + 4096) -> dict:
    """One buffer through the store's pinned allocator, host -> device -> host on the copier's lanes."""
    from infinity.store.device_copy import DeviceCopier
    from infinity.store.pinned_host import CudaHostRegistrar, PinnedHostMemory, round_to_pages

    if device.type != "cuda":
        return {"ok": True, "skipped": "no CUDA device: host buffers are not page-locked"}
    mem = PinnedHostMemory(CudaHostRegistrar(device))
    src, back = mem.allocate(nbytes), mem.allocate(nbytes)
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
    copier = DeviceCopier(device)
    try:
        dev = torch.empty(src.numel(), dtype=torch.uint8, device=device)
        copier.to_device(dev, src).result()
        copier.to_host(back, dev).result()
    finally:
        copier.close()
    out = {"requested_bytes": nbytes, "pinned_bytes": mem.stats()["pinned_bytes"],
           "expected_pinned_bytes": 2 * round_to_pages(nbytes),
           "caching_allocator_would_pin_bytes": 2 * 2 ** math.ceil(math.log2(nbytes)),
           "is_pinned": bool(src.is_pinned()), "equal": bool(torch.equal(src, back))}
    mem.free(src)
    mem.free(back)
    out["pinned_after_free_bytes"] = mem.stats()["pinned_bytes"]
    out["ok"] = (out["is_pinned"] and out["equal"] and out["pinned_bytes"] == out["expected_pinned_bytes"]
                 and out["pinned_after_free_bytes"] == 0)
    return out


def one_collective(device: torch.device, tmp: str) -> dict:
    """A world-size-1 all-reduce through torch.distributed (NCCL on CUDA), then the group is gone again."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{tmp}/pg", rank=0, world_size=1, **kwargs)
    try:
        t = torch.arange(1024, dtype=torch.float32, device=device)
        dist.all_reduce(t)
        ok = torch.equal(t.cpu(), torch.arange(1024, dtype=torch.float32))
    finally:
        dist.destroy_process_group()
    return {"ok": bool(ok), "backend": backend}


def smoke(out_dir: Path, steps: int = 2) -> dict:
    import infinity

    device = compute_device()
    info = {"infinity": infinity.__file__, "device": str(device)}   # the machine: run_stage's "hardware"
    with _scratch() as tmp:
        pinned = pinned_round_trip(device)
        collective = one_collective(device, tmp)
        ref = train("tiny", in_memory_config(), steps, 4, 64, params=True)
        got = train("tiny", offload_config(tmp, host_bytes="4MiB", device_bytes="2MiB"), steps, 4, 64, params=True)
    losses = compare_losses(got["losses"], ref["losses"], rel_tol=1e-4)
    param_diff = max_param_diff(got["params"], ref["params"])
    offloaded = {"losses": got["losses"], "in_memory_losses": ref["losses"], **losses,
                 "max_param_abs_diff": param_diff, "store": got.get("store"), "precision": got["precision"],
                 "ok": losses["ok"] and param_diff <= 1e-4}
    return {**info, "pinned": pinned, "collective": collective, "offloaded_step": offloaded,
            "ok": pinned["ok"] and collective["ok"] and offloaded["ok"]}


# ---------------------------------------------------------------- stage: loss

def loss(out_dir: Path, model: str = "125m", steps: int = 5, batch_size: int = 4, seq_len: int = 256,
         rel_tol: float = 2e-3) -> dict:
    with _scratch() as tmp:
        ref = train(model, in_memory_config(), steps, batch_size, seq_len)
        # auto budgets, and nothing kept host-resident: every state streams through the disk each step
        got = train(model, offload_config(tmp, host_resident_bytes=0), steps, batch_size, seq_len)
    cmp = compare_losses(got["losses"], ref["losses"], rel_tol)
    mem, store = got["memory"] or {}, got.get("store") or {}
    budgets = store.get("budget_bytes", {})
    summary = {"pinned_bytes": store.get("pinned_bytes"), "peak_pinned_bytes": store.get("peak_pinned_bytes"),
               "host_budget_bytes": budgets.get("host"), "device_budget_bytes": budgets.get("device"),
               "device_peak_bytes": mem.get("device_peak_bytes"),
               "device_reserved_bytes": mem.get("device_reserved_bytes"), "store_peak_bytes": store.get("peak_bytes")}
    within = (summary["peak_pinned_bytes"] is None or summary["host_budget_bytes"] is None
              or summary["peak_pinned_bytes"] <= summary["host_budget_bytes"])
    return {"model": model, "steps": steps, "batch_size": batch_size, "seq_len": seq_len, **cmp,
            "ok": cmp["ok"] and within, "pinned_within_host_budget": within, **summary,
            "losses": got["losses"], "in_memory_losses": ref["losses"],
            "step_s": got["step_s"], "in_memory_step_s": ref["step_s"], "precision": got["precision"],
            "engine_last_step": got["engine"], "in_memory_engine_last_step": ref["engine"]}


# ---------------------------------------------------------------- stage: race

@contextlib.contextmanager
def delayed_streams(step: int = 0, cycles: int = SLEEP_CYCLES):
    """While inside: every module's forward and every copier lane's copy first sleep ``cycles`` on their
    stream, so a consumer that does not wait for its producer reads the bytes from before."""
    from infinity.store.device_copy import CopyLane

    original = CopyLane._copy

    def slow_copy(self, dst, src, ready):
        if self.cuda:
            self.stream.wait_event(ready)   # the sleep goes after what the copy waits for, before the copy
            torch.cuda._sleep(cycles)       # on the lane's stream: its thread's current stream
        return original(self, dst, src, ready)

    def slow_forward(module, args):
        torch.cuda._sleep(cycles)           # on the compute stream, before the module's kernels

    def slow_backward(module, grad_output):
        torch.cuda._sleep(cycles)           # before the module's gradient kernels: the folds' producers
    handles = [torch.nn.modules.module.register_module_forward_pre_hook(slow_forward),
               torch.nn.modules.module.register_module_full_backward_pre_hook(slow_backward)]
    CopyLane._copy = slow_copy
    try:
        yield
    finally:
        CopyLane._copy = original
        for handle in handles:
            handle.remove()


def copier_race(device: torch.device, rounds: int = 32, numel: int = 1 << 20) -> dict:
    """Produce on the compute stream after a delay, copy to host at once: the copy must wait for the
    producer. Copy to the device with the copy stream delayed: the future must wait for the bytes."""
    from infinity.store.device_copy import DeviceCopier
    from infinity.store.pinned_host import CudaHostRegistrar, PinnedHostMemory

    mem = PinnedHostMemory(CudaHostRegistrar(device))
    buf = mem.allocate(numel * 4)
    host = buf[:numel * 4].view(torch.float32)
    copier = DeviceCopier(device)
    stale_d2h = stale_h2d = 0
    try:
        dev = torch.zeros(numel, device=device)
        for k in range(rounds):
            torch.cuda._sleep(SLEEP_CYCLES)
            dev.fill_(float(k + 1))                       # queued behind the sleep on the compute stream
            copier.to_host(host, dev).result()            # must follow the fill (the event it records)
            stale_d2h += int(not torch.equal(host, torch.full_like(host, float(k + 1))))
            host.fill_(float(-k - 1))
            with torch.cuda.stream(copier._to_device.stream):
                torch.cuda._sleep(SLEEP_CYCLES)           # the copy stream is busy before the copy
            copier.to_device(dev, host).result()          # done only once the bytes have landed
            stale_h2d += int(not torch.equal(dev.cpu(), torch.full((numel,), float(-k - 1))))
    finally:
        copier.close()
        # unlocked before its pages are unmapped: a later mapping at the same address would otherwise be
        # refused as already registered (cudaError 712)
        del host
        mem.free(buf)
    return {"rounds": rounds, "stale_device_to_host": stale_d2h, "stale_host_to_device": stale_h2d,
            "ok": stale_d2h == 0 and stale_h2d == 0}


def grad_fold_race(device: torch.device, tmp: str, rounds: int = 8, numel: int = 1 << 20) -> dict:
    """Fold gradients produced behind a sleep on the compute stream into stored shards (NVMe- and
    host-homed, two chunks): the side-stream copy must follow the producer, for first gradients
    (claimed) and accumulations (staged) alike."""
    from infinity.config import IOConfig, TiersConfig
    from infinity.store import TensorStore, Tier
    from infinity.zero.placement import Placement
    from infinity.zero.store_shard import LentCopies, StoreUnitShard
    from infinity.zero.units import TensorClass

    stale = {}
    store = TensorStore(TiersConfig(device_bytes=64 << 20, host_bytes=64 << 20, nvme_path=tmp), IOConfig(),
                        device=device)
    try:
        for index, home in enumerate((Tier.NVME, Tier.HOST)):
            placement = Placement(params=None, grads=home, optimizer=None, chunk_bytes=1 << 30)
            shard = StoreUnitShard(store, index, placement, LentCopies(store), [(0, numel // 2), (numel // 2, numel)])
            shard.put_zeros(TensorClass.GRAD, numel, torch.float32, device)
            stale[home.value] = 0
            for k in range(rounds):
                reduced = torch.empty(numel, device=device)
                torch.cuda._sleep(SLEEP_CYCLES)
                reduced.fill_(float(k + 1))   # queued behind the sleep on the compute stream
                shard.fold_grad(reduced, first=k % 4 == 0).result()
                want = float(sum(range(k - k % 4 + 1, k + 2)))
                stale[home.value] += int(not torch.equal(shard.read(TensorClass.GRAD), torch.full((numel,), want)))
            shard.release()
    finally:
        store.close()
    return {"rounds": rounds, "stale_folds": stale, "ok": not any(stale.values())}


def race(out_dir: Path, steps: int = 3) -> dict:
    device = compute_device()
    if device.type != "cuda":
        return {"ok": True, "skipped": "no CUDA device: torch.cuda._sleep delays CUDA streams only"}
    # warn, not raise, for an op without a deterministic kernel: the repeat run below tells if one ran
    torch.use_deterministic_algorithms(True, warn_only=True)
    copies = copier_race(device)

    def same(a, b):
        return a["losses"] == b["losses"] and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])

    with _scratch() as tmp:
        folds = grad_fold_race(device, tmp)
        conf = offload_config(tmp, host_bytes="64MiB", device_bytes="16MiB")
        plain = train("tiny", conf, steps, 4, 64, params=True)
        again = train("tiny", conf, steps, 4, 64, params=True)
        slow = train("tiny", conf, steps, 4, 64, params=True, around_step=delayed_streams)
        # gradients on NVMe, two micro-batches: first gradients claimed, accumulations staged, both off-stream
        nvme = dict(conf, offload=dict(conf["offload"], grads="nvme"))
        accum = [train("tiny", nvme, 2, 4, 64, params=True, micro_batches=2, around_step=around)
                 for around in (None, None, delayed_streams)]
    deterministic, bitwise = same(plain, again) and same(accum[0], accum[1]), same(plain, slow)
    accum_bitwise = same(accum[0], accum[2])
    out = {"copier": copies, "grad_folds": folds, "repeat_bitwise_equal": deterministic,
           "training_bitwise_equal": bitwise, "accumulation_bitwise_equal": accum_bitwise,
           "losses": plain["losses"], "delayed_losses": slow["losses"],
           "ok": copies["ok"] and folds["ok"] and deterministic and bitwise and accum_bitwise}
    if not deterministic:
        out["error"] = ("two undelayed runs differ: some kernel here is not deterministic, so the delayed run "
                        "cannot be compared bitwise (see the run's warnings)")
    return out


# ---------------------------------------------------------------- stage: profile

def _merged(intervals) -> list:
    """The union of ``(start, end)`` intervals, as sorted disjoint ``[start, end]`` runs."""
    out: list = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _covered(runs: list, starts: list, lo: float, hi: float) -> float:
    """How much of ``[lo, hi)`` the disjoint sorted ``runs`` cover (``starts``: their start times)."""
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    total = 0.0
    while i < len(runs) and runs[i][0] < hi:
        total += max(0.0, min(hi, runs[i][1]) - max(lo, runs[i][0]))
        i += 1
    return total


def copy_overlap(trace: dict) -> dict:
    """From a Chrome trace (``torch.profiler``'s export): host<->device copy time per direction, in total
    and while a kernel ran on another stream (microseconds). GPU events carry their stream as ``tid``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    out: dict = {"kernel_us": float(sum(e["dur"] for e in kernels)), "kernel_streams": len({e.get("tid") for e in kernels})}
    busy: dict = {}   # copy stream -> union of the kernels on every other stream
    for direction, tag in (("h2d", "HtoD"), ("d2h", "DtoH")):
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and tag in e.get("name", "")]
        total = overlapped = 0.0
        for c in copies:
            stream = c.get("tid")
            if stream not in busy:
                runs = _merged((k["ts"], k["ts"] + k["dur"]) for k in kernels if k.get("tid") != stream)
                busy[stream] = (runs, [r[0] for r in runs])
            total += c["dur"]
            overlapped += _covered(*busy[stream], c["ts"], c["ts"] + c["dur"])
        out[f"{direction}_copies"] = len(copies)
        out[f"{direction}_copy_streams"] = len({c.get("tid") for c in copies})
        out[f"{direction}_us"] = total
        out[f"{direction}_overlapped_us"] = overlapped
        out[f"{direction}_overlap_fraction"] = overlapped / total if total else None
    return out


def profile(out_dir: Path, model: str = "125m", batch_size: int = 4, seq_len: int = 256) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = compute_device()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace_path = out_dir / "profile_trace.json"
    prof = torch_profile(activities=activities)

    def second_step(step: int):
        # the first step records the gather order that later steps prefetch along: profile the next one
        return prof if step == 1 else contextlib.nullcontext()
    with _scratch() as tmp:
        conf = offload_config(tmp, host_bytes="1GiB", device_bytes="512MiB")
        train(model, conf, 2, batch_size, seq_len, around_step=second_step)
    prof.export_chrome_trace(str(trace_path))
    overlap = copy_overlap(json.loads(trace_path.read_text()))
    if trace_path.stat().st_size > 20 * 2**20:   # keep what comes back small; the figures are in the JSON
        trace_path.unlink()
    cuda = device.type == "cuda"
    # on CUDA an offloaded step copies both ways; a trace without copies means the profile saw nothing
    seen = not cuda or (overlap["h2d_copies"] > 0 and overlap["d2h_copies"] > 0)
    return {"model": model, "cuda": cuda, **overlap, "ok": seen}


# ---------------------------------------------------------------- entry point

def run_stage(stage: str, out_dir: Path, **kwargs) -> dict:
    from infinity.precision import hardware_record

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fn = globals()[stage]
    accepted = inspect.signature(fn).parameters
    try:
        result = fn(out_dir, **{k: v for k, v in kwargs.items() if k in accepted})
    except Exception as e:   # noqa: BLE001 - the JSON says what failed; the exit status says that it did
        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
    try:
        hardware = hardware_record(compute_device())
    except Exception as e:   # noqa: BLE001 - a device that cannot say its name still gets its stage's JSON
        hardware = {"error": f"{type(e).__name__}: {e}"}
    result = {"stage": stage, **result, "wall_s": time.perf_counter() - t0, "hardware": hardware}
    (out_dir / f"{stage}.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    ap.add_argument("--model", default=None, help="built-in GPT size for the loss and profile stages")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    args = ap.parse_args(argv)
    kwargs = {k: v for k, v in (("model", args.model), ("steps", args.steps), ("batch_size", args.batch_size),
                                ("seq_len", args.seq_len)) if v is not None}
    result = run_stage(args.stage, args.out, **kwargs)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hardware_note import line as hardware_line
    if "cpu" in result["hardware"]:
        print(hardware_line(result["hardware"]), file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "in_memory_losses")}, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
