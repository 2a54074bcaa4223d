"""The hooks drive a forward and a backward through two targets: the engine's verbs for the whole model
(root forward, the start of backward, a parameter's gradient, a state-dict read) and each unit's own verbs
(its forward, backward, recompute and saved activations), in the order a step needs them."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from infinity.zero import hooks
from infinity.zero.units import FlatUnit, UnitParts


class Engine:
    """Records the engine verbs the hooks call."""

    def __init__(self, log):
        self.log = log

    def root_pre_forward(self, training):
        self.log.append(("root_pre_forward", training))

    def root_post_forward(self, out, training):
        self.log.append(("root_post_forward", training))
        return out

    def enter_backward(self):
        self.log.append(("enter_backward",))

    def param_grad_ready(self, unit_index, slot_index, param):
        self.log.append(("param_grad_ready", unit_index, slot_index))

    def drain_update(self):
        self.log.append(("drain_update",))


class Unit:
    """Records the unit verbs the hooks call."""

    def __init__(self, log, index, module, is_root=False):
        self.log, self.index, self.module, self.is_root = log, index, module, is_root
        self.params = list(module.parameters()) if not is_root else list(module.head.parameters())

    def pre_forward(self, training):
        self.log.append(("pre_forward", self.index, training))

    def post_forward(self, training):
        self.log.append(("post_forward", self.index, training))

    def pre_backward(self):
        self.log.append(("pre_backward", self.index))

    def pre_recompute(self):
        self.log.append(("pre_recompute", self.index))

    def saves_begin(self):
        self.log.append(("saves_begin", self.index))

    def saves_end(self):
        self.log.append(("saves_end", self.index))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _installed(**kw):
    log = []
    model = Net()
    engine = Engine(log)
    units = [Unit(log, 0, model, is_root=True), Unit(log, 1, model.blocks[0]), Unit(log, 2, model.blocks[1])]
    handles = hooks.install(engine, model, units, **kw)
    return model, engine, units, handles, log


def _without_grads(log):
    return [e for e in log if e[0] != "param_grad_ready"]


def test_a_training_step_calls_the_engine_for_the_model_and_each_unit_for_its_own_forward_and_backward():
    model, engine, units, handles, log = _installed(shard_params=True, offload_saves=True)
    model(torch.randn(3, 4)).sum().backward()
    assert _without_grads(log) == [
        ("root_pre_forward", True),
        ("saves_begin", 1), ("pre_forward", 1, True), ("post_forward", 1, True), ("saves_end", 1),
        ("saves_begin", 2), ("pre_forward", 2, True), ("post_forward", 2, True), ("saves_end", 2),
        ("root_post_forward", True),
        ("enter_backward",),                      # the root's outputs: backward begins
        ("enter_backward",), ("pre_backward", 2),  # each unit's backward enters the engine's first
        ("enter_backward",), ("pre_backward", 1),
    ]
    # every parameter's gradient reaches the engine once, by its unit and slot, after its unit's pre_backward
    grads = [e for e in log if e[0] == "param_grad_ready"]
    assert sorted(grads) == sorted(("param_grad_ready", u.index, s) for u in units for s in range(len(u.params)))
    for unit in units[1:]:
        first_grad = min(i for i, e in enumerate(log) if e[:2] == ("param_grad_ready", unit.index))
        assert log.index(("pre_backward", unit.index)) < first_grad
    model.state_dict()
    assert log[-1] == ("drain_update",)


def test_a_pass_without_grad_calls_the_forward_verbs_only():
    model, engine, units, handles, log = _installed(shard_params=True, offload_saves=True)
    with torch.no_grad():
        model(torch.randn(3, 4))
    assert log == [("root_pre_forward", False), ("pre_forward", 1, False), ("post_forward", 1, False),
                   ("pre_forward", 2, False), ("post_forward", 2, False), ("root_post_forward", False)]


def test_a_recomputed_unit_is_only_made_sure_of_inside_backward():
    model, engine, units, handles, log = _installed(shard_params=True, checkpoint_units=1, offload_saves=True)
    model(torch.randn(3, 4)).sum().backward()
    backward = _without_grads(log)[log.index(("enter_backward",)):]
    # unit 1's forward reruns inside its backward: the unit is asked to be sure it is gathered, nothing else
    assert backward == [("enter_backward",), ("enter_backward",), ("pre_backward", 2),
                        ("enter_backward",), ("pre_backward", 1), ("pre_recompute", 1)]


def test_below_stage_3_only_the_units_pre_forward_is_hooked_when_it_waits_for_an_update():
    model, engine, units, handles, log = _installed(shard_params=False, wait_units=True)
    model(torch.randn(3, 4)).sum().backward()
    assert _without_grads(log) == [("root_pre_forward", True), ("pre_forward", 1, True), ("pre_forward", 2, True),
                                   ("root_post_forward", True), ("enter_backward",)]
    log.clear()
    model, engine, units, handles, log = _installed(shard_params=False)
    model(torch.randn(3, 4))
    assert log == [("root_pre_forward", True), ("root_post_forward", True)]


def test_removing_the_handles_removes_every_hook():
    model, engine, units, handles, log = _installed(shard_params=True, offload_saves=True)
    for h in handles:
        h.remove()
    model(torch.randn(3, 4)).sum().backward()
    model.state_dict()
    assert log == []


class Parts:
    """Records what a unit's verbs ask of the parts bound to it, and whether the engine's clock was running."""

    def __init__(self):
        self.log, self.timing = [], False

    @contextlib.contextmanager
    def timed(self):
        self.timing = True
        try:
            yield
        finally:
            self.timing = False

    def __getattr__(self, verb):
        if verb.startswith("_"):
            raise AttributeError(verb)
        return lambda *args, **kw: self.log.append((verb, *[a.name if isinstance(a, FlatUnit) else a for a in args],
                                                    *sorted(kw.items()), self.timing))


def test_a_units_verbs_drive_the_parts_bound_to_it():
    lin = nn.Linear(2, 2)
    unit = FlatUnit(1, "blocks.0", lin, list(lin.parameters()), ["weight", "bias"], {id(p): 0 for p in
                                                                                    lin.parameters()}, 1, 1)
    rec = Parts()
    unit.bind(UnitParts(gathers=rec, update=rec, activations=rec, timed=rec.timed))
    unit.pre_forward(True)
    unit.post_forward(True)
    unit.post_forward(False)
    unit.pre_backward()
    unit.pre_recompute()
    unit.saves_begin()
    unit.saves_end()
    assert rec.log == [
        ("before_use", "blocks.0", True),          # a launched update is waited for before the gather
        ("use_unit", "blocks.0", True, True),
        ("after_forward", "blocks.0", True),
        ("release", "blocks.0", True),
        ("use_unit", "blocks.0", ("training", True), True),
        ("acquire", "blocks.0", True),
        ("begin_unit", "blocks.0", False),
        ("end_unit", False),
    ]
