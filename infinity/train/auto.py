"""The planner for a ``--model`` spec: ``infinity plan`` and ``infinity train --config auto``.

Builds the :class:`~infinity.plan.PlanRequest` from the train grammar's model (built on the meta
device to lay it out, cut to one and two blocks to time its compute) and the train job's
micro-batch, then runs the planner (:mod:`infinity.plan`).
"""

from __future__ import annotations

import torch

from infinity.plan.auto import plan_request, read_auto
from infinity.plan.planner import Plan, PlanRequest
from infinity.train.errors import TrainError
from infinity.train.models import build_model, max_positions, parse_model_spec
from infinity.train.options import DEFAULT_BATCH_SIZE, DEFAULT_SEQ_LEN, DEFAULT_SWAP_DIR

__all__ = ["request_for_model", "plan_model", "plan_train_config"]


def request_for_model(model: str, tokens: int | None = None, world: int = 1, host_bytes: int | None = None,
                      device_bytes: int | None = None, swap_dir: str | None = None, param_dtype: str = "auto",
                      base: dict | None = None, seq_len: int | None = None, fixed: dict | None = None) -> PlanRequest:
    """A request for ``--model`` at ``tokens`` per rank per step (default: the train job's default
    global batch over ``world`` ranks, at its default sequence length)."""
    spec = parse_model_spec(model)
    with torch.device("meta"):
        probe, _ = build_model(spec, 1)
    positions = max_positions(probe)
    seq = seq_len or (min(DEFAULT_SEQ_LEN, positions) if positions else DEFAULT_SEQ_LEN)
    if tokens is None:
        tokens = max(1, DEFAULT_BATCH_SIZE // world) * seq
    seq = min(seq, tokens)
    vocab = getattr(getattr(probe, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise TrainError(f"--model {model!r}: its config has no vocab_size to draw tokens from")
    with torch.device("meta"):
        loss_fn = build_model(spec, seq)[1]
    return PlanRequest(build=lambda: build_model(spec, seq)[0], loss_fn=loss_fn, model_name=spec.text,
                       vocab_size=min(vocab, 256), batch=max(1, tokens // seq), seq=seq, world=world,
                       host_bytes=host_bytes, device_bytes=device_bytes, nvme_path=swap_dir or DEFAULT_SWAP_DIR,
                       param_dtype=param_dtype, base=base or {}, fixed=fixed or {})


def plan_model(request: PlanRequest, profile: str | None = None, say=None) -> Plan:
    """Rates from ``profile`` (None: a quick profile measured now beside the swap directory), then the plan."""
    import os

    parent = os.path.dirname(os.path.abspath(request.nvme_path)) if request.nvme_path else None
    return plan_request(request, profile, parent if parent and os.path.isdir(parent) else None,
                        max(request.world, 2), say)


def plan_train_config(config, model: str, world: int, batch_size: int, seq_len: int, swap_dir: str | None,
                      host_bytes: int | None, device_bytes: int | None, say=None) -> tuple:
    """``infinity train --config auto``: ``(config dict, Plan)`` for the job's model and micro-batch; the
    auto config's ``plan`` section and the flags say the memory granted (the flags win)."""
    base, options = read_auto(config)
    request = request_for_model(
        model, tokens=max(1, batch_size // world) * seq_len, world=world,
        host_bytes=host_bytes if host_bytes is not None else options.get("host_bytes"),
        device_bytes=device_bytes if device_bytes is not None else options.get("device_bytes"),
        swap_dir=swap_dir or (base.get("tiers") or {}).get("nvme_path"),
        param_dtype=(base.get("precision") or {}).get("param_dtype", "auto"), base=base, seq_len=seq_len)
    plan = plan_model(request, options.get("profile"), say)
    return plan.config_dict(), plan
