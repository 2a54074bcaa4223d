"""The overlapped update with the recipe people run (clipping + accumulation) beside its baselines, in one run.

Same workload as ``tools/bench_scale.py`` (HF GPT-2 of ``--size``, ``--precision`` (auto: measured on
this CPU), everything on NVMe, the same init and batches), these variants, each in a child process with a
fresh swap directory:

- ``plain``: clip 1.0, ``--accum`` micro-batches, no overlap (the step after backward);
- ``next_forward``: the same recipe with ``optimizer.update_at: auto`` (with clipping: the exact update
  runs during the next forward);
- ``backward``: overlap without clipping (the update during the last backward), what the clipped
  overlapped step is held against;
- ``plain_noclip``: no clipping, no overlap;
- ``speculative``: clip 1.0 with ``optimizer.update_at: speculative`` and its adaptive fallback
  (speculate in backward; after a redo, next_forward until unclipped steps return);
- ``speculative_commit``: speculative with a clip that never fires (1e9): every step commits its
  speculation, the committed step's cost against ``backward``;
- ``speculative_redo``: speculative with a clip that always fires (1e-6), speculating on every step
  (no fallback): every step pays the redo.

Prints each variant's median step time (forward + backward + step; the launched update's wait lands
in the next forward) beside ``plain``'s, the ratios, and whether the clipped variants' losses are
bitwise equal. Times are wall clock on whatever else the machine runs: say what ran beside it. The JSON
records the machine (``hardware``) and the dtypes each variant's engine resolved (``precision``).

``--phase-bytes 0,64MiB`` runs every variant once per ``io.phase_bytes`` (the disk's reads and writes
mixed, or in phases), one after another in this invocation: ``variant@BYTES`` names a phased run and
``phased_over_mixed`` holds its median step over the same variant's mixed one.

    python tools/bench_overlap.py --size small --host-bytes 1GiB --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scale as bs  # noqa: E402  (the workload: model, init, batches)
from hardware_note import line as hardware_line  # noqa: E402
from infinity.config import parse_size  # noqa: E402
from infinity.precision import hardware_record  # noqa: E402

import torch  # noqa: E402

VARIANTS = {   # name: (optimizer.update_at, clip, speculate on every step)
    "plain": ("step", 1.0, False), "next_forward": ("auto", 1.0, False),
    "backward": ("auto", None, False), "plain_noclip": ("step", None, False),
    "speculative": ("speculative", 1.0, False), "speculative_commit": ("speculative", 1e9, False),
    "speculative_redo": ("speculative", 1e-6, True),
}


def child(a) -> dict:
    from transformers import GPT2LMHeadModel

    import infinity
    name, _, phase = a.variant.partition("@")
    update_at, clip, always = VARIANTS[name]
    conf = bs.infinity_config(a)
    conf["optimizer"]["update_at"] = update_at
    if phase:
        conf.setdefault("io", {})["phase_bytes"] = int(phase)
    conf["schedule"] = {"clip_grad_norm": clip, "accum_steps": a.accum}
    with torch.device("meta"):
        model = GPT2LMHeadModel(bs.model_config(a)).train()
    torch.manual_seed(a.seed)
    model, opt = infinity.initialize(model, conf, init_fn=lambda m: bs.gpt2_init_(m, a.n_layer))
    engine = infinity.engine_of(model)
    if always:   # no fallback: the redo's cost on every step
        engine.update.speculation.speculate = lambda: True
    rows = []
    try:
        for step in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            fwd = bwd = 0.0
            loss_sum = 0.0
            for j in range(a.accum):
                x = bs.batch(step * a.accum + j, a)
                t = time.perf_counter()
                loss = model(input_ids=x, labels=x).loss
                fwd += time.perf_counter() - t
                t = time.perf_counter()
                (loss / a.accum).backward()
                bwd += time.perf_counter() - t
                loss_sum += loss.item() / a.accum
            t = time.perf_counter()
            norm = float(opt.clip_grad_norm_(clip)) if clip is not None else None
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            off = engine.stats.last_step.get("offload", {})
            rows.append({"loss": loss_sum, "norm": norm, "step_s": t3 - t0, "forward_s": fwd, "backward_s": bwd,
                         "optimizer_s": t3 - t, "update_at": off.get("update_at", "step"),
                         "speculation": off.get("speculation"), "spills": off.get("spills"),
                         "disk_read_bytes": off.get("moved_bytes", {}).get("nvme->host", 0),
                         "disk_write_bytes": off.get("moved_bytes", {}).get("host->nvme", 0),
                         "fold_staging": off.get("fold_staging")})
            print(f"[{a.variant}] step {step}{' (warm-up)' if step < a.warmup else ''} loss {loss_sum:.4f} "
                  f"norm {norm} {t3 - t0:.2f}s (fwd {fwd:.2f} bwd {bwd:.2f} step {t3 - t:.2f})", file=sys.stderr,
                  flush=True)
        prec = engine.config.precision   # resolved: what auto chose
        precision = {"param_dtype": prec.param_dtype, "compute_dtype": prec.compute_dtype}
    finally:
        engine.close()
    return {"rows": rows, "precision": precision}


def run_variant(a, variant: str) -> dict:
    swap = tempfile.mkdtemp(prefix=f"bench_overlap_{variant}_", dir=a.nvme_path)
    out = os.path.join(swap, "result.json")
    args = dict(vars(a), variant=variant, swap_dir=swap, child_out=out)
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-args", json.dumps(args)],
                           stdout=sys.stderr, check=False, timeout=a.timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"the {variant} child exited with {p.returncode} (its log is above)")
        return json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--child-args":
        a = argparse.Namespace(**json.loads(sys.argv[2]))
        Path(a.child_out).write_text(json.dumps(child(a)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=list(bs.SIZES), default="small")
    p.add_argument("--host-bytes", default="1GiB")
    p.add_argument("--device-bytes", default="256MiB", help="on CPU the device tier is host RAM too")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant (the median is reported)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--precision", choices=bs.PRECISIONS, default="auto", help="precision.param_dtype (auto: "
                   "measured on this CPU, as bench_scale's)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--phase-bytes", default="0", help="comma-separated io.phase_bytes values; each variant runs "
                   "once per value (0: the mixed queue)")
    p.add_argument("--nvme-path", default=None, help="where the swap directories go (default: the system temp)")
    p.add_argument("--timeout-s", type=float, default=3600)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    a.n_layer, a.n_embd, a.n_head = bs.SIZES[a.size]
    a.seq, a.mbs, a.seed, a.threads = 256, 2, 1234, 2   # bench_scale's workload
    a.swap_dir, a.config = None, None   # bench_scale's built-in config
    torch.set_num_threads(a.threads)   # the record says the threads the children run with
    hardware = hardware_record(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    print(hardware_line(hardware), file=sys.stderr, flush=True)
    phases_io = [parse_size(v.strip(), "--phase-bytes") for v in a.phase_bytes.split(",") if v.strip()] or [0]
    for v in a.variants.split(","):
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    results = {}
    for variant in a.variants.split(","):
        for phase in phases_io:
            name = variant if phase == 0 else f"{variant}@{phase}"
            results[name] = run_variant(a, name)
    med = {v: statistics.median(r["step_s"] for r in res["rows"][a.warmup:]) for v, res in results.items()}
    phases = {v: {k: statistics.median(r[k] for r in res["rows"][a.warmup:])
                  for k in ("forward_s", "backward_s", "optimizer_s")} for v, res in results.items()}
    out = {"workload": {k: getattr(a, k) for k in ("size", "host_bytes", "device_bytes", "accum", "warmup", "steps",
                                                   "set", "seq", "mbs", "variants", "precision")},
           "hardware": hardware, "precision": {v: res["precision"] for v, res in results.items()},
           "median_step_s": med, "median_phase_s": phases, "results": results}
    if "plain" in med:
        out["over_plain"] = {v: m / med["plain"] for v, m in med.items()}
    phased = {v: m / med[v.split("@")[0]] for v, m in med.items() if "@" in v and v.split("@")[0] in med}
    if phased:
        out["phased_over_mixed"] = phased
    if "next_forward" in med and "backward" in med:
        out["clipped_overlap_over_unclipped_overlap"] = med["next_forward"] / med["backward"]
    if "speculative_commit" in med and "backward" in med:
        out["committed_speculation_over_unclipped_overlap"] = med["speculative_commit"] / med["backward"]
    if "speculative_redo" in med and "backward" in med:
        out["redone_speculation_over_unclipped_overlap"] = med["speculative_redo"] / med["backward"]
    if "plain" in results:   # the same recipe, clip 1.0: bitwise the plain step's losses
        plain_losses = [r["loss"] for r in results["plain"]["rows"]]
        out["clipped_losses_equal"] = {v: [r["loss"] for r in results[v]["rows"]] == plain_losses
                                       for v in ("next_forward", "speculative") if v in results}
    for v in ("speculative", "speculative_commit", "speculative_redo"):
        if v in results:   # per measured step: speculated / redone, and the redo's seconds
            out.setdefault("speculation", {})[v] = [
                {k: (r["speculation"] or {}).get(k) for k in ("speculated", "redone", "redo_s")}
                for r in results[v]["rows"][a.warmup:]]
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(hardware_line(hardware))
        for v, m in med.items():
            ph = phases[v]
            print(f"{v:14s} {m:7.2f} s/step (fwd {ph['forward_s']:.2f} bwd {ph['backward_s']:.2f} step "
                  f"{ph['optimizer_s']:.2f})" + (f"  {out['over_plain'][v]:.2f}x plain" if "over_plain" in out else ""))
        for k in ("clipped_overlap_over_unclipped_overlap", "committed_speculation_over_unclipped_overlap",
                  "redone_speculation_over_unclipped_overlap", "clipped_losses_equal", "phased_over_mixed",
                  "speculation"):
            if k in out:
                print(f"{k}: {out[k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
