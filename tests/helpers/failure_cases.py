"""Rank-side cases for tests/zero/test_failures.py (importable by tests/helpers/world.py ranks and by pytest).

Every case builds its own engines, closes them, and returns plain data: a
case that raises is caught here and comes back as what it had recorded so far
plus ``"error"`` (the traceback), so one failing case does not cost a world
restart (every failure injected here happens at the same point on every rank,
so no collective is left half-joined). The cleanup cases run in a fresh
interpreter instead (:func:`cleanup_child`).
"""

from __future__ import annotations

import errno
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zero_cases import VOCAB, Out, global_batch

BATCH = 4          # global batch (rows of SEQ tokens); each rank trains on its share
LR = 1e-2


def rank_world() -> tuple:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def describe(e: BaseException) -> str:
    """An exception as text: type, message and notes, then those of its causes / contexts."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        parts.extend(str(n) for n in getattr(e, "__notes__", []))
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def files_under(path: str) -> list:
    """Every non-directory entry below ``path`` (relative paths)."""
    found = []
    for root, dirs, files in os.walk(path):
        found += [os.path.relpath(os.path.join(root, f), path) for f in files]
    return sorted(found)


def caught(fn, out: dict | None = None) -> dict:
    """Run ``fn(out)``, which fills the dict ``out`` and returns it; if it raises, ``out`` (what it
    filled so far) with ``"error"``: the traceback."""
    out = {} if out is None else out
    try:
        return fn(out)
    except BaseException:
        out["error"] = traceback.format_exc()
        return out


# ---------------------------------------------------------------- models

class Boom(torch.autograd.Function):
    """Identity; its backward raises if it was armed when the forward ran."""

    @staticmethod
    def forward(ctx, x, armed: bool):
        ctx.armed = armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed:
            raise RuntimeError("Boom: injected failure inside a unit's backward")
        return grad, None


class Block(nn.Module):
    """A unit: norm -> up -> tanh -> Boom -> down, residual. ``armed`` arms this forward's Boom."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.armed = False

    def forward(self, x):
        return x + self.down(Boom.apply(torch.tanh(self.up(self.norm(x))), self.armed))


class FailNet(nn.Module):
    """Embedding, ``n`` blocks (the units: children of the largest ModuleList), head."""

    def __init__(self, width: int = 16, hidden: int = 128, n: int = 8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(n))
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids, labels=None):
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))
        return Out(loss, logits)


def build_net(seed: int = 0, **kw) -> FailNet:
    torch.manual_seed(seed)
    return FailNet(**kw)


# ---------------------------------------------------------------- configs

# FailNet(16, 128, 8) in fp32: a block's shard is 20 KiB at world size 1 (12 KiB at 2), the root's
# 16 KiB (8 KiB). Host + device budgets hold one unit's optimizer job but far less than the blocks'
# parameter shards (160 KiB / 96 KiB), so every backward re-reads parameter shards from NVMe.
NVME_BUDGETS = {1: dict(host_bytes=96 * 1024, device_bytes=24 * 1024),
                2: dict(host_bytes=56 * 1024, device_bytes=16 * 1024)}
ALL_NVME = {"optimizer": "nvme", "params": "nvme", "grads": "nvme"}


def make_config(home: str, tmp: str | None, stage: int = 3, world: int = 1, rank: int = 0,
                precision: dict | None = None, offload: dict | None = None, budgets: dict | None = None) -> dict:
    """``home``: "mem" (no offload) or "nvme" (``offload`` on NVMe under ``tmp``/rank<r>)."""
    cfg = {"zero": {"stage": stage},
           "precision": dict(precision or {"param_dtype": "fp32", "reduce_dtype": "fp32"}),
           "optimizer": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    if home == "nvme":
        path = os.path.join(tmp, f"rank{rank}")
        os.makedirs(path, exist_ok=True)
        # every shard really on the disk (none kept host-resident): the failures injected are the disk's
        cfg["offload"] = dict(offload or ALL_NVME, host_resident_bytes=0)
        cfg["tiers"] = dict(budgets or NVME_BUDGETS[world], nvme_path=path)
        # no store prefetch: the reads a backward makes happen in program order, the same on every rank
        cfg["prefetch"] = {"bytes": 0}
        cfg["optimizer"]["threads"] = 1
    return cfg


def local_ids(step: int) -> torch.Tensor:
    rank, world = rank_world()
    return global_batch(step, BATCH).chunk(world)[rank]


def mean_over_ranks(x: torch.Tensor) -> float:
    total = x.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total.item()


def full_params(model, engine) -> dict | None:
    """Rank 0: every parameter (gathered); None elsewhere."""
    rank, _ = rank_world()
    with engine.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None


def train_step(model, opt, step: int) -> float:
    ids = local_ids(step)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return mean_over_ranks(loss)


def wait_store_idle(store, grads=None, timeout_s: float = 30.0) -> None:
    """Wait until no store operation is in flight (e.g. backward's gradient writes to NVMe), so a
    fault injected next hits the optimizer step's own I/O. ``grads``: the engine's gradient reducer,
    whose folds still in flight are finished first (their writes home start only once their copies
    have landed)."""
    if grads is not None:
        grads.wait_writes()
    deadline = time.monotonic() + timeout_s
    with store._cond:
        while any(rec.op is not None for rec in store._keys.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("store operations still in flight after backward")
            store._cond.wait(left)


# ---------------------------------------------------------------- 1. a backward that raises

def _reference(spec: dict, batches: list, tag: str) -> dict:
    import infinity

    rank, world = rank_world()
    model = build_net()
    model, opt = infinity.initialize(model, make_config(spec["home"], os.path.join(spec["tmp"], tag),
                                                        world=world, rank=rank))
    engine = infinity.engine_of(model)
    try:
        losses = [train_step(model, opt, b) for b in batches]
        return {"losses": losses, "params": full_params(model, engine)}
    finally:
        engine.close()


def _failing_backward(model, engine, spec: dict, step: int) -> str:
    """Forward then a backward that raises (``spec["inject"]``: "function" or "hook"); the error text."""
    ids = local_ids(step)
    undo = None
    if spec["inject"] == "function":
        model.blocks[spec.get("boom_block", 2)].armed = True
    try:
        loss = model(input_ids=ids, labels=ids).loss
    finally:
        for b in model.blocks:
            b.armed = False
    if spec["inject"] == "hook":
        if spec["home"] == "mem":
            coll = engine.coll
            original = coll.reduce_scatter
            left = [1]

            def reduce_scatter(*args, **kwargs):
                if left[0]:
                    left[0] -= 1
                    raise RuntimeError("injected failure in reduce_scatter")
                return original(*args, **kwargs)

            coll.reduce_scatter = reduce_scatter
            undo = lambda: setattr(coll, "reduce_scatter", original)  # noqa: E731
        else:
            engine.store._engine.syscalls.inject("preadv", errno.EIO, count=1)
            undo = engine.store._engine.syscalls.clear
    try:
        loss.backward()
    except Exception as e:
        return describe(e)
    finally:
        if undo is not None:
            undo()
    raise AssertionError(f"loss.backward() did not raise (inject={spec['inject']}, home={spec['home']})")


def backward_failure_case(spec: dict) -> dict:
    """Batches 0..4; batch ``fail_at``'s backward raises, the error is caught and training goes on.

    ``mode``: "skip" (zero_grad, skip the batch), "step_first" (``optimizer.step()`` first, which
    must raise, then as "skip"), "checkpoint" (a checkpoint saved after batch 1; after the raise
    save another and load the first, then redo batches 2.. from it).
    """
    return caught(lambda out: _backward_failure_case(spec, out))


def _backward_failure_case(spec: dict, out: dict) -> dict:
    import infinity

    rank, world = rank_world()
    steps, fail_at, mode = 5, spec.get("fail_at", 3 if spec["mode"] == "checkpoint" else 2), spec["mode"]
    if mode == "checkpoint":
        ref_batches = list(range(steps))
    else:
        ref_batches = [b for b in range(steps) if b != fail_at]
    ref = _reference(spec, ref_batches, "ref")

    model = build_net()
    model, opt = infinity.initialize(model, make_config(spec["home"], os.path.join(spec["tmp"], "run"),
                                                        world=world, rank=rank))
    engine = infinity.engine_of(model)
    out.update(ref=ref, ref_batches=ref_batches, raised=None, step_error=None)
    ckpt_before = os.path.join(spec["tmp"], "ckpt-before")
    ckpt_after = os.path.join(spec["tmp"], "ckpt-after")
    try:
        losses, batches = [], []
        for b in range(fail_at):
            losses.append(train_step(model, opt, b))
            batches.append(b)
            if mode == "checkpoint" and b == 1:
                infinity.save_checkpoint(ckpt_before, model, opt)
        out["raised"] = _failing_backward(model, engine, spec, fail_at)
        if mode == "step_first":
            try:
                opt.step()
                out["step_error"] = (False, "optimizer.step() did not raise")
            except Exception as e:
                out["step_error"] = (isinstance(e, RuntimeError), describe(e))
        if mode == "checkpoint":
            infinity.save_checkpoint(ckpt_after, model, opt)
            infinity.load_checkpoint(ckpt_before, model, opt)
            opt.zero_grad()
            losses, batches = losses[:2], batches[:2]
            rest = range(2, steps)
        else:
            opt.zero_grad()
            rest = range(fail_at + 1, steps)
        for b in rest:
            losses.append(train_step(model, opt, b))
            batches.append(b)
        out.update(losses=losses, batches=batches, params=full_params(model, engine))
    finally:
        engine.close()
    return out


# ---------------------------------------------------------------- 2. ENOSPC in the step's write-back

FP16_DYNAMIC = {"param_dtype": "fp16", "reduce_dtype": "fp32", "loss_scale": "dynamic",
                "initial_loss_scale": 1024.0, "loss_scale_window": 2}


def enospc_case(spec: dict) -> dict:
    return caught(lambda out: _enospc_case(spec, out))


def _enospc_run(spec: dict, tag: str, fail_at: int | None, out: dict) -> dict:
    import infinity

    precision = FP16_DYNAMIC if spec["dtype"] == "fp16" else None
    model = build_net()
    # budgets that hold everything: the step's only NVMe traffic is its write-back
    model, opt = infinity.initialize(model, make_config("nvme", os.path.join(spec["tmp"], tag), precision=precision,
                                                        budgets=dict(host_bytes=4 << 20, device_bytes=4 << 20)))
    engine = infinity.engine_of(model)
    scaler = lambda: engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None  # noqa: E731
    out["losses"] = []
    try:
        for step in range(spec["steps"]):
            ids = local_ids(step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            out["losses"].append(loss.item())
            if step == fail_at:
                before = {"group_steps": list(opt.group_steps), "skipped_steps": opt.skipped_steps,
                          "scaler": scaler()}
                wait_store_idle(engine.store, engine.grads)
                engine.store._engine.syscalls.inject("pwritev", errno.ENOSPC, count=1)
                try:
                    opt.step()
                    out["step_error"] = None
                except Exception as e:
                    out["step_error"] = describe(e)
                finally:
                    engine.store._engine.syscalls.clear()
                out["before"] = before
                out["after_failure"] = {"group_steps": list(opt.group_steps), "skipped_steps": opt.skipped_steps,
                                        "scaler": scaler()}
                opt.step()   # the retry, space freed
                out["after_retry"] = {"group_steps": list(opt.group_steps), "skipped_steps": opt.skipped_steps,
                                      "scaler": scaler()}
            else:
                opt.step()
            opt.zero_grad()
        out.update(params=full_params(model, engine), scaler=scaler(), skipped_steps=opt.skipped_steps,
                   group_steps=list(opt.group_steps))
    finally:
        engine.close()
    return out


def _enospc_case(spec: dict, out: dict) -> dict:
    _enospc_run(spec, "ref", None, out.setdefault("ref", {}))
    _enospc_run(spec, "run", spec["fail_at"], out.setdefault("got", {}))
    return out


# ---------------------------------------------------------------- 4. bounded recorded order

def eval_forwards_case(spec: dict) -> dict:
    return caught(lambda out: _eval_forwards_case(spec, out))


def _order_run(spec: dict, tag: str, evals: int) -> dict:
    import infinity

    offload = {"params": "nvme"} if spec["home"] == "nvme" else None
    budgets = dict(host_bytes=1 << 22, device_bytes=1 << 22)
    cfg = make_config(spec["home"], os.path.join(spec["tmp"], tag), offload=offload, budgets=budgets)
    model = build_net(width=8, hidden=16, n=3)
    model, opt = infinity.initialize(model, cfg)
    engine = infinity.engine_of(model)
    out = {}
    try:
        losses = [train_step(model, opt, 0), train_step(model, opt, 1)]
        if evals:
            prefetcher = engine.prefetcher
            out["trace"] = list(prefetcher.trace)
            out["diverged"] = prefetcher.steps_diverged
            ids = local_ids(100)[:1, :4]
            with torch.no_grad():
                for _ in range(evals):
                    model(input_ids=ids)
            seen = prefetcher.seen if hasattr(prefetcher, "seen") else prefetcher._seen
            out["seen_after_evals"] = len(seen)
            out["trace_after_evals"] = list(prefetcher.trace)
        losses.append(train_step(model, opt, 2))
        if evals:
            out["trace_after_step"] = list(prefetcher.trace)
            out["diverged_after_step"] = prefetcher.steps_diverged
        losses.append(train_step(model, opt, 3))
        out.update(losses=losses, params=full_params(model, engine))
    finally:
        engine.close()
    return out


def _eval_forwards_case(spec: dict, out: dict) -> dict:
    out["ref"] = _order_run(spec, "ref", 0)
    out["got"] = _order_run(spec, "run", spec["evals"])
    return out


# ---------------------------------------------------------------- 5. fp16 unscaling in fp32

TINY = 1e-7          # the loss is scaled by this: true gradients are 1e-9 .. 1e-7
TINY_LR = 1e-3
TINY_EPS = 1e-12     # << every gradient checked: Adam's first step moves each element by ~lr, not lr * g / (g + eps)


class TinyGrads(nn.Module):
    """Three parallel linear units; loss = TINY * mean over rows of sum_i c_i * y_i (computed in fp32
    inside forward, so the loss scale multiplies it before any fp16 cast). dL/dW[i, j] = TINY * c_i *
    mean(x_j), dL/db[i] = TINY * c_i: independent of the weights, spread over 1e-9 .. 1e-7."""

    def __init__(self, width: int = 32, out: int = 8, n: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, out) for _ in range(n))
        g = torch.Generator().manual_seed(7)
        self.register_buffer("coef", 0.1 + 0.9 * torch.rand(out, generator=g))

    def forward(self, x):
        x = x.to(self.layers[0].weight.dtype)
        y = sum(layer(x) for layer in self.layers)
        return (y.float() * self.coef).sum(-1).mean() * TINY


def tiny_inputs() -> torch.Tensor:
    """The global batch (2 rows: one per rank at world size 2), entries in [0.1, 1], exact in fp16."""
    g = torch.Generator().manual_seed(11)
    return (0.1 + 0.9 * torch.rand(2, 32, generator=g)).half().float()


def build_tiny(seed: int = 0) -> TinyGrads:
    torch.manual_seed(seed)
    return TinyGrads()


def tiny_reference() -> dict:
    """fp32 gradients of the global batch (same initial weights rounded to fp16, as the engine has)."""
    model = build_tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    loss = model(tiny_inputs())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    return {"grads": grads, "norm": norm}


def fp16_unscale_case(spec: dict) -> dict:
    return caught(lambda out: _fp16_unscale_case(spec, out))


def _fp16_unscale_case(spec: dict, out: dict) -> dict:
    import infinity

    rank, world = rank_world()
    cfg = {"zero": {"stage": spec["stage"]},
           "precision": {"param_dtype": "fp16", "reduce_dtype": "fp16", "loss_scale": 1024},
           "optimizer": {"lr": TINY_LR, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": TINY_EPS}}
    model = build_tiny()
    model, opt = infinity.initialize(model, cfg)
    engine = infinity.engine_of(model)
    try:
        before = full_params(model, engine)
        x = tiny_inputs().chunk(world)[rank]
        model(x).backward()
        norm = float(opt.clip_grad_norm_(1e9))
        opt.step()
        opt.zero_grad()
        out.update(before=before, after=full_params(model, engine), norm=norm, skipped=opt.skipped_steps)
        return out
    finally:
        engine.close()


# ---------------------------------------------------------------- 3. cleanup (run in a fresh interpreter)

def cleanup_child(path: str) -> None:
    """``python -c 'import failure_cases; failure_cases.cleanup_child(path)'``: three cases in one fresh
    interpreter (one torch import), each with its own nvme_path under ``path``; prints one JSON line.

    "init_fails": initialize raises ValueError (a bad betas) after the engine exists: what is left
    under its nvme_path, and the infinity-io threads alive. "dropped": train a step, drop model /
    optimizer / engine without close, gc.collect(): what is left. "exit": train a step and let the
    interpreter exit without close (the parent looks at its nvme_path afterwards).
    """
    import gc
    import json
    import threading

    import infinity

    torch.set_num_threads(1)
    out = {}

    def config(kind: str) -> dict:
        cfg = make_config("nvme", os.path.join(path, kind), budgets=dict(host_bytes=1 << 20, device_bytes=1 << 20))
        out[kind] = {"nvme_path": cfg["tiers"]["nvme_path"]}
        return cfg

    cfg = config("init_fails")
    model = build_net(width=8, hidden=16, n=2)
    r = out["init_fails"]
    try:
        infinity.initialize(model, cfg, params=[{"params": list(model.parameters()), "betas": (0.9, 2.0)}])
        r["error"] = None
    except Exception as e:
        r["error"], r["value_error"] = describe(e), isinstance(e, ValueError)
    r["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("infinity-io"))
    r["files"] = files_under(r["nvme_path"])

    for kind in ("dropped", "exit"):
        cfg = config(kind)
        model, optimizer = infinity.initialize(build_net(width=8, hidden=16, n=2), cfg)
        engine = infinity.engine_of(model)
        out[kind]["loss"] = train_step(model, optimizer, 0)
        out[kind]["files_while_open"] = files_under(out[kind]["nvme_path"])
        if kind == "dropped":
            del model, optimizer, engine
            gc.collect()
            out[kind]["files"] = files_under(out[kind]["nvme_path"])
    print(json.dumps(out), flush=True)
    # "exit": model, optimizer and engine are still alive here; the interpreter exits without close
