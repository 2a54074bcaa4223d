"""One rank's training loop: build, resume, train, evaluate, save.

Per step: this rank's ``accum`` micro-batches of the global batch (forward,
``loss / accum`` backward), clipping, one optimizer step and one LR-schedule
step, then one all-reduce that averages the loss over ranks and carries the
stop flag, so every rank leaves the loop after the same step. Then, every
``eval_every`` steps, the validation loss (:mod:`infinity.train.evaluate`),
and every ``save_every`` steps a checkpoint; at the end (or after the step a
Ctrl-C let finish) a last one. Rank 0's output is :mod:`infinity.train.report`.

Resuming is bitwise: the checkpoint restores the model, the optimizer, the
loss scaler and each rank's RNG; its job state the LR schedule and the data
position (batches are a pure function of ``(seed, step)``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from infinity.checkpoint.tensor_file import CheckpointError
from infinity.comm.watchdog import failures_told_to_peers, watch
from infinity.config import Config
from infinity.io.new_files import replaced
from infinity.train.errors import RankError
from infinity.train.evaluate import evaluate, load_tokenizer, make_datasets, sample_text
from infinity.train.job_state import JOB_KEY, JOB_VERSION
from infinity.train.models import build_model, unit_init_fn
from infinity.train.options import TrainResult
from infinity.train.resolve import TrainRun
from infinity.train.report import Reporter, engine_metrics
from infinity.train.schedule import build_lr_scheduler
from infinity.zero.memory_report import warm_torch

__all__ = ["run_rank", "engine_metrics", "SAVE_ATTEMPTS", "SAVE_RETRY_S"]

# The last save of a run is retried this often, this far apart (5 minutes in all) before its steps are given up.
SAVE_ATTEMPTS = 11
SAVE_RETRY_S = 30.0


def run_rank(run: TrainRun, rank: int, world_size: int, stop) -> TrainResult:
    """Train ``run`` as rank ``rank``; ``stop.is_set()`` asks for a stop after the current step.

    With ``world_size`` > 1 and no process group yet, ``initialize`` creates it
    from the env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and this
    function destroys it at the end.
    """
    owns_group = world_size > 1 and not dist.is_initialized()
    try:
        with failures_told_to_peers():   # a failure of this rank alone stops the others at once, in its words
            return _train(run, rank, world_size, stop)
    finally:
        if owns_group and dist.is_initialized():
            # a gloo group still alive at interpreter exit can abort the process
            # ("terminate called without an active exception") after training succeeded
            dist.destroy_process_group()


def _train(run: TrainRun, rank: int, world_size: int, stop) -> TrainResult:
    import infinity

    warm_torch()   # torch's runtime loads on first use: before the engine, so the memory report's baseline holds it
    torch.manual_seed(run.seed)   # same initial weights on every rank (initialize also broadcasts rank 0's)
    config = Config.from_dict(run.config)
    model, optimizer, loss_fn, num_params = _build(run, config)
    engine = infinity.engine_of(model)
    engine.memory.enable()   # each step's peak RSS and where it went (infinity.zero.memory_report)
    device = engine.device
    try:
        scheduler = build_lr_scheduler(optimizer, config.schedule, config.schedule.total_steps)
        if run.resume is not None:
            _resume(run, model, optimizer, scheduler)
        tokenizer = load_tokenizer(run.tokenizer)
        train_set, val_set = make_datasets(run, tokenizer)
    except BaseException:
        engine.close()
        raise

    # The engine records its I/O, collectives and update into its tracer and steps it in optimizer.step();
    # the loop's forward / backward / optimizer spans join the same trace.
    tracer = engine.tracer
    tracer.record_step(run.trace_step if run.trace else None)
    report = Reporter(run, rank, engine, num_params) if rank == 0 else None
    tokens_per_step = run.batch_size * run.seq_len
    # data is split over the data-parallel axis: the tensor-parallel ranks of one dp row must see the same
    # batch (parallel.tensor > 1); without tensor parallelism these are the rank and the world size
    data_rank, data_world = engine.rank, engine.world_size
    clip = config.schedule.clip_grad_norm
    interrupted, steps_done, saved_at = False, run.start_step, run.start_step
    try:
        for step in range(run.start_step, run.steps):
            t0 = time.perf_counter()
            extra = {"lr": optimizer.param_groups[0]["lr"]}
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            micro_batches = train_set.micro_batches(step, run.batch_size, run.seed, data_rank, data_world,
                                                    run.accum)
            for micro, (input_ids, labels) in enumerate(micro_batches):
                input_ids, labels = input_ids.to(device), labels.to(device)
                with tracer.span("forward", step=step, micro=micro):
                    loss = loss_fn(model, input_ids, labels)
                with tracer.span("backward", step=step, micro=micro):
                    (loss / run.accum).backward()
                loss_sum += loss.detach().float()
            # (the engine ends the recording inside step(): this span is then dropped, and the
            # engine's own optimizer events stand for it)
            with tracer.span("optimizer", step=step):
                if clip is not None:
                    extra["grad_norm"] = float(optimizer.clip_grad_norm_(clip))
                optimizer.step()
                optimizer.zero_grad()
            scheduler.step()
            loss_mean, stop_now = _mean_and_stop(loss_sum / run.accum, stop, world_size, device)
            step_s = time.perf_counter() - t0
            steps_done = step + 1
            if not math.isfinite(loss_mean):
                # the mean over ranks: every rank sees it and stops here, none is left in a collective
                raise RankError(f"loss is {loss_mean} at step {step}: training diverged; lower --lr "
                                f"(now {run.config['optimizer']['lr']:g})")
            if report is not None:   # before evaluation, whose gathers are no part of the step
                extra.update(engine_metrics(engine, step_s))
            if run.trace is not None and step == run.trace_step:
                _dump_trace(tracer, run.trace, rank, world_size)
            if val_set is not None and run.eval_every and (steps_done % run.eval_every == 0
                                                            or steps_done == run.steps):
                extra["val_loss"] = evaluate(model, loss_fn, val_set, run, data_rank, data_world, device)
                extra["val_perplexity"] = math.exp(min(extra["val_loss"], 700.0))
                if report is not None:
                    report.say(f"step {steps_done}: val loss {extra['val_loss']:.4f}, "
                               f"perplexity {extra['val_perplexity']:.2f}")
            if run.sample_every and steps_done % run.sample_every == 0:
                text = sample_text(model, tokenizer, train_set, run, world_size, device, steps_done)
                if report is not None:
                    report.say(f"step {steps_done} sample: {text!r}")
            if "val_loss" in extra or (run.sample_every and steps_done % run.sample_every == 0):
                engine.stats.reset()   # their gathers and forward time would count into the next step's stats
            if report is not None:
                report.step(step, loss_mean, step_s, tokens_per_step, world_size, extra)
            if stop_now:
                interrupted = steps_done < run.steps
                break
            if run.save_dir and run.save_every and steps_done % run.save_every == 0 and steps_done < run.steps:
                if _save_or_go_on(run, model, optimizer, scheduler, steps_done, report):
                    saved_at = steps_done
        if run.save_dir and steps_done > saved_at:   # the end of the run, or the step a Ctrl-C let finish
            _save_retrying(run, model, optimizer, scheduler, steps_done, report, saved_at)
    finally:
        engine.close()
        if report is not None:
            report.close()
    summary = report.summary(steps_done, world_size, interrupted) if report is not None else {}
    return TrainResult(rank, world_size, interrupted, summary)


def _build(run: TrainRun, config: Config) -> tuple:
    """The model on the meta device, initialized unit by unit; (model, optimizer, loss_fn, parameter count)."""
    import infinity

    if run.model.kind == "hf":
        model, loss_fn = build_model(run.model, run.seq_len)   # built whole by transformers
        num_params = sum(p.numel() for p in model.parameters())
        return (*infinity.initialize(model, config), loss_fn, num_params)
    # never whole: built on the meta device, each unit materialized by the engine straight into its
    # shards' home tiers (a 3b GPT would otherwise need 12 GB of fp32 on every rank first); a pretrained
    # model's units are filled from its safetensors files the same way
    with torch.device("meta"):
        model, loss_fn = build_model(run.model, run.seq_len)
    num_params = sum(p.numel() for p in model.parameters())
    if run.model.kind == "pretrained":
        from infinity.models.pretrained import SafetensorsWeights
        init_fn = SafetensorsWeights(run.model.name, model)
    else:
        init_fn = unit_init_fn(model)
    return (*infinity.initialize(model, config, init_fn=init_fn), loss_fn, num_params)


def _resume(run: TrainRun, model, optimizer, scheduler) -> None:
    """Model, optimizer, loss scaler and this rank's RNG from the checkpoint; then the LR schedule's position."""
    import infinity

    infinity.load_checkpoint(run.resume, model, optimizer)
    lr = run.config["optimizer"]["lr"]
    scheduler.load_state_dict(run.lr_scheduler_state)
    if run.lr_override:   # --lr on resume: the schedule continues from the new base
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    # the lr of the next step, from the (maybe changed) schedule: base * factor, as LambdaLR computes it
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * fn(scheduler.last_epoch)


def _save(run: TrainRun, model, optimizer, scheduler, steps_done: int, report) -> None:
    import infinity

    job = {"version": JOB_VERSION, "next_step": steps_done, "steps": run.steps, "model": run.model.text,
           "seed": run.seed, "batch_size": run.batch_size, "seq_len": run.seq_len, "accum": run.accum,
           "data": run.data, "corpus_bytes": run.corpus_bytes, "tokenizer": run.tokenizer,
           "val_fraction": run.val_fraction, "schedule": run.config["schedule"],
           "lr_scheduler": scheduler.state_dict(), "save_node_local": run.save_node_local}
    path = infinity.save_checkpoint(run.save_dir, model, optimizer, step=steps_done, keep_last=run.keep_last,
                                    client_state={JOB_KEY: job}, node_local=run.save_node_local)
    if report is not None:
        report.checkpoint = str(path)


def _save_or_go_on(run: TrainRun, model, optimizer, scheduler, steps_done: int, report) -> bool:
    """A periodic save; when it fails (every rank learns it from save_checkpoint), training goes on from the
    state in memory, which is no worse than before the save: the previous checkpoint is intact."""
    try:
        _save(run, model, optimizer, scheduler, steps_done, report)
        return True
    except CheckpointError as e:
        if report is not None:
            report.say(f"infinity train: the checkpoint at step {steps_done} failed ({e}); training goes on and "
                       "saves again at the next --save-every step and at the end")
        return False


def _save_retrying(run: TrainRun, model, optimizer, scheduler, steps_done: int, report, saved_at: int) -> None:
    """The last save: the steps since the last checkpoint exist only in memory, so a failure (a full disk)
    is retried while someone frees space, instead of losing them. Every rank retries in step: each save
    either succeeds or raises on every rank (save_checkpoint agrees on the outcome)."""
    for attempt in range(1, SAVE_ATTEMPTS + 1):
        try:
            _save(run, model, optimizer, scheduler, steps_done, report)
            return
        except CheckpointError as e:
            if attempt == SAVE_ATTEMPTS:
                since = f"step {saved_at}" if saved_at > run.start_step or run.resume else "the start"
                raise CheckpointError(f"{e}; gave up after {SAVE_ATTEMPTS} attempts: the {steps_done - saved_at} "
                                      f"steps since {since} are lost") from None
            if report is not None:
                report.say(f"infinity train: the checkpoint at step {steps_done} failed ({e}); the trained state "
                           f"is kept: free space under {run.save_dir} (or fix the cause), retrying in "
                           f"{SAVE_RETRY_S:g} s (attempt {attempt + 1} of {SAVE_ATTEMPTS}; a second Ctrl-C gives up)")
            time.sleep(SAVE_RETRY_S)


def _mean_and_stop(loss: torch.Tensor, stop, world_size: int, device) -> tuple[float, bool]:
    """Loss averaged over ranks, and whether any rank was asked to stop, in one collective."""
    flag = 1.0 if stop.is_set() else 0.0
    if world_size == 1:
        return float(loss), flag > 0
    both = torch.stack([loss.float(), torch.tensor(flag, device=device)])
    with watch("the training loop's loss and stop-flag all_reduce (end of step)"):
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
        with replaced(path, "w") as f:   # never through a symlink planted at a guessable temp name
            f.write(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


