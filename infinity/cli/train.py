"""``infinity train``: the training job's flags (:class:`~infinity.train.TrainOptions`), its exit codes on
an error, a failed rank or a signal, and its summary."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from infinity.cli.usage import UsageError

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    """Register ``infinity train`` and its arguments on ``sub``, the program's sub-command parsers."""
    from infinity.train import (DEFAULT_BATCH_SIZE, DEFAULT_MODEL, DEFAULT_SEQ_LEN, DEFAULT_STEPS,
                                DEFAULT_SWAP_DIR)
    from infinity.train.options import (DEFAULT_EVAL_BATCHES, DEFAULT_EVAL_EVERY, DEFAULT_SAVE_ROOT,
                                        DEFAULT_SCHEDULE, DEFAULT_VAL_FRACTION)

    p = sub.add_parser(
        "train", help="train a model (default: a small built-in GPT on the embedded corpus, ZeRO-3)",
        description="Train with ZeRO stages 0-3 and device/host/NVMe tiers (see infinity/train/). With no "
                    "arguments: a small built-in GPT on the Python standard library's source, ZeRO-3, with the "
                    f"swap directory ./{DEFAULT_SWAP_DIR}, a checkpoint at the end under ./{DEFAULT_SAVE_ROOT}. "
                    "Ctrl-C or SIGTERM stops after the current step, saves, and removes the swap files (exit code "
                    "130 or 143). "
                    "Flags marked 'resumable' default to the checkpoint's value under --resume.")
    p.add_argument("--config", metavar="FILE", help="YAML/JSON config (default: the built-in ZeRO-3 NVMe config); "
                   "a DeepSpeed ds_config.json is read as one (docs/migrating-from-deepspeed.md); "
                   "auto (or a file with offload: auto, e.g. configs/auto.yaml): the planner picks it (infinity plan)")
    p.add_argument("--print-config", action="store_true",
                   help="print the config the run would use (YAML; with --json, JSON), flags applied, and exit")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="local ranks to start (default 1); under torchrun the launcher's ranks are joined instead")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help=f"optimizer steps in all, resumed ones included (default {DEFAULT_STEPS}; resumable)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="built-in GPT size (tiny, 125m, 350m, 1b, 3b), optionally with changed fields "
                        "(125m:n_layer=4); a transformers config class: hf:GPT2Config:n_layer=2,n_embd=64,n_head=2 "
                        "(built from config, never downloaded); or hf:PATH, a local transformers model directory "
                        "to fine-tune (config.json + safetensors). "
                        f"Default {DEFAULT_MODEL}; resumable")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="global sequences per step, over all ranks and micro-batches "
                        f"(default {DEFAULT_BATCH_SIZE}; resumable)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's limit if shorter; resumable)")
    p.add_argument("--accum", type=int, default=None, metavar="N",
                   help="micro-batches per rank per step (default: the config's schedule.accum_steps, a DeepSpeed "
                        "config's gradient_accumulation_steps, else 1)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (overrides optimizer.lr)")
    p.add_argument("--seed", type=int, default=None, help="model init and batch order (default 0; resumable)")
    p.add_argument("--stage", type=int, default=None, choices=(0, 1, 2, 3), help="overrides zero.stage")
    p.add_argument("--swap-dir", metavar="DIR", help=f"overrides tiers.nvme_path (default ./{DEFAULT_SWAP_DIR}); "
                                                     "each run uses a subdirectory of its own, removed at the end")
    p.add_argument("--device-bytes", metavar="SIZE", help="overrides tiers.device_bytes, e.g. 512MiB")
    p.add_argument("--host-bytes", metavar="SIZE", help="overrides tiers.host_bytes, e.g. 8GiB")
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--data", metavar="FILE", help="train on this file instead of the default corpus: its bytes, or "
                                                  "its text tokenized when there is a tokenizer (resumable)")
    g.add_argument("--corpus-bytes", metavar="SIZE", help="how much of the default corpus to use (default 4MiB; "
                                                          "resumable)")
    g.add_argument("--tokenizer", metavar="DIR", help="a local transformers tokenizer directory (default: the "
                                                      "hf:PATH model's own, if it has one; else byte tokens)")
    g.add_argument("--val-fraction", type=float, default=None, metavar="F",
                   help=f"held-out tail of the data (default {DEFAULT_VAL_FRACTION}; resumable)")
    g.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY, metavar="N",
                   help=f"validation loss and perplexity every N steps and at the last (default {DEFAULT_EVAL_EVERY}; "
                        "0 = never)")
    g.add_argument("--eval-batches", type=int, default=DEFAULT_EVAL_BATCHES, metavar="N",
                   help=f"held-out batches per evaluation (default {DEFAULT_EVAL_BATCHES})")
    g.add_argument("--sample-every", type=int, default=0, metavar="N",
                   help="print a sample continuing the data's first tokens every N steps (default 0 = never)")
    g.add_argument("--sample-tokens", type=int, default=64, metavar="N", help="tokens per sample (default 64)")
    g = p.add_argument_group("schedule (defaults: the config's schedule section; resumable)")
    g.add_argument("--lr-schedule", choices=("constant", "linear", "cosine"), default=None,
                   help=f"decay after warmup (default config: {DEFAULT_SCHEDULE['lr_schedule']})")
    g.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                   help=f"linear warmup steps (default config: {DEFAULT_SCHEDULE['warmup_steps']})")
    g.add_argument("--min-lr", type=float, default=None, help="lr at the end of the decay "
                                                              f"(default config: {DEFAULT_SCHEDULE['min_lr']:g})")
    g.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help=f"clip the gradient norm to MAX, 0 = never (default config: "
                        f"{DEFAULT_SCHEDULE['clip_grad_norm']:g})")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-dir", metavar="DIR",
                   help=f"save DIR/step_N and DIR/latest (default ./{DEFAULT_SAVE_ROOT}/run-<time>-<pid>, or the "
                        "directory a --resume came from)")
    g.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="also save every N steps (default 0: at the end and on Ctrl-C only)")
    g.add_argument("--keep-last", type=int, default=None, metavar="K", help="keep only the newest K checkpoints")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CKPT",
                   help="continue a run: from CKPT (a step directory or a save directory), or with no value from "
                        f"--save-dir's latest (else the newest run under ./{DEFAULT_SAVE_ROOT}); 'if-saved': from "
                        "--save-dir's latest if it has one, else start fresh (the command torchrun --max-restarts "
                        "runs again after a failure)")
    g.add_argument("--save-node-local", action="store_true", default=None,
                   help="the nodes share no file system: each node saves its own ranks' files into its own "
                        "--save-dir (consolidate or load elsewhere with every node's directory; resumable)")
    g.add_argument("--no-save", action="store_true", help="save no checkpoint")
    p.add_argument("--metrics", metavar="FILE", help="write one JSON line per step (appended to when resuming)")
    p.add_argument("--trace", metavar="FILE", help="write a Perfetto/Chrome trace of one step (every rank)")
    p.add_argument("--trace-step", type=int, default=1, metavar="N",
                   help="which step --trace records, 0-based (default 1: step 0 also records the gather order)")
    p.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_train)


def _run_train(args) -> int:
    from infinity.train import RankError, TrainError, TrainOptions, train
    from infinity.train.resolve import effective_config

    options = TrainOptions(
        config=args.config, nproc=args.nproc, steps=args.steps, model=args.model, batch_size=args.batch_size,
        seq_len=args.seq_len, accum=args.accum, lr=args.lr, seed=args.seed, stage=args.stage,
        swap_dir=args.swap_dir, device_bytes=args.device_bytes, host_bytes=args.host_bytes, data=args.data,
        corpus_bytes=args.corpus_bytes, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
        eval_every=args.eval_every, eval_batches=args.eval_batches, warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule, min_lr=args.min_lr, clip_grad_norm=args.clip_grad_norm,
        save=not args.no_save, save_dir=args.save_dir, save_node_local=args.save_node_local,
        save_every=args.save_every, keep_last=args.keep_last,
        resume=args.resume, sample_every=args.sample_every, sample_tokens=args.sample_tokens,
        metrics=args.metrics, trace=args.trace, trace_step=args.trace_step, progress=not args.no_progress)
    if args.print_config:
        try:
            config = effective_config(options).to_dict()
        except TrainError as e:
            raise UsageError(str(e)) from None
        if args.json:
            print(json.dumps(config, indent=2))
        else:
            import yaml
            print(yaml.safe_dump(config, sort_keys=False, default_flow_style=False), end="")
        return 0
    try:
        result = train(options)
    except TrainError as e:
        raise UsageError(str(e)) from None
    except RankError as e:
        if getattr(args, "debug", False) and e.traceback:
            print(e.traceback, file=sys.stderr, end="")
        print(f"infinity train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:   # a second Ctrl-C / SIGTERM: stopped at once
        print("infinity train: interrupted; stopped without finishing the step, swap files removed",
              file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    stopped_code = 128 + (result.stop_signal or signal.SIGINT)   # 130 after SIGINT, 143 after SIGTERM
    if result.rank != 0:    # under torchrun only rank 0 speaks
        return stopped_code if result.interrupted else 0
    s = result.summary
    if result.interrupted:
        done = f"after step {s['steps']} of {s['steps_requested']}" if s.get("steps") is not None else "at once"
        saved = "; saved" if s.get("checkpoint") else ""
        print(f"infinity train: interrupted {done}{saved}; swap files removed", file=sys.stderr)
    if args.json:
        print(json.dumps(s, indent=2))
    elif s.get("steps"):
        offload = ", ".join(f"{k} {v}" for k, v in s["offload"].items() if v != "none") or "no offload"
        print(f"{s['model']}: {s['num_params']:,} params, {s['world_size']} rank(s), ZeRO-{s['stage']}, "
              f"{_dtypes(s)}, {offload}")
        ran = s["steps"] - s["start_step"]
        resumed = f" (resumed at step {s['start_step']})" if s["start_step"] else ""
        if s["first_loss"] is not None:
            print(f"{ran} steps of {s['batch_size']} x {s['seq_len']} tokens in {s['elapsed_s']:.1f} s{resumed}; "
                  f"loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}; {s['tokens_per_s']:,.0f} tokens/s")
        if s.get("val_loss") is not None:
            print(f"validation loss {s['val_loss']:.4f}, perplexity {s['val_perplexity']:.2f}")
        if s.get("memory"):
            from infinity.train.report import memory_line
            print(f"the step with the highest {memory_line(s['memory'])}")
        for what in ("metrics", "trace"):
            if s.get(what):
                print(f"wrote {what} to {s[what]}")
        if s.get("checkpoint"):
            print(f"saved checkpoint {s['checkpoint']}; continue with: infinity train --resume "
                  f"{Path(s['checkpoint']).parent} --steps N")
    return stopped_code if result.interrupted else 0


def _dtypes(summary: dict) -> str:
    """``bf16``, or ``bf16 stored, fp32 compute`` where they differ."""
    stored, compute = summary["param_dtype"], summary.get("compute_dtype", summary["param_dtype"])
    return stored if compute == stored else f"{stored} stored, {compute} compute"

