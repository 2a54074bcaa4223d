"""The planner behind ``infinity plan`` and ``auto``: enumerate candidate configs, predict each, pick the fastest.

A candidate is one value per knob in :data:`DIMENSIONS` (stage, each tensor class's home, chunk
size, overlap, activation checkpointing, prefetch, reduce dtype, stored state formats). Each is
built as a real :class:`~infinity.config.Config` (a combination the config refuses is dropped,
so a rule added there, or a mode added by a later change, is followed here without a copy),
checked against the memory granted (the budgets ``initialize`` enforces, and the device and RAM
its predicted peak needs), and predicted by :mod:`infinity.plan.cost`. The fastest feasible one
wins, save that predictions within :data:`TIE` of the fastest are ties and the one moving the fewest
bytes through the disk wins among them; the next best are kept with the terms they lost by. A
request nothing fits is refused before anything is allocated, naming the least memory that would run.

Adding a knob or a mode is a row in :data:`DIMENSIONS` (a config key and its values); a stored
state format needs its bytes in :meth:`~infinity.zero.placement.UnitPlacement.stored_itemsizes` and its CPU Adam rate in
:data:`infinity.plan.rates.ADAM_MODES`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from infinity.config import Config, ConfigError, format_size
from infinity.precision import PrecisionChoice, nominal_dtypes
from infinity.plan.cost import Layout, Prediction, predict, unit_placement
from infinity.plan.rates import ComputeRates, PlanInputError, Rates
from infinity.store import Tier
from infinity.store.budget import resolve_budgets
from infinity.zero.engine import DTYPES
from infinity.zero.live_units import resolve_cap
from infinity.zero.memory_report import rss_bytes, warm_torch
from infinity.zero.stats import PHASES, TERMS
from infinity.zero.units import group_index, plan_units, shard_align_numel

__all__ = ["PlanRequest", "Plan", "Choice", "InfeasiblePlan", "DIMENSIONS", "make_plan", "model_layout"]

_MiB = 2**20
TIERS = ("none", "host", "nvme")
# knob -> the values tried; "section.key". optimizer.master remainder is exact, so it is tried (the config
# refuses it but for bf16 parameters); lossy moments (bf16, int8) are planned only when asked for,
# ``--fix optimizer.moments=bf16``. When the update runs is chosen among step, backward (refused
# by the config with clipping or fp16) and next_forward; speculative is planned only when asked for
# (``--fix optimizer.update_at=speculative``): whether it pays depends on how often the norm clips (a
# redo), which no profile measures. Checkpointing only the first N units is priced when asked for
# (``--fix zero.activation_checkpointing=N``), not searched: its step is predicted right, but where it
# keeps more activations the peak RSS predicted runs 11-13% over the measured (GPT-2 small at 1 GiB:
# the activation, gradient-buffer and slack terms do not all peak at one moment), outside the planner's
# ±10%.
DIMENSIONS = {
    "zero.stage": (0, 1, 2, 3),
    "offload.params": TIERS,
    "offload.grads": TIERS,
    "offload.optimizer": TIERS,
    "optimizer.update_at": ("step", "backward", "next_forward"),
    "zero.activation_checkpointing": (False, True),
    "zero.activation_offload": TIERS,   # with recompute only: keep, recompute, recompute + host or NVMe
    "precision.reduce_dtype": ("fp32", "bf16"),
    "offload.chunk_bytes": (64 * _MiB, 192 * _MiB, 256 * _MiB),
    "prefetch.bytes": (0, 256 * _MiB),
    "optimizer.master": ("fp32", "remainder"),
    "optimizer.moments": ("fp32",),
}
# knobs that change nothing unless something is stored (chunking) or stage-3 parameters are (prefetch)
_STORE_ONLY = ("offload.chunk_bytes",)
_STORED_PARAMS_ONLY = ("prefetch.bytes",)
# Predicted steps this close to the fastest are ties: the candidate moving the fewest disk bytes wins among
# them. Candidates that far apart differ by less than the model's own error between configs: at GPT-2 2.7B
# the fp32 and remainder masters came out 0.8% apart (the remainder's slower Adam against its 10 GiB less
# traffic, hidden under a compute-bound backward), and which one won flipped with the compute timing of
# the plan; measured, the remainder master's step was 4 s (5%) faster (tools/bench_plan.py). A disk that
# moves less is the pick whose step holds when compute runs slower than timed.
TIE = 0.03


class InfeasiblePlan(ValueError):
    """No candidate fits the memory granted; the message names the least that would run."""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. ``build()``: the model (called under ``torch.device("meta")``); ``loss_fn(model,
    input_ids, labels)``; ``batch`` x ``seq`` tokens per rank per step; ``world``: data-parallel ranks
    on this machine; ``host_bytes`` / ``device_bytes``: the memory granted per rank (None: the
    tiers' ``auto``); ``base``: the user's config sections kept as they are (optimizer hyper-parameters,
    schedule, ...), whose own rules the candidates must pass."""

    build: Callable[[], nn.Module]
    loss_fn: Callable
    model_name: str
    vocab_size: int
    batch: int
    seq: int
    world: int = 1
    host_bytes: int | None = None
    device_bytes: int | None = None
    nvme_path: str | None = "infinity_swap"
    param_dtype: str = "auto"          # precision.param_dtype; auto is resolved into ``precision`` first
    precision: PrecisionChoice | None = None   # what auto measured (run_plan fills it)
    base: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)   # knob -> the one value to plan with ("zero.stage": 3)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass
class Choice:
    """One candidate: its knob values, its config, its prediction, and whether (why not) it fits."""

    knobs: dict
    config: Config
    prediction: Prediction | None
    fits: bool
    why_not: str | None = None
    needs: dict = field(default_factory=dict)     # {"host_bytes": least, "device_bytes": least}

    @property
    def step_s(self) -> float:
        return self.prediction.step_s if self.prediction is not None else float("inf")

    @property
    def disk_bytes(self) -> int:
        """Bytes its predicted step reads from and writes to the NVMe tier."""
        return sum(v for k, v in self.prediction.moved_bytes.items() if "nvme" in k) if self.prediction else 0

    def label(self) -> str:
        k = self.knobs
        off = "/".join(f"{c}:{k[f'offload.{c}']}" for c in ("params", "grads", "optimizer"))
        extras = [f"chunk {format_size(k['offload.chunk_bytes'])}" if _stores(k) else None,
                  f"overlap in {k['optimizer.update_at']}" if k["optimizer.update_at"] != "step" else None,
                  _ckpt_label(k["zero.activation_checkpointing"]),
                  f"activations to {k['zero.activation_offload']}" if k["zero.activation_offload"] != "none" else None,
                  f"reduce {k['precision.reduce_dtype']}",
                  ("prefetch" if k["prefetch.bytes"] else "no prefetch") if _stored_params(k) else None,
                  f"master {k['optimizer.master']}" if k["optimizer.master"] != "fp32" else None,
                  f"moments {k['optimizer.moments']}" if k["optimizer.moments"] != "fp32" else None]
        return f"stage {k['zero.stage']} {off} " + ", ".join(e for e in extras if e)


def _ckpt_label(value) -> str | None:
    if value is True:
        return "ckpt"
    return f"ckpt first {value} units" if value else None


@dataclass
class Plan:
    """The planner's answer: ``chosen``, the ``alternatives`` that came next (with why they lost), the
    ``faster_unfit`` candidates the memory granted ruled out, and what it ran on."""

    request: PlanRequest
    rates: Rates
    compute: dict                     # param dtype -> ComputeRates
    chosen: Choice
    alternatives: list
    faster_unfit: list
    considered: int
    budgets: dict

    def config_dict(self) -> dict:
        """The chosen config, the sections the planner sets plus the user's: loadable as it is."""
        return _config_sections(self.chosen.config)

    def why_lost(self, other: Choice) -> str:
        """``other``'s predicted step against the chosen one's, by the terms that differ most."""
        if other.step_s < self.chosen.step_s:   # a tie (TIE) the chosen one won by moving less through the disk
            return (f"predicted {1 - other.step_s / self.chosen.step_s:.1%} faster ({other.step_s:.2f}s), within "
                    f"the {TIE:.0%} tie, but moves {format_size(other.disk_bytes - self.chosen.disk_bytes)} more "
                    "through the disk per step")
        a, b = self.chosen.prediction.totals(), other.prediction.totals()
        diffs = sorted(((b[t] - a[t], t) for t in TERMS), key=lambda d: -abs(d[0]))
        parts = [f"{t[:-2]} {d:+.2f}s" for d, t in diffs if abs(d) >= 0.005][:3]
        ratio = other.step_s / max(self.chosen.step_s, 1e-9)
        return f"{ratio:.2f}x the step ({other.step_s:.2f}s): " + (", ".join(parts) or "within noise")

    def to_dict(self) -> dict:
        return {
            "model": self.request.model_name, "tokens_per_rank": self.request.tokens,
            "micro_batch": [self.request.batch, self.request.seq], "world": self.request.world,
            "budgets": {"host_bytes": self.budgets[Tier.HOST], "device_bytes": self.budgets[Tier.DEVICE]},
            "config": self.config_dict(), "chosen": self.chosen.label(), "knobs": self.chosen.knobs,
            "predicted": self.chosen.prediction.to_dict(),
            "alternatives": [{"label": c.label(), "knobs": c.knobs, "step_s": c.step_s, "why_lost": self.why_lost(c)}
                             for c in self.alternatives],
            "faster_unfit": [{"label": c.label(), "step_s": c.step_s, "why_not": c.why_not}
                             for c in self.faster_unfit],
            "considered": self.considered, "rates": self.rates.to_dict(),
            "compute": {k: v.to_dict() for k, v in self.compute.items()},
        }


def _stores(knobs: dict) -> bool:
    return any(knobs[f"offload.{c}"] != "none" for c in ("params", "grads", "optimizer"))


def _stored_params(knobs: dict) -> bool:
    return knobs["zero.stage"] == 3 and knobs["offload.params"] != "none"


def _config_sections(config: Config) -> dict:
    return config.to_dict()


def compute_dtype(request: PlanRequest) -> str:
    """The dtype the request's compute runs in (what its timing measured)."""
    if request.precision is not None:
        return request.precision.compute_dtype
    if request.param_dtype == "auto":
        raise ValueError("PlanRequest: param_dtype auto must be resolved (run_plan) before planning")
    return request.param_dtype


def model_layout(request: PlanRequest, stage: int, reduce_dtype: str, baseline_bytes: int) -> Layout:
    """The units ``initialize`` would cut (meta device) at ``stage``."""
    with torch.device("meta"):
        model = request.build()
    param_dtype, reduce = DTYPES[compute_dtype(request)], DTYPES[reduce_dtype]
    params = [p for p in model.parameters() if p.requires_grad]
    group_of = group_index(model, [{"params": params}])
    align = shard_align_numel({param_dtype, reduce, torch.float32})
    units = plan_units(model, group_of, (), 1 if stage == 0 else request.world, align)
    return Layout(units=units, largest_param_numel=max(p.numel() for p in params), baseline_bytes=baseline_bytes)


def _knob_dict(values: tuple) -> dict:
    return dict(zip(DIMENSIONS, values))


def _candidate_dict(request: PlanRequest, knobs: dict, io: dict) -> dict:
    d = {name: dict(section) for name, section in request.base.items() if isinstance(section, dict)}
    for key, value in knobs.items():
        section, name = key.split(".")
        d.setdefault(section, {})[name] = value
    prec = d.setdefault("precision", {})
    if request.precision is not None:   # auto, measured: a bf16 store over fp32 compute only where it helps
        prec["param_dtype"], prec["compute_dtype"] = request.precision.for_config(
            _stored_params(knobs), knobs["optimizer.master"] == "remainder")
    else:
        prec["param_dtype"] = request.param_dtype
        if prec.get("compute_dtype", "auto") == "auto":
            prec["compute_dtype"] = request.param_dtype
    d.setdefault("tiers", {})["nvme_path"] = request.nvme_path
    d["io"] = {**d.get("io", {}), **io}
    return d


def _enumerate(request: PlanRequest, io: dict):
    """Every distinct valid knob combination, as (knobs, Config); the rest dropped with the config's reason."""
    unknown = sorted(set(request.fixed) - set(DIMENSIONS))
    if unknown:
        raise PlanInputError(f"--fix {unknown[0]}: not a knob the planner chooses; knobs: {', '.join(DIMENSIONS)}")
    dims = {k: (request.fixed[k],) if k in request.fixed else v for k, v in DIMENSIONS.items()}
    for values in itertools.product(*dims.values()):
        knobs = _knob_dict(values)
        if not _stores(knobs) and knobs["offload.chunk_bytes"] != dims["offload.chunk_bytes"][-1]:
            continue
        if not _stored_params(knobs) and knobs["prefetch.bytes"] != dims["prefetch.bytes"][-1]:
            continue
        if compute_dtype(request) == "fp32" and knobs["precision.reduce_dtype"] != "fp32":
            continue
        if knobs["optimizer.master"] != "fp32" and knobs["offload.optimizer"] == "none":
            continue   # a smaller master matters for what is stored and moved; in memory the fp32 one is kept
        if (knobs["zero.activation_offload"] != "none" and knobs["zero.activation_checkpointing"] is False
                and "zero.activation_checkpointing" not in request.fixed):
            continue   # every saved tensor moved, not recomputed: planned only when asked for (--fix both)
        if "nvme" in (knobs["offload.params"], knobs["offload.grads"], knobs["offload.optimizer"],
                      knobs["zero.activation_offload"]):
            if request.nvme_path is None:
                continue
        try:
            config = Config.from_dict(_candidate_dict(request, knobs, io))
        except ConfigError:
            continue   # the config's own rules (stage vs offload, overlap's needs, clipping...)
        yield knobs, config


def make_plan(request: PlanRequest, rates: Rates, compute: ComputeRates, device: torch.device | None = None,
              alternatives: int = 3, baseline_bytes: int | None = None) -> Plan:
    """Predict every candidate and pick the fastest that fits (module doc); raises :class:`InfeasiblePlan`.
    ``baseline_bytes``: the training process's RSS before ``initialize`` (default: this process's now,
    torch warmed; measure it before timing the compute, which leaves freed memory behind)."""
    device = device if device is not None else torch.device("cpu")
    device_is_host = device.type == "cpu"
    grants = Config.from_dict({"tiers": {k: v for k, v in (("host_bytes", request.host_bytes),
                                                          ("device_bytes", request.device_bytes)) if v is not None}})
    budgets = resolve_budgets(grants.tiers, device)
    host_grant, device_grant = budgets[Tier.HOST], budgets[Tier.DEVICE]
    if baseline_bytes is None:
        warm_torch()
    baseline = rss_bytes() if baseline_bytes is None else baseline_bytes
    ram = rates.ram_available_bytes
    layouts: dict = {}
    choices: list = []
    for knobs, config in _enumerate(request, rates.io):
        stage, reduce_dtype = knobs["zero.stage"], knobs["precision.reduce_dtype"]
        if (stage, reduce_dtype) not in layouts:
            layouts[stage, reduce_dtype] = model_layout(request, stage, reduce_dtype, baseline)
        layout = layouts[stage, reduce_dtype]
        choices.append(_judge(knobs, config, layout, compute, rates, request.world, host_grant, device_grant,
                              device_is_host, ram))
    fitting = sorted((c for c in choices if c.fits), key=lambda c: (c.step_s, c.prediction.rss.total_bytes))
    if not fitting:
        raise InfeasiblePlan(_minimum_message(choices, host_grant, device_grant, ram, request))
    ties = [c for c in fitting if c.step_s <= fitting[0].step_s * (1 + TIE)]
    chosen = min(ties, key=lambda c: (c.disk_bytes, c.step_s))
    alts = []
    for c in (c for c in fitting if c is not chosen):
        # distinct in a knob that matters: same placement and stage differing only in chunk size is noise
        if _signature(c) in {_signature(a) for a in alts + [chosen]}:
            continue
        alts.append(c)
        if len(alts) == alternatives:
            break
    unfit = sorted((c for c in choices if not c.fits and c.prediction is not None and c.step_s < chosen.step_s),
                   key=lambda c: c.step_s)[:2]
    return Plan(request=request, rates=rates, compute={compute_dtype(request): compute}, chosen=chosen,
                alternatives=alts, faster_unfit=unfit, considered=len(choices),
                budgets={Tier.HOST: host_grant, Tier.DEVICE: chosen.config.tiers.device_bytes})


def _signature(c: Choice) -> tuple:
    """The knobs that make two candidates different choices (chunk size and prefetch alone are noise)."""
    return tuple(c.knobs[k] for k in ("zero.stage", "offload.params", "offload.grads", "offload.optimizer",
                                      "optimizer.update_at",
                                      "zero.activation_checkpointing", "zero.activation_offload",
                                      "optimizer.master", "optimizer.moments"))


def _judge(knobs: dict, config: Config, layout: Layout, compute, rates, world: int, host_grant: int,
           device_grant: int, device_is_host: bool, ram: int) -> Choice:
    """Predict ``config`` with the budgets it would get, and check it fits the grants."""
    stage = config.zero.stage
    p_size = DTYPES[config.precision.param_dtype].itemsize
    r_size = DTYPES[config.precision.reduce_dtype].itemsize
    placement = unit_placement(layout, config)
    # a gathered unit is held in the compute dtype once upcast (fp32 over bf16 parameters)
    held = max(p_size, DTYPES[nominal_dtypes(config.precision)[1]].itemsize)
    full = {u.name: u.padded_numel * held for u in layout.units}
    root = next((u.name for u in layout.units if u.is_root), None)
    # the cap bounds what is gathered at once, and so does the model: never more than all of it
    max_live = min(resolve_cap(config.prefetch.max_live_bytes, full, root), sum(full.values())) if stage == 3 else 0
    # what the engine keeps in device memory outside the store: the same terms as the RSS bound's
    # (on a CPU device they are RAM; on CUDA the bound counts them as 0, so ask it as if on the host)
    checkpointed = config.zero.checkpointed_units(compute.blocks)
    act_tier = config.zero.activation_offload
    on_device = predict_device_bytes(layout, placement, stage, p_size, r_size, max_live,
                                     compute.activation_bytes(checkpointed, act_tier))
    act_host = compute.saved.in_host(checkpointed, act_tier, config.prefetch.bytes)   # held in the store
    needs = {"device_bytes": on_device, "host_bytes": act_host}
    tier_budgets = {Tier.HOST: host_grant, Tier.DEVICE: 0}
    if placement.any_offload:
        least = placement.min_budgets()
        needs["host_bytes"] = least[Tier.HOST][0] + act_host
        needs["device_bytes"] = on_device + least[Tier.DEVICE][0]
        device_tier = max(device_grant - on_device, least[Tier.DEVICE][0])
        tier_budgets[Tier.DEVICE] = device_tier
        config = config.replace(tiers={"host_bytes": host_grant, "device_bytes": device_tier})
    else:
        config = config.replace(tiers={"host_bytes": host_grant, "device_bytes": device_grant})
        tier_budgets[Tier.DEVICE] = device_grant
    why = None
    if needs["host_bytes"] > host_grant:
        why = f"needs host_bytes >= {format_size(needs['host_bytes'])}"
    elif needs["device_bytes"] > device_grant:
        why = f"needs device_bytes >= {format_size(needs['device_bytes'])} (the engine's memory + the device tier)"
    try:
        prediction = predict(layout, config, compute, rates, world, tier_budgets, device_is_host, max_live)
    except (ConfigError, PlanInputError) as e:
        return Choice(knobs, config, None, False, str(e), needs)
    if why is None and device_is_host and ram and prediction.rss.total_bytes > ram:
        why = f"its predicted peak RSS {format_size(prediction.rss.total_bytes)} exceeds the RAM available ({format_size(ram)})"
    return Choice(knobs, config, prediction, why is None, why, needs)


def predict_device_bytes(layout: Layout, placement, stage, p_size, r_size, max_live, activations) -> int:
    """Device memory the engine holds outside the store at its peak: the RSS bound's device-side terms."""
    from infinity.estimate.peak_rss import predict_peak_rss

    bound = predict_peak_rss(0, layout.units, placement, stage, p_size, r_size, {Tier.HOST: 0, Tier.DEVICE: 0},
                             True, max_live, activations, layout.largest_param_numel)
    return bound.gathered_params_bytes + bound.grad_buffers_bytes + bound.resident_bytes + bound.activation_bytes


def _minimum_message(choices: list, host_grant: int, device_grant: int, ram: int, request: PlanRequest) -> str:
    """The least memory any candidate needs, for the refusal: the tier it lacks, or (every tier's needs
    met) the RAM its predicted peak needs."""
    valid = [c for c in choices if c.needs]
    if not valid:
        return f"no valid config for {request.model_name}: every candidate was refused by the config's rules"
    within = [c for c in valid if c.prediction is not None and c.needs["device_bytes"] <= device_grant
              and c.needs["host_bytes"] <= host_grant]
    if within:   # refused only for the RAM their peak needs (a CPU device: both tiers are that RAM)
        least = min(within, key=lambda c: c.prediction.rss.total_bytes)
        peak = least.prediction.rss.total_bytes
        return (f"{request.model_name}: no config's predicted peak RSS fits the {format_size(ram)} of RAM "
                f"available: the least is {format_size(peak)} ({peak} bytes, {least.label()}); grant at least "
                f"that, or train on shorter sequences or smaller batches")
    fits_device = [c for c in valid if c.needs["device_bytes"] <= device_grant]
    if fits_device:
        least = min(fits_device, key=lambda c: c.needs["host_bytes"])
        return (f"{request.model_name}: tiers.host_bytes {format_size(host_grant)} is below the least any config "
                f"needs with device_bytes {format_size(device_grant)}: {format_size(least.needs['host_bytes'])} "
                f"({least.needs['host_bytes']} bytes, {least.label()}); grant at least that")
    least = min(valid, key=lambda c: (c.needs["device_bytes"], c.needs["host_bytes"]))
    return (f"{request.model_name}: tiers.device_bytes {format_size(device_grant)} is below the least any config "
            f"needs: {format_size(least.needs['device_bytes'])} ({least.needs['device_bytes']} bytes, with "
            f"host_bytes >= {format_size(least.needs['host_bytes'])}: {least.label()}); grant at least that")


def describe(plan: Plan) -> list:
    """The plan as printed by ``infinity plan``: config, phases, peak RSS terms, bytes, alternatives."""
    import yaml

    p = plan.chosen.prediction
    r = plan.request
    lines = [f"# infinity plan: {r.model_name}, {r.batch} x {r.seq} tokens per rank, world {r.world}, "
             f"host_bytes {format_size(plan.budgets[Tier.HOST])}; {plan.considered} candidates predicted",
             f"# chosen: {plan.chosen.label()}", "# --- config (loadable: infinity train --config FILE) ---"]
    lines += yaml.safe_dump(plan.config_dict(), sort_keys=False, default_flow_style=None).splitlines()
    lines += ["# --- predicted step (seconds) ---",
              "#   phase     " + "".join(f"{t[:-2]:>13}" for t in TERMS) + f"{'total':>10}"]
    for phase in PHASES:
        row = p.phases[phase]
        lines.append(f"#   {phase:<9} " + "".join(f"{row[t]:>13.3f}" for t in TERMS) + f"{sum(row.values()):>10.3f}")
    lines.append(f"#   step      {p.step_s:.3f} s")
    lines.append("# --- predicted peak RSS (bytes by term) ---")
    lines += ["#" + line for line in p.rss.lines()]
    lines.append("# --- bytes moved per step (tier pair) ---")
    lines += [f"#   {k:<14} {format_size(v):>10}" for k, v in p.moved_bytes.items()] or ["#   none"]
    lines.append("# --- next best ---")
    for c in plan.alternatives:
        lines.append(f"#   {c.label()}: {plan.why_lost(c)}")
    for c in plan.faster_unfit:
        lines.append(f"#   faster but does not fit: {c.label()} ({c.step_s:.2f}s): {c.why_not}")
    for note in p.notes:
        lines.append(f"# note: {note}")
    if plan.rates.lower_bound:
        lines.append("# note: the profile was measured below steady-state sizes; its figures are lower bounds")
    return lines
