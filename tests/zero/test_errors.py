"""Misuse gets a clear error naming the cause (world size 1 in-process; rank disagreement on 2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import infinity
from world import World
import zero_cases
from zero_cases import build_model, global_batch


def test_no_trainable_parameters():
    model = build_model("gpt")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="GPT has no trainable parameters"):
        infinity.initialize(model, {"zero": {"stage": 2}})


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_step_before_backward(stage):
    model, opt = infinity.initialize(build_model("gpt"), {"zero": {"stage": stage}})
    with pytest.raises(RuntimeError, match=r"step\(\).*before any backward"):
        opt.step()
    ids = global_batch(0, 2)
    model(ids, labels=ids).loss.backward()
    opt.step()
    with pytest.raises(RuntimeError, match="before any backward"):
        opt.step()  # the gradients were used by the previous step


def test_unit_class_matching_nothing():
    with pytest.raises(ValueError, match=r"zero.unit_classes: 'Blok' matches no module in GPT.*Block"):
        infinity.initialize(build_model("gpt"), {"zero": {"unit_classes": ["Block", "Blok"]}})


def test_unit_classes_override():
    model, _ = infinity.initialize(build_model("gpt"), {"zero": {"stage": 3, "unit_classes": ["MLP"]}})
    names = [u.name for u in infinity.engine_of(model).units]
    assert names == ["transformer.h.0.mlp", "transformer.h.1.mlp", "<root>"]


def test_parameter_in_no_group():
    model = build_model("gpt")
    some = [p for n, p in model.named_parameters() if "h.0" in n]
    with pytest.raises(ValueError, match=r"parameter 'transformer.wte.weight' requires grad but is in no param group"):
        infinity.initialize(model, {}, params=some)


def test_offload_needs_a_sharding_stage():
    # offload itself is supported (tests/zero/test_offload_*.py); stage 0 keeps full state on every rank
    with pytest.raises(infinity.ConfigError, match="offload.optimizer: needs zero.stage >= 1"):
        infinity.initialize(build_model("gpt"), {"zero": {"stage": 0}, "offload": {"optimizer": "host"}})


def test_initialize_twice_rejected():
    model, _ = infinity.initialize(build_model("gpt"), {})
    with pytest.raises(RuntimeError, match="GPT was already initialized"):
        infinity.initialize(model, {})


def test_added_param_group_rejected():
    model, opt = infinity.initialize(build_model("gpt"), {})
    with pytest.raises(RuntimeError, match="param groups are fixed at initialize"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_ranks_disagree_on_structure(tmp_path):
    with World(2, tmp_path) as world:
        for msg in world.run(zero_cases.error_case, "structure"):
            assert msg.startswith("RuntimeError: initialize: rank 1 disagrees with rank 0 on the model's structure")
            assert "'blocks.0.fc.bias' shape (48,)" in msg and "shape (32,)" in msg
        for msg in world.run(zero_cases.error_case, "groups"):
            assert "rank 1 disagrees with rank 0" in msg and "group" in msg
