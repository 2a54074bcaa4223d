"""``infinity train --config auto`` beside the hand-written configs, on the default job, back to back.

    python tools/bench_defaults.py [--steps 20] [--host-bytes 1GiB] [--device-bytes 1GiB]
                                   [--profile PROFILE.json] [--configs configs/zero1.yaml,...] [--json]

Runs ``infinity train`` (its built-in model, corpus, batch and schedule: clipping 1.0, cosine) once per
config, each in its own process with its own swap directory and the same memory grant: the built-in
default config, every shipped ``configs/*.yaml`` but ``auto.yaml`` (or ``--configs``), and ``--config
auto`` (the planner, with ``--profile`` or a quick profile measured at start-up). Each run's step time
is the median of its ``--metrics`` lines after the first two (the first records the gather order, the
second still warms the page cache), and its peak RSS the largest the metrics report. Prints each
beside the fastest hand-written one, auto's ratio to it last; evaluation and saving are off so only
steps are timed. A config that does not fit the grant is reported with its error, not fatal. Each row
records the dtypes its run resolved (the default's ``precision.param_dtype: auto`` is measured where it
runs), and the output the machine (``infinity.precision.hardware_record``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from hardware_note import line as hardware_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def _run(config: str | None, a, root: str) -> dict:
    """One ``infinity train`` run; its median step time and peak RSS, or its error."""
    name = "default" if config is None else os.path.basename(config)
    work = os.path.join(root, name.replace(".yaml", ""))
    os.makedirs(work, exist_ok=True)
    metrics = os.path.join(work, "metrics.jsonl")
    cmd = [sys.executable, "-m", "infinity.cli", "train", "--steps", str(a.steps), "--no-save", "--no-progress",
           "--eval-every", str(a.steps + 1), "--swap-dir", os.path.join(work, "swap"), "--metrics", metrics,
           "--host-bytes", a.host_bytes, "--device-bytes", a.device_bytes]
    if config == "auto" and a.profile:
        config = _auto_with_profile(a.profile, work)
    if config is not None:
        cmd += ["--config", config]
    proc = subprocess.run(cmd, cwd=work, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        why = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), f"exit {proc.returncode}")
        return {"config": name, "step_s": None, "error": why}
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    later = rows[2:] or rows
    peaks = [r["memory"]["peak_rss_bytes"] for r in rows if (r.get("memory") or {}).get("peak_rss_bytes")]
    chosen = next((ln for ln in proc.stderr.splitlines() if "chosen" in ln), None)
    return {"config": name, "step_s": statistics.median(r["step_s"] for r in later),
            "param_dtype": rows[-1].get("param_dtype"), "compute_dtype": rows[-1].get("compute_dtype"),
            "peak_rss_bytes": max(peaks) if peaks else None, "steps": len(rows), "chosen": chosen,
            "final_loss": rows[-1]["loss"], "load": round(os.getloadavg()[0], 2)}


def _auto_with_profile(profile: str, work: str) -> str:
    """``configs/auto.yaml`` pointed at ``profile`` (the grant comes from the command line's flags)."""
    import yaml

    with open(os.path.join(REPO, "configs", "auto.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("plan", {})["profile"] = os.path.abspath(profile)
    for key in ("host_bytes", "device_bytes"):
        cfg["plan"].pop(key, None)
    path = os.path.join(work, "auto-with-profile.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--host-bytes", default="1GiB")
    ap.add_argument("--device-bytes", default="1GiB")
    ap.add_argument("--profile", default=None, help="infinity profile JSON for auto (default: a quick one)")
    ap.add_argument("--configs", default=None, help="comma-separated hand-written configs (default: configs/*)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from infinity.precision import hardware_record
    hardware = hardware_record("cpu")   # infinity train's threads: the same default as this process's
    if not a.json:
        print(hardware_line(hardware), flush=True)
    hand = (a.configs.split(",") if a.configs else
            sorted(p for p in glob.glob(os.path.join(REPO, "configs", "*.yaml")) if not p.endswith("auto.yaml")))
    root = tempfile.mkdtemp(prefix="bench-defaults-", dir=os.getcwd())
    rows = []
    try:
        for config in [None, *[os.path.abspath(p) for p in hand], "auto"]:
            rows.append(_run(config, a, root))
            r = rows[-1]
            if not a.json:
                if r["step_s"] is None:
                    print(f"{r['config']:28s} failed: {r['error']}", flush=True)
                else:
                    rss = f"{r['peak_rss_bytes'] / GIB:5.2f} GiB" if r["peak_rss_bytes"] else "n/a"
                    print(f"{r['config']:28s} {r['step_s']:7.3f} s  peak RSS {rss}  loss {r['final_loss']:.4f}  "
                          f"{r['compute_dtype']}  (load {r['load']})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    timed = [r for r in rows[:-1] if r["step_s"] is not None]
    auto = rows[-1]
    best = min(timed, key=lambda r: r["step_s"]) if timed else None
    summary = {"best_hand": best["config"] if best else None,
               "auto_over_best": auto["step_s"] / best["step_s"] if best and auto["step_s"] else None}
    if a.json:
        print(json.dumps({"hardware": hardware, "rows": rows, "summary": summary}, indent=2))
    elif summary["auto_over_best"] is not None:
        print(f"auto {auto['step_s']:.3f} s = {summary['auto_over_best']:.2f}x the fastest hand-written config "
              f"({best['config']}, {best['step_s']:.3f} s); auto's plan: {auto['chosen']}")


if __name__ == "__main__":
    main()
