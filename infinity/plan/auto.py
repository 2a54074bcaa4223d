"""``auto``: a config whose ``offload`` is ``auto`` is resolved by the planner before anything is built.

An auto config is an ordinary config file or dict with ``offload: auto`` and an optional ``plan``
section saying what to plan for::

    offload: auto
    plan: {profile: infinity-profile/profile.json, host_bytes: 1GiB, device_bytes: auto, tokens: 2048}
    optimizer: {lr: 3.0e-4}          # every other section is kept as it is

``plan`` keys (all optional): ``profile`` (an ``infinity profile`` JSON or its directory; none: a quick
profile is measured now in the swap directory's parent), ``host_bytes`` / ``device_bytes`` (the memory
granted per rank; ``auto``: the tiers' auto), ``tokens`` (per rank per step; default: the caller's
micro-batch). The planner sets ``zero``, ``offload``, ``tiers``' budgets, ``prefetch`` and ``io`` and
the knobs in :data:`~infinity.plan.planner.DIMENSIONS`; the chosen config is an ordinary config
(logged, and saved in checkpoints as the engine's config).

``infinity train --config auto`` (or ``configs/auto.yaml``) plans in the launching process;
``infinity.initialize(model, config)`` plans for a causal LM (``model(input_ids=, labels=).loss``)
at the micro-batch ``plan.tokens`` names.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import yaml

from infinity.config import ConfigError, parse_size
from infinity.plan.planner import Plan, PlanRequest, compute_dtype, describe, make_plan
from infinity.precision import choose, model_shapes
from infinity.plan.rates import PlanInputError, Rates, load_profile, measure_compute
from infinity.store.host_malloc import release_free_heap

__all__ = ["AUTO", "wants_auto", "read_auto", "rates_for", "run_plan", "plan_request", "plan_for_module",
           "PLAN_KEYS", "PLAN_KEY_DOCS"]

log = logging.getLogger(__name__)

AUTO = "auto"
# the `plan:` section of an `offload: auto` config: what the planner is granted and measures from
PLAN_KEY_DOCS = {
    "profile": ("null", "an `infinity profile` JSON (or its directory) to plan from; null = a quick profile "
                        "measured at start-up in the swap directory's parent"),
    "host_bytes": ("auto", "host memory granted per rank; auto = the tiers' auto (tiers.host_bytes)"),
    "device_bytes": ("auto", "device memory granted per rank (on a CPU the device tier is RAM too); auto = the "
                             "tiers' auto (tiers.device_bytes)"),
    "tokens": ("null", "tokens per rank per micro-batch the plan is priced at; null = the caller's micro-batch "
                       "(initialize: up to 256 tokens of the model's context)"),
}
PLAN_KEYS = tuple(PLAN_KEY_DOCS)


def _raw(config) -> dict | None:
    """The mapping behind ``config`` if it is a dict or a YAML/JSON file; None otherwise."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)) and str(config) != AUTO:
        p = Path(config)
        if p.is_file():
            try:
                data = yaml.safe_load(p.read_text())
            except (OSError, yaml.YAMLError):
                return None   # Config.from_file reports it with the file's name
            return data if isinstance(data, dict) else None
    return None


def wants_auto(config) -> bool:
    """Whether ``config`` (``"auto"``, a dict, or a config file) asks for the planner."""
    if isinstance(config, str) and config == AUTO:
        return True
    raw = _raw(config)
    return raw is not None and raw.get("offload") == AUTO


def read_auto(config) -> tuple:
    """``(base sections, plan options)`` of an auto config; ``"auto"`` alone is ``({}, {})``."""
    raw = {} if isinstance(config, str) and config == AUTO else copy.deepcopy(_raw(config) or {})
    raw.pop("offload", None)
    options = raw.pop("plan", None) or {}
    if not isinstance(options, dict):
        raise ConfigError(f"plan: expected a mapping with keys {', '.join(PLAN_KEYS)}, got {options!r}")
    unknown = sorted(set(options) - set(PLAN_KEYS))
    if unknown:
        raise ConfigError(f"unknown key plan.{unknown[0]}; valid keys: {', '.join(PLAN_KEYS)}")
    out = {}
    for key in ("host_bytes", "device_bytes"):
        value = options.get(key)
        if value is not None and value != AUTO:
            out[key] = parse_size(value, f"plan.{key}")
    if options.get("tokens") is not None:
        tokens = options["tokens"]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ConfigError(f"plan.tokens: expected an integer >= 1, got {tokens!r}")
        out["tokens"] = tokens
    if options.get("profile") is not None:
        out["profile"] = str(options["profile"])
    return raw, out


def rates_for(profile: str | None, directory: str | None, nproc: int, say=None) -> Rates:
    """The profile's rates, or (``profile`` None) a quick profile measured now in ``directory``."""
    if profile is not None:
        return load_profile(profile)
    from infinity.profile import ProfileError, ProfileOptions, run_profile

    say = say or (lambda _m: None)
    say("no --profile: measuring a quick one (infinity profile --quick)")
    try:
        measured = run_profile(ProfileOptions(quick=True, nproc=max(nproc, 1), directory=directory), say)
    except ProfileError as e:
        raise PlanInputError(str(e)) from None
    return Rates.from_profile(measured, source="quick profile, measured now")


def run_plan(request: PlanRequest, rates: Rates, device: torch.device | None = None) -> Plan:
    """Time the model's compute at the request's shapes, then plan (:func:`make_plan`)."""
    from infinity.zero.engine import DTYPES
    from infinity.zero.memory_report import rss_bytes, warm_torch

    if request.param_dtype == "auto" and request.precision is None:   # measured here, as initialize would
        with torch.device("meta"):
            shapes = model_shapes(request.build())
        request = dataclasses.replace(request, precision=choose(
            device if device is not None else torch.device("cpu"), shapes, params_offloaded=True))
        log.warning(request.precision.line())
    warm_torch()
    baseline = rss_bytes()   # before the timing's models come and go: a training process's start
    # each of `world` ranks on this machine computes on its share of the cores, all at once
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // max(request.world, 1)))
    try:
        # the median of 3 after the warm-up: one timed pass came out from 2% below to 30% above the
        # engine's own steps on GPT-2 small, run to run (tools/bench_plan.py)
        compute = measure_compute(request.build, request.loss_fn, request.batch, request.seq,
                                  DTYPES[compute_dtype(request)], request.vocab_size, repeats=3)
    finally:
        torch.set_num_threads(threads)
    return make_plan(request, rates, compute, device=device, baseline_bytes=baseline)


def plan_request(request: PlanRequest, profile: str | None, directory: str | None, nproc: int,
                 say=None) -> Plan:
    """The rates (:func:`rates_for`: ``profile``, or a quick one measured now in ``directory``), then the plan
    (:func:`run_plan`), leaving the caller's random stream as it found it: the quick profile and the compute
    timing draw data and weights, and a model built on meta is materialized after planning, so its seeded
    init must not depend on whether its config was planned. What they freed is then given back to the OS
    (:func:`~infinity.store.host_malloc.release_free_heap`), as the plan's baseline RSS assumes."""
    with torch.random.fork_rng(devices=[]):
        plan = run_plan(request, rates_for(profile, directory, nproc, say))
    release_free_heap()   # the profile's and the timing's freed blocks: not the training run's baseline
    return plan


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device, allocating nothing for its weights."""
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _lm_loss(model, input_ids, labels):
    out = model(input_ids=input_ids, labels=labels)
    loss = getattr(out, "loss", None)
    if loss is None:
        raise PlanInputError(f"offload: auto at initialize: {type(model).__name__}(input_ids=, labels=) returned "
                             "no .loss; plan it with `infinity plan` and pass the config it prints")
    return loss


def plan_for_module(model: nn.Module, config, world: int = 1, say=None) -> tuple:
    """``(Config dict, Plan)`` for ``initialize(model, auto config)``: the model (real or meta) is copied
    to the meta device to be laid out, and cut to one and two blocks to time its compute."""
    base, options = read_auto(config)
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    seq = next((getattr(cfg, k) for k in ("block_size", "n_positions", "max_position_embeddings")
                if isinstance(getattr(cfg, k, None), int)), 256)
    seq = min(seq, 256, options.get("tokens", 256))
    if not isinstance(vocab, int):
        raise PlanInputError(f"offload: auto at initialize: {type(model).__name__} has no config.vocab_size; "
                             "plan it with `infinity plan` and pass the config it prints")
    template = _meta_copy(model)
    dtype = (base.get("precision") or {}).get("param_dtype", "auto")
    nvme_path = (base.get("tiers") or {}).get("nvme_path") or os.path.join(tempfile.gettempdir(), "infinity_swap")
    request = PlanRequest(build=lambda: _meta_copy(template), loss_fn=_lm_loss, model_name=type(model).__name__,
                          vocab_size=vocab, batch=max(1, options.get("tokens", 2 * seq) // seq), seq=seq,
                          world=world, host_bytes=options.get("host_bytes"),
                          device_bytes=options.get("device_bytes"), nvme_path=nvme_path, param_dtype=dtype,
                          base=base)
    plan = plan_request(request, options.get("profile"), os.path.dirname(os.path.abspath(nvme_path)), world, say)
    return plan.config_dict(), plan


def log_plan(plan: Plan, stream=None) -> None:
    """The plan's description, on ``stream`` (default stderr): what auto chose and why."""
    stream = stream or sys.stderr
    for line in describe(plan):
        print(line, file=stream)
