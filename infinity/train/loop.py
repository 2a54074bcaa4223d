"""One rank's training loop, and rank 0's output: metrics lines, the trace, the progress bar, the summary.

Per step: this rank's ``accum`` micro-batches of the global batch (forward,
``loss / accum`` backward), one optimizer step, then one all-reduce that
averages the loss over ranks and carries the stop flag, so every rank leaves
the loop after the same step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from infinity.config import Config, format_size
from infinity.train.errors import RankError
from infinity.train.models import build_model, unit_init_fn
from infinity.train.options import TrainResult
from infinity.train.plan import Plan

__all__ = ["run_rank", "engine_metrics"]


def run_rank(plan: Plan, rank: int, world_size: int, stop) -> TrainResult:
    """Train ``plan`` as rank ``rank``; ``stop.is_set()`` asks for a stop after the current step.

    With ``world_size`` > 1 and no process group yet, ``initialize`` creates it
    from the env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and this
    function destroys it at the end.
    """
    owns_group = world_size > 1 and not dist.is_initialized()
    try:
        return _train(plan, rank, world_size, stop)
    finally:
        if owns_group and dist.is_initialized():
            # a gloo group still alive at interpreter exit can abort the process
            # ("terminate called without an active exception") after training succeeded
            dist.destroy_process_group()


def _train(plan: Plan, rank: int, world_size: int, stop) -> TrainResult:
    import infinity
    from infinity.data import TokenDataset
    from infinity.trace import Tracer

    torch.manual_seed(plan.seed)   # same initial weights on every rank (initialize also broadcasts rank 0's)
    config = Config.from_dict(plan.config)
    if plan.model.kind == "gpt":
        # never whole: built on the meta device, each unit materialized by the engine straight into its
        # shards' home tiers (a 3b GPT would otherwise need 12 GB of fp32 on every rank first)
        with torch.device("meta"):
            model, loss_fn = build_model(plan.model, plan.seq_len)
        num_params = sum(p.numel() for p in model.parameters())
        model, optimizer = infinity.initialize(model, config, init_fn=unit_init_fn(model))
    else:
        model, loss_fn = build_model(plan.model, plan.seq_len)
        num_params = sum(p.numel() for p in model.parameters())
        model, optimizer = infinity.initialize(model, config)
    engine = infinity.engine_of(model)
    device = engine.device
    if plan.data is not None:
        dataset = TokenDataset.from_file(plan.data, plan.seq_len)
    elif plan.corpus_bytes is not None:
        dataset = TokenDataset.default(plan.seq_len, plan.corpus_bytes)
    else:
        dataset = TokenDataset.default(plan.seq_len)

    # An engine with a tracer of its own (the offload engine) records its I/O and collectives there and
    # steps it in optimizer.step(); ours then joins it. Otherwise the loop owns one and steps it itself.
    tracer = getattr(engine, "tracer", None)
    owns_tracer = tracer is None
    if owns_tracer:
        if world_size > 1:
            dist.barrier()   # the ranks' tracer clocks start together, so their lanes line up in one trace
        tracer = Tracer(rank)
    tracer.record_step(plan.trace_step if plan.trace else None)
    report = _Reporter(plan, rank, engine, num_params) if rank == 0 else None
    tokens_per_step = plan.batch_size * plan.seq_len
    interrupted, steps_done = False, 0
    try:
        for step in range(plan.steps):
            if owns_tracer:
                tracer.begin_step()
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            micro_batches = dataset.micro_batches(step, plan.batch_size, plan.seed, rank, world_size, plan.accum)
            for micro, (input_ids, labels) in enumerate(micro_batches):
                input_ids, labels = input_ids.to(device), labels.to(device)
                with tracer.span("forward", step=step, micro=micro):
                    loss = loss_fn(model, input_ids, labels)
                with tracer.span("backward", step=step, micro=micro):
                    (loss / plan.accum).backward()
                loss_sum += loss.detach().float()
            # (an engine that steps its own tracer ends the recording inside step(): this span is then
            # dropped, and the engine's own optimizer events stand for it)
            with tracer.span("optimizer", step=step):
                optimizer.step()
                optimizer.zero_grad()
            loss_mean, stop_now = _mean_and_stop(loss_sum / plan.accum, stop, world_size, device)
            step_s = time.perf_counter() - t0
            if owns_tracer:
                tracer.end_step()
            steps_done = step + 1
            if not math.isfinite(loss_mean):
                # the mean over ranks: every rank sees it and stops here, none is left in a collective
                raise RankError(f"loss is {loss_mean} at step {step}: training diverged; lower --lr "
                                f"(now {plan.config['optimizer']['lr']:g})")
            if plan.trace is not None and step == plan.trace_step:
                _dump_trace(tracer, plan.trace, rank, world_size)
            if report is not None:
                report.step(step, loss_mean, step_s, tokens_per_step, world_size)
            if stop_now:
                interrupted = steps_done < plan.steps
                break
    finally:
        engine.close()
        if report is not None:
            report.close()
    summary = report.summary(steps_done, world_size, interrupted) if report is not None else {}
    return TrainResult(rank, world_size, interrupted, summary)


def _mean_and_stop(loss: torch.Tensor, stop, world_size: int, device) -> tuple[float, bool]:
    """Loss averaged over ranks, and whether any rank was asked to stop, in one collective."""
    flag = 1.0 if stop.is_set() else 0.0
    if world_size == 1:
        return float(loss), flag > 0
    both = torch.stack([loss.float(), torch.tensor(flag, device=device)])
    dist.all_reduce(both)   # every rank gets the same flag, so all leave the loop after the same step
    return float(both[0]) / world_size, float(both[1]) > 0


def _dump_trace(tracer, path: str, rank: int, world_size: int) -> None:
    """Every rank's events in one Perfetto file (one process per rank), written by rank 0."""
    if world_size == 1:
        tracer.dump(path)
        return
    part = Path(f"{path}.rank{rank}")
    tracer.dump(part)
    dist.barrier()   # rank 0 reads every part; reading before a rank finished writing would lose it
    if rank == 0:
        events = []
        for r in range(world_size):
            p = Path(f"{path}.rank{r}")
            events += json.loads(p.read_text())["traceEvents"]
            p.unlink()
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        os.replace(tmp, path)


# ---------------------------------------------------------------- rank 0's output

class _Reporter:
    """Rank 0: the per-step metrics line, the progress bar and the summary."""

    def __init__(self, plan: Plan, rank: int, engine, num_params: int):
        self.plan, self.engine, self.num_params = plan, engine, num_params
        self.losses: list = []
        self.rates: list = []
        self.t_start = time.perf_counter()
        self.metrics = open(plan.metrics, "w") if plan.metrics else None
        self.bar = None
        if plan.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=plan.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

    def step(self, step: int, loss: float, step_s: float, tokens: int, world_size: int) -> None:
        rate = tokens / step_s if step_s > 0 else 0.0
        self.losses.append(loss)
        self.rates.append(rate)
        rec = {"step": step, "loss": loss, "tokens": tokens, "tokens_per_s": rate, "step_s": step_s,
               "world_size": world_size}
        rec.update(engine_metrics(self.engine, step_s))
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
        cfg = self.plan.config
        later = self.rates[1:] or self.rates   # step 0 also records the gather order and warms allocators
        return {
            "model": self.plan.model.text, "num_params": self.num_params, "world_size": world_size,
            "stage": cfg["zero"]["stage"], "param_dtype": cfg["precision"]["param_dtype"],
            "offload": cfg["offload"], "steps": steps_done, "steps_requested": self.plan.steps,
            "interrupted": interrupted, "batch_size": self.plan.batch_size, "seq_len": self.plan.seq_len,
            "accum": self.plan.accum, "lr": cfg["optimizer"]["lr"],
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "tokens_per_s": sum(later) / len(later) if later else None,
            "elapsed_s": time.perf_counter() - self.t_start,
            "metrics": self.plan.metrics, "trace": self.plan.trace,
            "data": self.plan.data or "python-stdlib", "swap_dir": self.plan.swap_dir,
        }


def engine_metrics(engine, step_s: float) -> dict:
    """What the engine measured in its last step, flat and JSON-ready; fields it does not measure are absent.

    ``tier_bytes``: bytes this rank holds per tier (in-memory shards count as
    the compute device's). ``moved_bytes``: bytes per tier pair ("host->nvme").
    ``io_gbps``: NVMe bytes read plus written over the whole step time.
    ``stall_pct``: share of the step the compute thread waited on collectives
    and on the store (``comm_wait_s`` + ``io_wait_s``).
    """
    last = getattr(engine.stats, "last_step", {}) or {}
    out = {}
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
    for key in ("io_wait_s", "adam_s", "swap_in_wait_s", "swap_out_wait_s", "peak_bytes"):
        if key in offload:
            out[key] = offload[key]
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
    return out


def _postfix(rec: dict) -> str:
    parts = [f"loss {rec['loss']:.3f}", f"{rec['tokens_per_s']:,.0f} tok/s"]
    tiers = rec.get("tier_bytes")
    if tiers:
        parts.append(" ".join(f"{k} {format_size(v)}" for k, v in tiers.items()))
    if "io_gbps" in rec:
        parts.append(f"io {rec['io_gbps']:.2f} GB/s")
    if "stall_pct" in rec:
        parts.append(f"stall {rec['stall_pct']:.0f}%")
    return " | ".join(parts)
