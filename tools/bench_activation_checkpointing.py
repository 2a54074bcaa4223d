"""``zero.activation_checkpointing``: what it saves in memory and costs in time, measured side by side.

    .venv/bin/python tools/bench_activation_checkpointing.py [--model 125m] [--batch 8] [--seq 512]
                                                             [--steps 4] [--rounds 3] [--json]

Each measurement is a fresh child process (so its peak RSS is its own): the
built-in GPT (``--model``, as ``infinity train --model`` takes it), ZeRO-3 on
one rank, bf16 compute, everything in memory (activations are what this knob
moves, so nothing else is offloaded), one warm-up step, then ``--steps``
measured steps. Per child it reports the median step time, the process's peak
RSS over the measured steps (VmHWM, reset after the warm-up via
``/proc/self/clear_refs``) and the bytes autograd saved for backward in one
forward (unique storages; the recompute's own saves in backward are not
counted, as they live only while that unit's backward runs). Children run
alternately off / on for ``--rounds`` rounds, so machine load hits both alike;
medians over rounds, and the ratio on / off. The machine (``infinity.precision.hardware_record``) and the
dtypes the engine ran in are printed and recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args) -> dict:
    """One configuration, in this (fresh) process."""
    import torch

    sys.path.insert(0, REPO)
    import infinity
    from infinity.train import build_model, parse_model_spec
    from infinity.zero.memory_report import read_peak_rss, reset_peak_rss

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, loss_fn = build_model(parse_model_spec(args.model), args.seq)
    vocab = min(1024, next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings)
    conf = {"zero": {"stage": 3, "activation_checkpointing": args.on}, "precision": {"param_dtype": "bf16"},
            "optimizer": {"threads": args.threads}}
    model, opt = infinity.initialize(model, conf)
    g = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps + 1)]
    saved: dict = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    times, losses, reset = [], [], False
    for i, ids in enumerate(batches):
        if i == 1:
            reset = reset_peak_rss()
        t0 = time.perf_counter()
        if i == 1:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_fn(model, ids, ids)
        else:
            loss = loss_fn(model, ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i > 0:
            times.append(time.perf_counter() - t0)
    engine = infinity.engine_of(model)
    precision = {"param_dtype": engine.config.precision.param_dtype,
                 "compute_dtype": engine.config.precision.compute_dtype}
    engine.close()
    return {"step_s": statistics.median(times), "peak_rss_bytes": read_peak_rss(), "hwm_reset": reset,
            "saved_activation_bytes": sum(saved.values()), "losses": losses, "precision": precision}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="125m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    import torch

    from hardware_note import line as hardware_line
    from infinity.precision import hardware_record

    torch.set_num_threads(args.threads)   # the record says the children's threads
    hardware = hardware_record("cpu")

    runs = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on"):
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--steps", str(args.steps), "--threads", str(args.threads)]
            if mode == "on":
                cmd.append("--on")
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(f"child ({mode}) failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            result["load_avg"] = os.getloadavg()[0]
            runs[mode].append(result)
            print(f"round {r + 1} {mode}: {result['step_s']:.2f} s/step, peak RSS "
                  f"{result['peak_rss_bytes'] / 2**30:.2f} GiB, saved {result['saved_activation_bytes'] / 2**20:.0f} MiB",
                  file=sys.stderr)

    def med(mode, key):
        return statistics.median(x[key] for x in runs[mode])

    summary = {k: {m: med(m, k) for m in runs} for k in ("step_s", "peak_rss_bytes", "saved_activation_bytes")}
    for k, v in summary.items():
        v["ratio_on_over_off"] = v["on"] / v["off"]
    same_losses = all(a["losses"] == b["losses"] for a, b in zip(runs["off"], runs["on"]))
    precision = runs["off"][0]["precision"]
    report = {"model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps, "rounds": args.rounds,
              "hardware": hardware, "precision": precision,
              "medians": summary, "losses_bitwise_equal": same_losses, "runs": runs}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(hardware_line(hardware))
    print(f"{args.model}, batch {args.batch} x {args.seq} tokens, ZeRO-3 in memory, {precision['compute_dtype']}; "
          f"medians of {args.rounds}")
    print(f"{'':24}{'off':>12}{'on':>12}{'on / off':>10}")
    for k, unit, scale in (("step_s", "s", 1), ("peak_rss_bytes", "GiB", 2**30), ("saved_activation_bytes", "MiB", 2**20)):
        v = summary[k]
        print(f"{k + ' (' + unit + ')':24}{v['off'] / scale:12.2f}{v['on'] / scale:12.2f}{v['ratio_on_over_off']:10.2f}")
    print(f"losses bitwise equal: {same_losses}")


if __name__ == "__main__":
    main()
