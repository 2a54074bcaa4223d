"""Prediction accuracy of ``infinity plan``: plan -> train a few steps -> predicted vs measured, per workload.

    python tools/bench_plan.py --profile PROFILE.json [--workloads small-1g,small-4g,small-s3-w2] [--steps 4]
                               [--repeat 3] [--swap-dir DIR] [--json]

For each workload the planner picks a config (or, with a fixed ``config``, only predicts it); the
config is then trained for ``--steps`` steps in a fresh process (``world`` ranks over gloo), and the
median of the steps after the first (the first records the prefetch order) is compared with the
prediction: the step time, each phase's terms (compute / I/O waited on / Adam / communication /
unattributed, :mod:`infinity.zero.stats`), peak RSS (the engine's memory report, VmHWM per step) and
the NVMe bytes per step. ``--repeat N`` runs every workload N times over (plan and train each time, one
pass over the workloads after another), and each workload's error is then that of the median
predicted against the median measured. The worst step and RSS errors are printed last. ``--sweep``
adds the choice-quality check: the planner's config and hand-written ones measured back to back.

Workloads (GPT-2 small is transformers' GPT2LMHeadModel from GPT2Config, vocab 50257, 12 x 768,
sequence 256, micro-batch 2, bf16 compute):
  small-1g     host_bytes 1GiB, device_bytes 1GiB (on CPU the device tier is RAM too)
  small-4g     host_bytes 4GiB, device_bytes 1GiB
  small-s3-w2  stage 3 in memory (nothing offloaded), world size 2, device_bytes 4GiB per rank
  medium-1g    GPT-2 medium (24 x 1024), host_bytes 1GiB, device_bytes 2GiB
  small-h1g, medium-h1g  host_bytes 1GiB and device_bytes auto (the device's free memory: on CPU, RAM):
               the issue's "1 GiB host budget" with nothing said of the device
  1b-2g        GPT-2 1.3B (24 x 2048), host_bytes 2GiB, device_bytes 3.5GiB
  2.7b-3g      GPT-2 2.7B (32 x 2560, tools/bench_scale.py's scale workload), host_bytes 3GiB,
               device_bytes 4.5GiB: ~42 GB of state in the swap directory (check its free space first)
  pretrained-1g  a local transformers model directory (``hf:DIR``: config.json + safetensors, loaded
               unit by unit): GPT-2 small's shape, written once under the swap directory with GPT-2's init
               (no download: this machine reaches no model hub), host_bytes 1GiB, device_bytes 1GiB
(A plan's device_bytes is all the device memory the engine may use: the tier plus what it holds outside
the store, activations and gathered units, which is ~1.9 / 3.3 / 3.9 GiB at least for medium / 1b / 2.7b at
these shapes; on CPU the device is RAM. A workload the planner refuses is reported with its reason.)
The machine may be shared: the load average is printed beside each measurement. The machine itself
(``infinity.precision.hardware_record``) is printed and recorded, and each measured run the dtypes its engine
resolved (a planned config's ``precision.param_dtype: auto`` is measured where it runs).
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> str:
    """A transformers GPT-2 of that shape, built from its config (``--model`` syntax)."""
    return f"hf:GPT2Config:vocab_size=50257,n_layer={n_layer},n_embd={n_embd},n_head={n_head},n_positions=1024"


GPT2_SMALL = _gpt2(12, 768, 12)
GIB = 2**30
WORKLOADS = {
    "small-1g": {"model": GPT2_SMALL, "host": 1 * GIB, "device": 1 * GIB, "world": 1},
    "small-4g": {"model": GPT2_SMALL, "host": 4 * GIB, "device": 1 * GIB, "world": 1},
    "small-s3-w2": {"model": GPT2_SMALL, "host": 1 * GIB, "device": 4 * GIB, "world": 2,
                    "fixed": {"zero.stage": 3, "offload.params": "none", "offload.grads": "none",
                              "offload.optimizer": "none"}},
    "medium-1g": {"model": _gpt2(24, 1024, 16), "host": 1 * GIB, "device": 2 * GIB, "world": 1},
    "small-h1g": {"model": GPT2_SMALL, "host": 1 * GIB, "device": "auto", "world": 1},
    "medium-h1g": {"model": _gpt2(24, 1024, 16), "host": 1 * GIB, "device": "auto", "world": 1},
    "1b-2g": {"model": _gpt2(24, 2048, 16), "host": 2 * GIB, "device": 7 * GIB // 2, "world": 1},
    "2.7b-3g": {"model": _gpt2(32, 2560, 32), "host": 3 * GIB, "device": 9 * GIB // 2, "world": 1},
    "pretrained-1g": {"model": "pretrained", "host": 1 * GIB, "device": 1 * GIB, "world": 1},
}
SEQ, MBS = 256, 2


def _pretrained_dir(root: str) -> str:
    """A local transformers model directory of GPT-2 small's shape (written once under ``root``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = os.path.join(root, "gpt2-small-local")
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_layer=12, n_embd=768, n_head=12,
                                   n_positions=1024)).save_pretrained(path, safe_serialization=True)
    return "hf:" + path


def _gpt2_init(module) -> None:
    """GPT-2's init on a module built on the meta device: matrices normal(0, 0.02), norms 1, biases 0."""
    import torch
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif name.rsplit(".", 1)[-1] == "weight":
                p.fill_(1.0)
            else:
                p.zero_()


def _child(args) -> None:
    """One rank of a measured run: build on meta, initialize, train, print the per-step stats as JSON."""
    import torch
    import torch.distributed as dist

    import infinity
    from infinity.train.models import build_model, parse_model_spec, unit_init_fn
    from infinity.zero.memory_report import warm_torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world))
    rank = int(os.environ.get("RANK", "0"))
    warm_torch()
    spec = parse_model_spec(args.model)
    with torch.device("meta"):
        model, loss_fn = build_model(spec, SEQ)
    cfg = infinity.Config.from_file(args.config)
    if args.world > 1:
        cfg = cfg.replace(tiers={"nvme_path": os.path.join(cfg.tiers.nvme_path, f"rank{rank}")})
        os.makedirs(cfg.tiers.nvme_path, exist_ok=True)
    model, opt = infinity.initialize(model, cfg, init_fn=unit_init_fn(model) or _gpt2_init)
    engine = infinity.engine_of(model)
    engine.memory.enable()
    gen = torch.Generator().manual_seed(rank)
    steps = []
    for step in range(args.steps):
        ids = torch.randint(0, 1024, (MBS, SEQ), generator=gen)
        t0 = time.perf_counter()
        loss_fn(model, ids, ids).backward()
        opt.step()
        opt.zero_grad()
        wall = time.perf_counter() - t0
        last = engine.stats.last_step
        steps.append({"wall_s": wall, "attribution": last["attribution"],
                      "moved_bytes": (last.get("offload") or {}).get("moved_bytes", {}),
                      "memory": engine.memory_report(), "load": os.getloadavg()[0]})
    precision = {"param_dtype": engine.config.precision.param_dtype,
                 "compute_dtype": engine.config.precision.compute_dtype}
    engine.close()
    if rank == 0:
        print("BENCH_JSON " + json.dumps({"steps": steps, "precision": precision}))
    if dist.is_initialized():
        dist.destroy_process_group()


def _measure(config_path: str, model: str, world: int, steps: int) -> tuple:
    """``(per-step stats, the engine's resolved precision)`` of ``steps`` steps in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", config_path, "--model", model,
           "--steps", str(steps), "--world", str(world)]
    env = dict(os.environ, PYTHONPATH=REPO)   # the engine fixes glibc's mmap threshold itself (tiers config)
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] + cmd[1:]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"measured run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON "))
    out = json.loads(line[len("BENCH_JSON "):])
    return out["steps"], out["precision"]


def _median_attribution(steps: list) -> dict:
    from infinity.zero.stats import PHASES, TERMS
    later = steps[1:] or steps
    return {p: {t: statistics.median(s["attribution"][p][t] for s in later) for t in TERMS}
            for p in PHASES}


def _plan(w: dict, profile: str, swap_dir: str, cfg_path: str) -> dict:
    """``infinity plan --json`` in its own process (as a user runs it: its baseline RSS is a fresh one)."""
    cmd = [sys.executable, "-m", "infinity.cli", "plan", "--model", w["model"], "--tokens", str(SEQ * MBS),
           "--seq-len", str(SEQ), "--devices", str(w["world"]), "--host-bytes", str(w["host"]),
           "--device-bytes", str(w["device"]), "--profile", profile, "--swap-dir", swap_dir, "--out", cfg_path,
           "--json"]
    for key, value in w.get("fixed", {}).items():
        cmd += ["--fix", f"{key}={value}"]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"infinity plan failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def _sweep(a, first: dict, w: dict, swap_root: str) -> list:
    """The planned config of the first planned workload and each --sweep config, measured back to back."""
    import yaml

    from infinity.zero.stats import PHASES

    rows = []
    for path in [first["config"]] + a.sweep.split(","):
        with open(path) as f:
            cfg = yaml.safe_load(f)
        swap = os.path.join(swap_root, "sweep")
        os.makedirs(swap, exist_ok=True)
        cfg.setdefault("tiers", {}).update(host_bytes=w["host"], device_bytes=w["device"], nvme_path=swap)
        cfg.setdefault("optimizer", {})["threads"] = "auto"
        out = os.path.join(swap_root, "sweep-" + os.path.basename(path))
        with open(out, "w") as f:
            yaml.safe_dump(cfg, f)
        try:
            steps, precision = _measure(out, w["model"], w["world"], a.steps)
        except RuntimeError as e:   # a hand-written config that does not fit the budgets is refused
            why = next((ln for ln in reversed(str(e).splitlines()) if "Error" in ln), str(e)[-300:])
            rows.append({"config": path, "step_s": None, "refused": why})
            if not a.json:
                print(f"   sweep {os.path.basename(path):28s} refused: {why}")
            continue
        later = steps[1:] or steps
        step = statistics.median(sum(s["attribution"][p]["wall_s"] for p in PHASES) for s in later)
        peaks = [s["memory"]["peak_rss_bytes"] for s in steps if s["memory"] and s["memory"]["peak_rss_bytes"]]
        # a config without offload ignores the tiers' budgets: its RSS says whether it kept to the grant
        rows.append({"config": path, "step_s": step, "peak_rss_bytes": max(peaks) if peaks else None,
                     "precision": precision, "load": [round(s["load"], 2) for s in steps]})
        if not a.json:
            rss = f"peak RSS {max(peaks) / GIB:5.2f} GiB" if peaks else "peak RSS n/a"
            print(f"   sweep {os.path.basename(path):28s} {step:7.2f} s  {rss}  (load {rows[-1]['load']})")
    for r in rows:
        r["vs_planned"] = r["step_s"] / rows[0]["step_s"] if r["step_s"] else None
    return rows


def _medians(rows: list) -> list:
    """One row per workload: the median predicted and measured step and peak RSS over its passes, their
    errors, and each pass's step error (``step_errors``)."""
    out = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == name]
        row = {"workload": name, "passes": len(mine), "step_errors": [r["step_error"] for r in mine]}
        for key in ("predicted_step_s", "measured_step_s", "predicted_rss_bytes", "measured_rss_bytes"):
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        row["step_error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
        row["rss_error"] = (row["predicted_rss_bytes"] / row["measured_rss_bytes"] - 1
                            if row["measured_rss_bytes"] else None)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="infinity profile JSON")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="passes over the workloads; medians are compared")
    ap.add_argument("--swap-dir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sweep", default=None, metavar="CONFIGS",
                    help="comma-separated config files measured back to back after the first workload's planned "
                         "config, each with that workload's budgets and swap directory (choice quality)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a)
        return
    from hardware_note import line as hardware_line
    from infinity.precision import hardware_record
    from infinity.zero.stats import PHASES, TERMS

    hardware = hardware_record("cpu")
    if not a.json:
        print(hardware_line(hardware))
    swap_root = a.swap_dir or tempfile.mkdtemp(prefix="bench-plan-", dir=os.getcwd())
    results = []
    passes = [(i, name) for i in range(a.repeat) for name in a.workloads.split(",")]
    try:
        for run, name in passes:
            w = dict(WORKLOADS[name])
            if w["model"] == "pretrained":
                w["model"] = _pretrained_dir(swap_root)
            swap = os.path.join(swap_root, name)
            os.makedirs(swap, exist_ok=True)
            cfg_path = os.path.join(swap_root, f"{name}.yaml")
            try:
                plan = _plan(w, a.profile, swap, cfg_path)
            except RuntimeError as e:   # refused (below the minimum) or failed: said, and the next one runs
                results.append({"workload": name, "refused": str(e)[-600:]})
                if not a.json:
                    print(f"== {name}: not planned: {str(e)[-600:]}")
                continue
            pred = plan["predicted"]
            pred_step, pred_rss = pred["step_s"], pred["peak_rss"]["total_bytes"]
            steps, precision = _measure(cfg_path, w["model"], w["world"], a.steps)
            later = steps[1:] or steps
            measured_step = statistics.median(sum(s["attribution"][p]["wall_s"] for p in PHASES) for s in later)
            peaks = [s["memory"]["peak_rss_bytes"] for s in steps if s["memory"] and s["memory"]["peak_rss_bytes"]]
            measured_rss = max(peaks) if peaks else None
            nvme = statistics.median(sum(v for k, v in s["moved_bytes"].items() if "nvme" in k) for s in later)
            row = {"workload": name, "pass": run + 1, "resolved": w, "chosen": plan["chosen"], "precision": precision,
                   "predicted_step_s": pred_step,
                   "measured_step_s": measured_step, "step_error": pred_step / measured_step - 1,
                   "predicted_rss_bytes": pred_rss, "measured_rss_bytes": measured_rss,
                   "rss_error": pred_rss / measured_rss - 1 if measured_rss else None,
                   "predicted_nvme_bytes": sum(v for k, v in pred["moved_bytes"].items() if "nvme" in k),
                   "measured_nvme_bytes": nvme,
                   "predicted_phases": pred["phases"], "measured_phases": _median_attribution(steps),
                   "load": [round(s["load"], 2) for s in steps], "steps": len(steps),
                   "predicted_rss_terms": pred["peak_rss"], "measured_memory": steps[-1]["memory"],
                   "config": cfg_path}
            results.append(row)
            if not a.json:
                print(f"== {name} (pass {run + 1}/{a.repeat}): {row['chosen']}, {precision['compute_dtype']} compute  "
                      f"(load avg {row['load']})")
                print(f"   step  predicted {pred_step:7.2f} s  measured {measured_step:7.2f} s  "
                      f"error {row['step_error']:+.1%}")
                if measured_rss:
                    print(f"   RSS   predicted {pred_rss / GIB:7.2f} GiB  measured "
                          f"{measured_rss / GIB:7.2f} GiB  error {row['rss_error']:+.1%}")
                    print("   RSS terms predicted: " + ", ".join(
                        f"{k.removesuffix('_bytes')} {v / 2**20:.0f}" for k, v in pred["peak_rss"].items()) + " MiB")
                    mem = steps[-1]["memory"]
                    print("   RSS terms measured:  " + ", ".join(
                        f"{k.removesuffix('_bytes')} {mem[k] / 2**20:.0f}" for k in mem
                        if k.endswith("_bytes") and isinstance(mem[k], int)) + " MiB")
                print(f"   NVMe  predicted {row['predicted_nvme_bytes'] / GIB:7.2f} GiB  measured "
                      f"{nvme / GIB:7.2f} GiB per step")
                print("   phase     " + "".join(f"{t[:-2]:>14}" for t in TERMS) + "   (predicted / measured)")
                for p in PHASES:
                    print(f"   {p:<9} " + "".join(
                        f"{pred['phases'][p][t]:>6.2f}/{row['measured_phases'][p][t]:<7.2f}" for t in TERMS))
            shutil.rmtree(swap, ignore_errors=True)   # the next workload may need the disk space
        first = next((r for r in results if "refused" not in r), None)
        if a.sweep and first is not None:   # the first planned workload's config against the sweep's
            first["sweep"] = _sweep(a, first, first["resolved"], swap_root)
    finally:
        if a.swap_dir is None:
            shutil.rmtree(swap_root, ignore_errors=True)
    planned = _medians([r for r in results if "refused" not in r])
    if not planned:
        raise SystemExit("bench_plan: no workload was planned")
    worst_step = max(planned, key=lambda r: abs(r["step_error"]))
    rss_rows = [r for r in planned if r["rss_error"] is not None]
    worst_rss = max(rss_rows, key=lambda r: abs(r["rss_error"])) if rss_rows else None
    summary = {"worst_step_error": worst_step["step_error"], "worst_step_workload": worst_step["workload"],
               "worst_rss_error": worst_rss["rss_error"] if worst_rss else None,
               "worst_rss_workload": worst_rss["workload"] if worst_rss else None}
    if a.json:
        print(json.dumps({"hardware": hardware, "results": results, "medians": planned, "summary": summary}, indent=2))
    else:
        if a.repeat > 1:
            print(f"medians of {a.repeat} passes (plan and train each pass):")
            for r in planned:
                rss = (f"RSS {r['predicted_rss_bytes'] / GIB:5.2f} / {r['measured_rss_bytes'] / GIB:5.2f} GiB "
                       f"({r['rss_error']:+.1%})" if r["rss_error"] is not None else "RSS n/a")
                print(f"   {r['workload']:<14} step {r['predicted_step_s']:7.2f} / {r['measured_step_s']:7.2f} s "
                      f"({r['step_error']:+.1%}, passes {', '.join(f'{e:+.1%}' for e in r['step_errors'])})  {rss}")
        print(f"worst step error {summary['worst_step_error']:+.1%} ({summary['worst_step_workload']}); "
              f"worst peak-RSS error " + (f"{summary['worst_rss_error']:+.1%} ({summary['worst_rss_workload']})"
                                          if worst_rss else "n/a"))


if __name__ == "__main__":
    main()
