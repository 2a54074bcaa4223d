"""ZeroAdamW's state dict: loading hyper-parameters reaches the engine's step (the group dicts it reads)."""

from __future__ import annotations

import pytest
import torch

import infinity
from unit_parts import Blocks


def test_load_state_dict_changes_the_lr_the_engine_steps_with():
    model, opt = infinity.initialize(Blocks(), {"zero": {"stage": 0}, "optimizer": {"lr": 3e-4}})
    engine = infinity.engine_of(model)
    try:
        saved = opt.state_dict()
        saved["param_groups"][0]["lr"] = 0.5
        opt.load_state_dict(saved)
        assert engine.hyper.for_step()[0]["lr"] == 0.5
        for g in opt.param_groups:   # a scheduler's later change still reaches the engine
            g["lr"] = 0.25
        assert engine.hyper.for_step()[0]["lr"] == 0.25
        with pytest.raises(ValueError, match="param groups"):
            opt.load_state_dict({"param_groups": []})
        x = torch.randn(4, 8)
        model(x).sum().backward()
        opt.step()   # the loaded groups are whole: the step runs with them
    finally:
        engine.close()
