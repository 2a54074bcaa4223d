"""``schedule:`` config section and build_lr_scheduler, against torch.optim.lr_scheduler's own schedulers."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as L

from infinity.config import Config, ConfigError, ScheduleConfig
from infinity.train.schedule import build_lr_scheduler

BASE, MIN, WARMUP, TOTAL = 1e-3, 1e-4, 5, 20


def _lrs(optimizer, scheduler, n):
    out = []
    for _ in range(n):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)


def _reference(kind):
    opt = _sgd()
    warm = L.LinearLR(opt, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1)
    decay = {"cosine": lambda: L.CosineAnnealingLR(opt, T_max=TOTAL - WARMUP, eta_min=MIN),
             "linear": lambda: L.LinearLR(opt, start_factor=1.0, end_factor=MIN / BASE, total_iters=TOTAL - WARMUP),
             "constant": lambda: L.ConstantLR(opt, factor=1.0, total_iters=0)}[kind]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # SequentialLR warns about its own internal step order
        seq = L.SequentialLR(opt, [warm, decay], milestones=[WARMUP])
    return _lrs(opt, seq, TOTAL + 1)


@pytest.mark.parametrize("kind", ("cosine", "linear", "constant"))
def test_matches_torch_schedulers(kind):
    opt = _sgd()
    sched = build_lr_scheduler(opt, ScheduleConfig(lr_schedule=kind, warmup_steps=WARMUP, min_lr=MIN), TOTAL)
    ours = _lrs(opt, sched, TOTAL + 3)
    assert ours[:TOTAL + 1] == pytest.approx(_reference(kind), rel=1e-12, abs=0)
    assert ours[0] == BASE / WARMUP and ours[WARMUP] == BASE
    if kind != "constant":
        assert ours[TOTAL:] == pytest.approx([MIN] * 3)     # holds min_lr after the decay (torch's cosine rises)
    json.dumps(sched.state_dict())                         # fits a checkpoint's client_state


def test_state_dict_resumes_the_schedule():
    cfg = ScheduleConfig(lr_schedule="cosine", warmup_steps=WARMUP, min_lr=MIN)
    opt = _sgd()
    sched = build_lr_scheduler(opt, cfg, TOTAL)
    first = _lrs(opt, sched, 8)
    saved = json.loads(json.dumps(sched.state_dict()))
    rest = _lrs(opt, sched, 8)
    opt2 = _sgd()
    sched2 = build_lr_scheduler(opt2, cfg, TOTAL)
    sched2.load_state_dict(saved)
    opt2.param_groups[0]["lr"] = sched2.get_last_lr()[0]
    assert _lrs(opt2, sched2, 8) == rest


def test_config_section_is_checked():
    cfg = Config.from_dict({"schedule": {"lr_schedule": "cosine", "warmup_steps": 10, "clip_grad_norm": 1}})
    assert cfg.schedule.clip_grad_norm == 1.0 and cfg.to_dict()["schedule"]["warmup_steps"] == 10
    assert Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"unknown key schedule.warmup .*valid keys: lr_schedule, warmup_steps"):
        Config.from_dict({"schedule": {"warmup": 10}})
    with pytest.raises(ConfigError, match=r"schedule.lr_schedule: expected one of \['constant', 'linear', 'cosine'\]"):
        Config.from_dict({"schedule": {"lr_schedule": "step"}})
    with pytest.raises(ConfigError, match="schedule.min_lr: 0.01 is above optimizer.lr 0.001"):
        Config.from_dict({"optimizer": {"lr": 1e-3}, "schedule": {"lr_schedule": "linear", "min_lr": 1e-2}})
    with pytest.raises(ValueError, match="total_steps 5 must exceed warmup_steps 5"):
        build_lr_scheduler(_sgd(), ScheduleConfig(lr_schedule="linear", warmup_steps=5), 5)
    with pytest.raises(ValueError, match="total_steps is 'auto'; pass total_steps"):
        build_lr_scheduler(_sgd(), ScheduleConfig(lr_schedule="cosine"))
