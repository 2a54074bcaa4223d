"""``infinity.initialize``: turn an ordinary module into a ZeRO-trained one (DESIGN §1)."""

from __future__ import annotations

import logging
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from infinity.config import Config
from infinity.precision import resolve_precision
from infinity.store import host_cache
from infinity.store.host_malloc import GLIBC_MAX_MMAP_THRESHOLD, fix_mmap_threshold, mmap_threshold
from infinity.comm import watchdog
from infinity.comm.collectives import Collectives, LocalCollectives
from infinity.zero.engine import ZeroEngine
from infinity.zero.materialize import is_meta_model, materialize_steps
from infinity.parallel.mesh import build_mesh
from infinity.zero.optimizer import ZeroAdamW
from infinity.zero.placement import Placement
from infinity.parallel.tensor_parallel import TensorParallel, apply_plan
from infinity.parallel.plans import default_plan
from infinity.zero.units import choose_unit_modules

log = logging.getLogger(__name__)

__all__ = ["initialize", "engine_of"]

_GROUP_KEYS = ("params", "lr", "betas", "eps", "weight_decay")
# model -> its engine, weakly both ways: the engine lives as long as the model's hooks or the optimizer
# hold it, and its finalizer (swap files, threads) runs once both are gone
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def initialize(model: nn.Module, config=None, params=None, init_fn=None, tp_plan=None):
    """Shard ``model``'s training state as ``config`` says; returns ``(model, optimizer)``.

    ``model`` is changed in place: its trainable parameters become views into
    flat per-unit buffers in the compute dtype, and hooks drive gathering and
    gradient reduction from an ordinary forward and ``loss.backward()``.
    ``params`` is what a torch optimizer takes (parameters, or param-group dicts
    with their own ``lr`` / ``weight_decay`` / ``betas`` / ``eps``); default: every
    trainable parameter in one group. The optimizer is a real
    ``torch.optim.Optimizer`` with AdamW semantics; gradients live in the
    engine's shards (``param.grad`` stays None): use
    ``optimizer.clip_grad_norm_(max_norm)`` for clipping.

    ``offload.*`` on host / NVMe puts those shards in the tiered store and runs the
    optimizer step as the pipelined CPU Adam. A model built under
    ``with torch.device("meta"):`` is materialized one unit at a time straight
    into its shards' home tiers, by each module's ``reset_parameters()`` or by
    ``init_fn(module)`` (called on each unit module whole and on each other
    module holding parameters, in model order; see
    :mod:`infinity.zero.materialize`).

    World size 1 needs no ``torch.distributed``; under ``torchrun`` (``WORLD_SIZE``
    etc. set) the default process group is created if it is not up yet
    (NCCL on CUDA, gloo on CPU).

    ``parallel.tensor = T > 1`` builds the 2-D ``("dp", "tp")`` mesh
    (:mod:`infinity.parallel.mesh`), splits the model ``T`` ways by ``tp_plan``
    (default: :func:`infinity.parallel.plans.default_plan` for the model's class;
    see :mod:`infinity.parallel.tensor_parallel`) and shards each rank's split
    parameters over its ``dp`` group only. Every rank must build the same full
    model (same seed) before calling this; ``params`` may name the full
    parameters, they are replaced by their slices. A meta model is
    materialized one init step (unit) at a time by ``init_fn`` or
    ``reset_parameters()``, same values as without TP, each split layer sliced
    as soon as it is real.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if model in _ENGINES and _ENGINES[model]() is not None:
        raise RuntimeError(f"initialize: this {type(model).__name__} was already initialized; its parameters are "
                           "views into the first engine's buffers. Build a fresh model to initialize again")
    cfg = Config.load(config)
    _bound_host_heap(cfg)
    device = _init_distributed(cfg)
    cfg = _resolve_precision(cfg, model, device)
    on_meta = is_meta_model(model)
    # A real model is not moved to the device first: the engine shards it from where it is, each unit's
    # flat buffer made on the device (so a model bigger than the GPU can be sharded, and the device
    # budget is measured without it there); buffers and frozen parameters follow (move_unsharded)
    groups = _param_groups(model, params)
    mesh = build_mesh(cfg.parallel.tensor, device.type)
    tp, coll = None, None
    if mesh.tp_size > 1:
        steps = None
        if on_meta:   # materialized one init step at a time, each split layer sliced as soon as it is real
            units = [m for _, m in choose_unit_modules(model, cfg.zero.unit_classes)]
            steps = materialize_steps(model, units, init_fn, device)
            init_fn = None
        tp = TensorParallel(mesh.tp_group, mesh.tp_size, mesh.tp_rank, mesh.device_mesh)
        plan = tp_plan if tp_plan is not None else default_plan(model, cfg.parallel.sequence)
        with torch.no_grad():
            replaced = apply_plan(model, plan, tp, materialized=steps)
        for g in groups:
            g["params"] = [replaced.get(id(p), p) for p in g["params"]]
        coll = Collectives(mesh.dp_group) if mesh.dp_size > 1 else LocalCollectives()
    elif tp_plan is not None:
        raise ValueError("initialize: tp_plan given but parallel.tensor is 1; set parallel.tensor to split the model")
    o = cfg.optimizer
    engine = ZeroEngine(model, cfg, groups, collectives=coll, device=device, init_fn=init_fn, mesh=mesh,
                        tensor_parallel=tp)
    try:
        optimizer = ZeroAdamW(groups, engine, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    except BaseException:
        engine.close()   # its swap file and threads must not outlive a failed initialize
        raise
    _ENGINES[model] = weakref.ref(engine)
    return model, optimizer


def _resolve_precision(cfg: Config, model: nn.Module, device: torch.device) -> Config:
    """``precision`` with ``auto`` resolved (:mod:`infinity.precision`), rank 0's answer taken by every rank
    (their probes could differ by noise, and ranks must agree on the dtypes they gather in)."""
    agree, rank = None, 0
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        if dist.get_world_size() > 1:
            def agree(choice):
                box = [choice]
                dist.broadcast_object_list(box, src=0)
                return box[0]
    return resolve_precision(cfg, model, device, agree=agree, announce=rank == 0)[0]


def _bound_host_heap(cfg: Config) -> None:
    """``tiers.malloc_mmap_threshold`` and ``tiers.host_cache_bytes`` (see :mod:`infinity.store.host_malloc`
    and :mod:`infinity.store.host_cache`)."""
    setting = cfg.tiers.malloc_mmap_threshold
    offloaded = Placement.from_config(cfg).any_offload
    threshold = mmap_threshold(setting, offloaded)
    # auto leaves a threshold the environment already fixed (glibc reads MALLOC_MMAP_THRESHOLD_ at start)
    if threshold is not None and not (setting == "auto" and "MALLOC_MMAP_THRESHOLD_" in os.environ):
        fix_mmap_threshold(threshold)
    why = host_cache.configure(threshold or GLIBC_MAX_MMAP_THRESHOLD,
                               host_cache.cache_bytes(cfg.tiers.host_cache_bytes, threshold))
    if why is not None:
        log.warning("infinity: tiers.host_cache_bytes: no host block cache, large temporaries are fresh memory "
                    "each time (%s)", why)


def engine_of(model: nn.Module) -> ZeroEngine:
    """The engine ``initialize`` built for ``model`` (stats, units, resident bytes)."""
    ref = _ENGINES.get(model)
    engine = ref() if ref is not None else None
    if engine is None:
        raise KeyError(f"{type(model).__name__} was not passed through infinity.initialize")
    return engine


def _init_distributed(cfg: Config) -> torch.device:
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:  # CUDA-only: one device per local rank, set first so NCCL's communicator is made on it
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"initialize: WORLD_SIZE={os.environ['WORLD_SIZE']} but {missing[0]} is not set; "
                               "start with torchrun or set RANK, MASTER_ADDR and MASTER_PORT")
        _warn_shared_rendezvous_store()
        # dist.timeout_s, not torch's 30 minutes: a hung rank fails the job in words, soon.
        # CUDA-only: device_id binds the group to this rank's device: NCCL forms its communicator there
        # at once (a bad setup fails here, not at the first collective) instead of guessing a device
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.dist.timeout_s),
                                **({"device_id": device} if cuda else {}))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        watchdog.install(dist.get_rank(), dist.get_world_size(), cfg.dist.timeout_s, cfg.dist.warn_after_s,
                         _default_store())
    return device


def _warn_shared_rendezvous_store() -> None:
    """torchrun --max-restarts with its rendezvous store shared with the ranks (its default): the store outlives
    an attempt, so a restarted attempt's ranks can read the previous attempt's gloo addresses and fail to
    connect ("Connection refused"), using up the restarts. Said once, before that happens."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("RANK", 0)) == 0:
        log.warning("infinity: torchrun --max-restarts %d shares its rendezvous store with the ranks, so a restarted "
                    "attempt can find the previous attempt's addresses there and fail to connect; restart with "
                    "--rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's environment "
                    "(a static rendezvous does not restart the other nodes' ranks)", restarts)


def _default_store():
    """The default group's key-value store (the watchdog's channel); None where torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _param_groups(model: nn.Module, params) -> list:
    if params is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if isinstance(params, torch.Tensor):
        raise TypeError("initialize: params must be an iterable of parameters or param-group dicts, "
                        "got a single tensor")
    items = list(params)
    if not items:
        raise ValueError("initialize: params is empty")
    if all(isinstance(x, dict) for x in items):
        groups = []
        for i, g in enumerate(items):
            unknown = sorted(set(g) - set(_GROUP_KEYS))
            if unknown:
                raise ValueError(f"initialize: param group {i} has unsupported key {unknown[0]!r}; "
                                 f"valid keys: {', '.join(_GROUP_KEYS)}")
            if "params" not in g:
                raise ValueError(f"initialize: param group {i} has no 'params'")
            ps = g["params"]
            g = dict(g, params=[ps] if isinstance(ps, torch.Tensor) else list(ps))
            groups.append(g)
        return groups
    if any(isinstance(x, dict) for x in items):
        raise TypeError("initialize: params mixes parameters and param-group dicts")
    return [{"params": items}]
