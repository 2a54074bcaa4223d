"""Rank 0's output: the per-step metrics line, evaluation and sample lines, the progress bar, the summary."""

from __future__ import annotations

import json
import math
import sys
import time

from infinity.config import format_size
from infinity.io.new_files import replaced
from infinity.train.resolve import TrainRun
from infinity.zero.stats import TERMS

__all__ = ["Reporter", "engine_metrics", "memory_line", "attribution_lines"]


def _drop_steps_from(path: str, first_step: int) -> None:
    """Remove the records of steps >= ``first_step``: the run that wrote them went on past its last
    checkpoint, and the resumed run does those steps again (same data, same losses) and writes them itself."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]   # half a line: the writer was killed while writing it
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] >= first_step:
                continue
        except (ValueError, KeyError, TypeError):
            pass   # not a step record: kept as it was, not ours to judge
        kept.append(line)
    with replaced(path, "w") as f:
        f.writelines(kept)


class Reporter:
    """Rank 0: the per-step metrics line, the progress bar and the summary."""

    def __init__(self, run: TrainRun, rank: int, engine, num_params: int):
        self.run, self.engine, self.num_params = run, engine, num_params
        self.losses: list = []
        self.rates: list = []
        self.val_losses: list = []       # (step, loss)
        self.checkpoint: str | None = None
        self.memory: dict | None = None  # the memory report of the step with the highest peak RSS
        self.t_start = time.perf_counter()
        # a resumed run appends: one metrics file holds the whole run, each step once
        if run.metrics and run.start_step:
            _drop_steps_from(run.metrics, run.start_step)
        self.metrics = open(run.metrics, "a" if run.start_step else "w") if run.metrics else None
        self.bar = None
        if run.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=run.steps, initial=run.start_step, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True)

    def say(self, line: str) -> None:
        """A progress line (evaluation, sample) on stderr, beside the bar and without tearing it; stdout
        keeps only the summary (one JSON object with --json)."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def step(self, step: int, loss: float, step_s: float, tokens: int, world_size: int, extra: dict) -> None:
        """One finished step; ``extra``: lr, grad_norm, val_loss and val_perplexity where measured, and
        :func:`engine_metrics` of the step."""
        rate = tokens / step_s if step_s > 0 else 0.0
        self.losses.append(loss)
        self.rates.append(rate)
        prec = self.engine.config.precision   # resolved: what auto chose
        rec = {"step": step, "loss": loss, "tokens": tokens, "tokens_per_s": rate, "step_s": step_s,
               "world_size": world_size, "param_dtype": prec.param_dtype, "compute_dtype": prec.compute_dtype}
        rec.update(extra)
        if "val_loss" in extra:
            self.val_losses.append((step, extra["val_loss"]))
        mem = extra.get("memory")
        if mem and (self.memory is None or (mem["peak_rss_bytes"] or 0) > (self.memory["peak_rss_bytes"] or 0)):
            self.memory = mem
        if self.metrics is not None:
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()   # one line per finished step, readable while training runs
        if self.bar is not None:
            self.bar.set_postfix_str(_postfix(rec), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.bar is not None:
            self.bar.close()

    def summary(self, steps_done: int, world_size: int, interrupted: bool) -> dict:
        cfg = self.run.config
        later = self.rates[1:] or self.rates   # step 0 also records the gather order and warms allocators
        return {
            "model": self.run.model.text, "schedule": cfg.get("schedule"), "num_params": self.num_params, "world_size": world_size,
            "stage": cfg["zero"]["stage"], "param_dtype": self.engine.config.precision.param_dtype,
            "compute_dtype": self.engine.config.precision.compute_dtype,
            "offload": cfg["offload"], "steps": steps_done, "steps_requested": self.run.steps,
            "interrupted": interrupted, "batch_size": self.run.batch_size, "seq_len": self.run.seq_len,
            "accum": self.run.accum, "lr": cfg["optimizer"]["lr"],
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "tokens_per_s": sum(later) / len(later) if later else None,
            "elapsed_s": time.perf_counter() - self.t_start,
            "metrics": self.run.metrics, "trace": self.run.trace,
            "data": self.run.data or "python-stdlib", "swap_dir": self.run.swap_dir,
            "start_step": self.run.start_step, "resumed_from": self.run.resume,
            "val_loss": self.val_losses[-1][1] if self.val_losses else None,
            "val_perplexity": _perplexity(self.val_losses[-1][1]) if self.val_losses else None,
            "val_losses": self.val_losses, "checkpoint": self.checkpoint,
            "peak_rss_bytes": self.memory["run_peak_rss_bytes"] if self.memory else None,
            "memory": self.memory,
        }


def engine_metrics(engine, step_s: float) -> dict:
    """What the engine measured in its last step, flat and JSON-ready; fields it does not measure are absent.

    ``tier_bytes``: bytes this rank holds per tier (in-memory shards count as
    the compute device's). ``moved_bytes``: bytes per tier pair ("host->nvme").
    ``io_gbps``: NVMe bytes read plus written over the whole step time.
    ``stall_pct``: share of the step the compute thread waited on collectives
    and on the store (``comm_wait_s`` + ``io_wait_s``). ``memory``: the step's
    peak RSS and where it went, once ``engine.memory`` is enabled (keys:
    :mod:`infinity.zero.memory_report`). ``attribution``: every second of the engine's
    phases split into compute / I/O waited on / Adam / communication / unattributed, per phase
    (:mod:`infinity.zero.stats`); ``outside_phases_s``: the rest of the loop's step (data, the
    loss outside the model, clipping, the LR scheduler, the loss's all-reduce).
    ``previous_update``: with ``optimizer.update_at`` next_forward, the update the previous step
    launched and this one waited for (its ``adam_s``, ``swap_in_wait_s``, ``swap_out_wait_s`` and
    ``update_wait_s``); a step whose own update is still running then has no ``adam_s``.
    ``speculation``: with ``optimizer.update_at`` speculative, whether the step speculated and how
    that ended (``committed``, ``redone``, ``redo_s``, ``skipped``), and the fallback's ``calm_needed`` / ``calm``.
    """
    last = engine.stats.last_step
    out = {}
    if "attribution" in last:
        out["attribution"] = last["attribution"]
        out["outside_phases_s"] = max(0.0, step_s - last["attribution"]["total"]["wall_s"])
    for key in ("forward_s", "backward_s", "comm_wait_s"):
        if key in last:
            out[key] = last[key]
    if "step_s" in last:
        out["optimizer_s"] = last["step_s"]
    coll = last.get("collectives", {})
    if "bytes" in coll:
        out["collective_bytes"] = {k: v for k, v in coll["bytes"].items() if v}
    if "sent_bytes" in coll:
        out["sent_bytes"] = sum(coll["sent_bytes"].values())
    offload = last.get("offload") or {}
    # a launched update (optimizer.update_at next_forward) runs on into the next step: its Adam and swap
    # times are not known yet, and the line of the step that waited for it carries them (previous_update)
    deferred = offload.get("update_deferred") and "update_wait_s" not in offload
    update_keys = ("adam_s", "swap_in_wait_s", "swap_out_wait_s")
    for key in ("io_wait_s", *update_keys, "peak_bytes", "host_resident_bytes"):
        if key in offload and not (deferred and key in update_keys):
            out[key] = offload[key]
    if "previous_update" in offload:
        out["previous_update"] = dict(offload["previous_update"])
    if "speculation" in offload:
        out["speculation"] = dict(offload["speculation"])
    if "moved_bytes" in offload:
        moved = out["moved_bytes"] = dict(offload["moved_bytes"])
        out["nvme_bytes"] = sum(v for k, v in moved.items() if "nvme" in k.split("->"))
        if step_s > 0:
            out["io_gbps"] = out["nvme_bytes"] / step_s / 1e9
    waits = [out[k] for k in ("comm_wait_s", "io_wait_s") if k in out]
    if waits and step_s > 0:
        out["stall_pct"] = 100.0 * sum(waits) / step_s
    resident = dict(engine.resident_bytes())
    store = resident.pop("store", None) or {}   # the tiered store's bytes per tier, when the engine has one
    tiers = {"device": sum(resident.values()) + store.get("device", 0)}
    tiers.update({k: v for k, v in store.items() if k != "device"})
    out["tier_bytes"] = tiers
    memory = engine.memory_report()
    if memory is not None:
        out["memory"] = memory
    return out


def attribution_lines(attribution: dict) -> list:
    """A table of a step's attributed time (``last_step["attribution"]``): one row per phase and the total,
    one column per term (:data:`infinity.zero.stats.TERMS`), in seconds."""
    head = "  phase     " + "".join(f"{t[:-2]:>14}" for t in ("wall_s",) + TERMS)
    rows = [f"  {phase:<9} " + "".join(f"{attribution[phase][t]:>14.4f}" for t in ("wall_s",) + TERMS)
            for phase in ("forward", "backward", "step", "total")]
    return [head] + rows


def memory_line(mem: dict) -> str:
    """One line: a memory report's peak RSS and its parts (keys: :mod:`infinity.zero.memory_report`)."""
    def size(key):
        return format_size(mem[key]) if mem.get(key) is not None else "n/a"
    parts = [f"{name} {size(key)}" for name, key in (
        ("baseline", "baseline_rss_bytes"), ("store host", "store_host_bytes"), ("store device", "store_device_bytes"),
        ("gathered params", "gathered_params_bytes"), ("grad buffers", "grad_buffers_bytes"),
        ("resident state", "resident_bytes"), ("host cache", "host_cache_bytes"), ("activations", "activation_bytes"),
        ("other", "other_bytes"))]
    return f"peak RSS {size('peak_rss_bytes')} ({mem['peak_rss_source']}): " + ", ".join(parts)


def _postfix(rec: dict) -> str:
    parts = [f"loss {rec['loss']:.3f}", f"{rec['tokens_per_s']:,.0f} tok/s"]
    if "lr" in rec:
        parts.append(f"lr {rec['lr']:.2e}")
    if "val_loss" in rec:
        parts.append(f"val {rec['val_loss']:.3f} (ppl {rec['val_perplexity']:.1f})")
    tiers = rec.get("tier_bytes")
    if tiers:
        parts.append(" ".join(f"{k} {format_size(v)}" for k, v in tiers.items()))
    if rec.get("memory", {}).get("peak_rss_bytes"):
        parts.append(f"peak rss {format_size(rec['memory']['peak_rss_bytes'])}")
    if "io_gbps" in rec:
        parts.append(f"io {rec['io_gbps']:.2f} GB/s")
    if "stall_pct" in rec:
        parts.append(f"stall {rec['stall_pct']:.0f}%")
    return " | ".join(parts)


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")
