"""The plain per-unit collectives: each call says which unit it is for, so the watchdog's line names the
unit a stuck collective belongs to; with one rank the reduction needs no second buffer."""

from __future__ import annotations

import torch

from infinity.comm.collectives import Collectives, LocalCollectives
from infinity.comm.unit_collectives import UnitCollectives


class _Unit:
    index, name = 3, "transformer.h.3"


class _Recording:
    def __init__(self):
        self.calls = []

    def all_gather(self, full, shard, **kw):
        self.calls.append(("all_gather", kw))

    def reduce_scatter(self, shard, full, **kw):
        self.calls.append(("reduce_scatter", kw))


def test_each_unit_call_carries_its_units_name():
    coll = _Recording()
    comm = UnitCollectives(coll)
    comm.all_gather(_Unit(), torch.zeros(8), torch.zeros(4))
    comm.reduce_scatter(_Unit(), torch.zeros(4), torch.zeros(8), then=None)
    assert coll.calls == [
        ("all_gather", {"async_op": True, "label": "unit 'transformer.h.3'"}),
        ("reduce_scatter", {"average": True, "async_op": True, "then": None,
                            "label": "gradient of unit 'transformer.h.3'"})]


def test_the_watchdog_line_names_kind_unit_size_and_ranks():
    coll = object.__new__(Collectives)   # only the naming: no process group needed
    coll.members = [0, 1]
    assert coll._what("all_gather", torch.zeros(16), "unit 'h.3'") == \
        "all_gather (unit 'h.3') of 64 bytes over ranks [0, 1]"
    assert coll._what("all_reduce", torch.zeros(2)) == "all_reduce of 8 bytes over ranks [0, 1]"


def test_one_rank_reduces_in_place_and_local_calls_take_the_label():
    comm = UnitCollectives(LocalCollectives())
    assert comm.reduces_in_place
    full = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    comm.reduce_scatter(_Unit(), out, full, then=None).wait()
    assert torch.equal(out, full)
    gathered = torch.empty(8)
    comm.all_gather(_Unit(), gathered, full).wait()
    assert torch.equal(gathered, full)
