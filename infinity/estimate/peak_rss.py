"""The predicted peak RSS of a training process, and the minimum tier budgets ``initialize`` enforces.

:func:`predict_peak_rss` is the formula (one term per owner of memory; its
docstring says what each is and why it is bounded); :func:`bound_for_model`
computes every term for a model and a config without building anything: the
model is laid out into units on the meta device, exactly as ``initialize``
would, and its forward is run on the meta device to count the activations it
saves. ``infinity estimate --model NAME --config FILE`` prints both, and
:mod:`infinity.zero.memory_report` measures the same terms in a real run, so a
bound can be checked against what a step held (``tests/estimate/test_rss_bound.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from infinity.precision import nominal_dtypes
from infinity.config import Config, format_size
from infinity.store import Tier, host_cache
from infinity.store.budget import resolve_budgets
from infinity.zero.engine import DTYPES
from infinity.zero.grads import MAX_INFLIGHT
from infinity.zero.live_units import resolve_cap
from infinity.zero.memory_report import SavedTensorMeter, rss_bytes, warm_torch
from infinity.zero.placement import Placement
from infinity.zero.stage import StagePolicy
from infinity.zero.units import group_index, plan_units, shard_align_numel

__all__ = ["RssBound", "predict_peak_rss", "bound_for_model", "gpt_bound", "meta_activation_bytes", "min_budgets",
           "describe_min_budgets", "SLACK_FIXED_BYTES", "SLACK_FRACTION"]

# Allocator slack allowance: a fixed part for what grows after the baseline whatever the model (torch's
# autograd engine and kernel workspaces, the optimizer's and I/O threads' scratch) plus a fraction of the
# step's transient terms (temporaries not saved for backward, activation gradients, the freed buffer
# not yet returned). Measured beyond the other terms: under 1 MiB in tests/estimate/test_rss_bound.py's fp32 runs;
# 26-28 MiB in a bf16 `infinity train` run of an 8 x 256 GPT, whose corpus is loaded after initialize.
SLACK_FIXED_BYTES = 32 * 2**20
SLACK_FRACTION = 0.25


@dataclass(frozen=True)
class RssBound:
    """The terms of :func:`predict_peak_rss`, in bytes; ``total_bytes`` is their sum."""

    baseline_bytes: int
    host_tier_bytes: int
    device_tier_bytes: int
    gathered_params_bytes: int
    grad_buffers_bytes: int
    resident_bytes: int
    activation_bytes: int
    slack_bytes: int
    host_cache_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(asdict(self).values())

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}

    def lines(self) -> list:
        """One line per term, for printing."""
        d = asdict(self)
        width = max(len(k) for k in d)
        return [f"  {k.ljust(width)}  {format_size(v):>10}" for k, v in d.items()] + \
            [f"  {'total'.ljust(width)}  {format_size(self.total_bytes):>10}"]


def predict_peak_rss(baseline_bytes: int, units: list, placement: Placement, stage: int, param_itemsize: int,
                     reduce_itemsize: int, budgets: dict, device_is_host: bool, max_live_bytes: int,
                     activation_bytes: int, largest_param_numel: int, host_cache_bytes: int = 0) -> RssBound:
    """An upper bound on one rank's peak RSS while it trains, term by term.

    - ``baseline``: the process's RSS before ``initialize`` (interpreter, torch, the model on meta), with
      torch's runtime loaded (:func:`~infinity.zero.memory_report.warm_torch`; else add ~85 MiB).
    - ``host_tier``: with a store (anything offloaded), ``tiers.host_bytes``: the host buffer pool never
      holds more, cached buffers included. 0 without a store.
    - ``device_tier``: with a store on a CPU compute device, ``tiers.device_bytes``: there the device tier
      is ordinary RAM. 0 on CUDA (device memory is not RSS) or without a store.
    - ``gathered_params``: stage 3: ``prefetch.max_live_bytes``, the cap on full parameters gathered at
      once. Stages 0-2 keep every full parameter, counted under ``resident``.
    - ``grad_buffers``: stages 2-3: full gradients wait for their reduce-scatter, each beside its output
      shard; :data:`~infinity.zero.grads.MAX_INFLIGHT` + 1 reductions can be in flight at the moment one
      is launched, and one more unit accumulates, so (MAX_INFLIGHT + 2) x the largest unit's full
      gradient + output, plus the root unit's (its gradients arrive from the first backward op to the
      last). Stage 1: the reduce-scatter outputs of the step, MAX_INFLIGHT + 1 shards. Plus, at every
      stage, the largest parameter's ``.grad`` in the compute dtype, which autograd materializes before
      the hook moves it into the flat gradient (a tied embedding's lives through the whole backward).
    - ``resident``: model state the engine keeps in memory (classes placed on ``none``): stages 0-2's
      full parameters, stages 0-1's gradient arena (full size), in-memory gradient shards, fp32
      master (unless it is the parameter) and Adam moments. On CUDA these are device memory: 0.
    - ``activations``: tensors the forward saves for backward (measured, e.g. by
      :func:`meta_activation_bytes`); 0 on CUDA.
    - ``slack``: :data:`SLACK_FIXED_BYTES` + :data:`SLACK_FRACTION` x (gathered + grad buffers +
      activations): allocator slack, temporaries, torch's runtime growth. It assumes freed buffers go
      back to the OS: glibc does so above its mmap threshold, which by default rises to the size of
      each freed block (up to 32 MiB), after which unit-sized buffers stay in its heap. Fix it
      (``MALLOC_MMAP_THRESHOLD_=131072``) for the bound to hold with units of a few MiB or more.
    - ``host_cache``: the cap of :mod:`~infinity.store.host_cache` (``tiers.host_cache_bytes``): freed
      blocks above the threshold it keeps for reuse; in a step of many big temporaries it is full at the
      peak. Host RAM on any device.

    ``budgets``: ``{Tier.HOST: bytes, Tier.DEVICE: bytes}`` (resolved, as ``initialize`` resolves them);
    ``largest_param_numel``: the most elements of any one parameter.
    """
    stored = placement.any_offload
    host_tier = budgets[Tier.HOST] if stored else 0
    device_tier = budgets[Tier.DEVICE] if stored and device_is_host else 0
    gathered = max_live_bytes if stage == 3 else 0
    largest_full = max(u.padded_numel for u in units) * reduce_itemsize
    largest_shard = max(u.shard_numel for u in units) * reduce_itemsize
    root = next((u for u in units if u.is_root), None)
    if stage >= 2:
        grads = (MAX_INFLIGHT + 2) * (largest_full + largest_shard)
        grads += (root.padded_numel + root.shard_numel) * reduce_itemsize if root is not None else 0
    else:
        grads = (MAX_INFLIGHT + 1) * largest_shard if stage == 1 else 0
    grads += largest_param_numel * param_itemsize
    resident = _resident_bytes(units, placement, stage, param_itemsize, reduce_itemsize)
    if not device_is_host:
        gathered, grads, resident, activation_bytes = 0, 0, 0, 0
    slack = SLACK_FIXED_BYTES + int(SLACK_FRACTION * (gathered + grads + activation_bytes))
    return RssBound(baseline_bytes, host_tier, device_tier, gathered, grads, resident, activation_bytes, slack,
                    host_cache_bytes)


def _resident_bytes(units: list, placement: Placement, stage: int, param_itemsize: int, reduce_itemsize: int) -> int:
    """Bytes of model state kept in engine memory (not in the store), as the engine lays it out."""
    total = 0
    master_bytes = placement.master_itemsize(param_itemsize)
    for u in units:
        if stage < 3:
            total += u.padded_numel * param_itemsize          # full parameters; the shard is a view
        elif placement.params is None:
            total += u.shard_numel * param_itemsize
        if stage < 2:
            total += u.padded_numel * reduce_itemsize         # the arena; the shard is a view
        elif placement.grads is None:
            total += u.shard_numel * reduce_itemsize
        if placement.optimizer is None:
            total += u.shard_numel * (2 * placement.moment_itemsize + master_bytes)
    return total


def min_budgets(units: list, config: Config) -> dict:
    """``initialize``'s minimum tier budgets for these units (:meth:`UnitPlacement.min_budgets
    <infinity.zero.placement.UnitPlacement.min_budgets>`, the check ``initialize`` runs): ``{Tier: (bytes,
    why)}``; None when nothing is offloaded (no budgets apply)."""
    placement = Placement.from_config(config)
    if not placement.any_offload:
        return None
    stored = DTYPES[nominal_dtypes(config.precision)[0]].itemsize
    return placement.of(units, StagePolicy.of(config.zero.stage), stored,
                        DTYPES[config.precision.reduce_dtype].itemsize).min_budgets()


def meta_activation_bytes(model: nn.Module, forward) -> int:
    """Bytes of the tensors ``forward(model)`` saves for backward, counted on the meta device (so nothing
    is allocated whatever the model's size; attention as a fused kernel saves it,
    :class:`~infinity.estimate.activations.FlashOnMeta`); unique storages, parameters excluded, as the
    engine's memory report counts them."""
    from infinity.estimate.activations import FlashOnMeta

    meter = SavedTensorMeter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack), FlashOnMeta():
        out = forward(model)
    peak = meter.peak_bytes
    del out
    return peak


def bound_for_model(build, config: Config, world_size: int = 1, forward=None,
                    baseline_bytes: int | None = None, device: torch.device | None = None) -> tuple:
    """``(RssBound, min_budgets(...))`` for the model ``build()`` makes (built on the meta device) trained
    with ``config`` on ``world_size`` data-parallel ranks. ``forward(model)``: one micro-batch's forward
    on meta tensors, returning the loss (None: no activations counted). ``baseline_bytes``: the training
    process's RSS before ``initialize`` (default, a stand-in: this process's RSS with torch warmed)."""
    if config.parallel.tensor > 1:
        raise ValueError("bound_for_model: tensor parallelism is not modelled (parallel.tensor > 1)")
    if baseline_bytes is None:
        warm_torch()
    baseline = rss_bytes() if baseline_bytes is None else baseline_bytes
    with torch.device("meta"):
        model = build()
    stage = config.zero.stage
    stored, compute = nominal_dtypes(config.precision)   # auto: as initialize would resolve it, nominally
    param_dtype, compute_dtype = DTYPES[stored], DTYPES[compute]
    reduce_dtype = DTYPES[config.precision.reduce_dtype]
    params = [p for p in model.parameters() if p.requires_grad]
    group_of = group_index(model, [{"params": params}])
    align = shard_align_numel({param_dtype, reduce_dtype, torch.float32})
    units = plan_units(model, group_of, config.zero.unit_classes, 1 if stage == 0 else world_size, align)
    held = max(param_dtype.itemsize, compute_dtype.itemsize)   # a gathered unit, upcast where compute is wider
    full = {u.name: u.padded_numel * held for u in units}
    root = next((u.name for u in units if u.is_root), None)
    max_live = resolve_cap(config.prefetch.max_live_bytes, full, root) if stage == 3 else 0
    device = device if device is not None else torch.device("cpu")
    if compute_dtype != torch.float32:
        model.to(compute_dtype)   # the engine computes in the compute dtype
    activations = meta_activation_bytes(model, forward) if forward is not None else 0
    bound = predict_peak_rss(baseline, units, Placement.from_config(config), stage, param_dtype.itemsize,
                             reduce_dtype.itemsize, resolve_budgets(config.tiers, device), device.type == "cpu",
                             max_live, activations, max(p.numel() for p in params),
                             host_cache.cap_of(config.tiers, Placement.from_config(config).any_offload))
    return bound, min_budgets(units, config)


def describe_min_budgets(need: dict | None, budgets: dict | None = None) -> list:
    """Lines naming ``initialize``'s minimum tier budgets (from :func:`min_budgets`), and whether the
    config's ``budgets`` ({Tier: bytes}, resolved) meet them."""
    if need is None:
        return ["  nothing offloaded: no tier budgets apply"]
    out = []
    for tier, key in ((Tier.HOST, "tiers.host_bytes"), (Tier.DEVICE, "tiers.device_bytes")):
        least, why = need[tier]
        out.append(f"  {key} >= {least} bytes ({format_size(least)}): {why}")
        if budgets is not None:
            verdict = "enough" if budgets[tier] >= least else "BELOW the minimum: initialize refuses it"
            out.append(f"    the config's {format_size(budgets[tier])}: {verdict}")
    return out


def gpt_bound(model_cfg, config: Config, world_size: int = 1, tokens: int | None = None) -> dict:
    """``infinity estimate``'s view for a built-in GPT: the bound for a micro-batch of ``tokens`` tokens per
    rank (default: one sequence of the model's block size; cut into sequences of at most the block size),
    and ``initialize``'s minimum tier budgets. JSON-ready, with ``lines`` to print."""
    from infinity.models import GPT

    seq = min(tokens or model_cfg.block_size, model_cfg.block_size)
    batch = max(1, (tokens or seq) // seq)

    def forward(model):
        ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
        return model(input_ids=ids, labels=ids).loss

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    bound, need = bound_for_model(lambda: GPT(model_cfg), config, world_size, forward, device=device)
    lines = [f"peak RSS per rank, predicted for a micro-batch of {batch} x {seq} tokens on {device.type} "
             "(terms: infinity/estimate/peak_rss.py; baseline = this process's RSS, torch warmed):"]
    lines += bound.lines()
    lines += ["minimum tier budgets initialize enforces (below them it refuses to start):"]
    lines += describe_min_budgets(need, resolve_budgets(config.tiers, device))
    budgets = None if need is None else {
        key: {"bytes": need[tier][0], "why": need[tier][1]}
        for tier, key in ((Tier.HOST, "host_bytes"), (Tier.DEVICE, "device_bytes"))}
    return {"micro_batch": [batch, seq], "device": device.type, "rss_bound": bound.to_dict(),
            "min_budgets": budgets, "lines": lines}
