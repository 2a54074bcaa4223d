"""``prefetch.max_live_bytes`` caps every stage-3 gather, on-demand ones included.

At world sizes 1 and 2 (one world start each, every case inside one run), with
params on NVMe (and one in-memory stage-3 case), per step:

- the recorded ``live_peak_bytes`` is > 0, <= the cap, and equal to the peak
  sampled independently at every all-gather (sum of full bytes of units not
  SHARDED, read from the units' states);
- results are bitwise equal to the same run with the default cap, and match
  single-process torch AdamW within fp32 rounding (every element within
  ``zero_cases.RoundingDrift``'s bound, derived from the reduction length, fp32's
  unit roundoff and the reference's Adam steps, as in test_equivalence.py);
- units gathered ahead (a step that leaves the trace) and units kept for
  backward (``reshard_after_forward: false``) are released to make room;
- a cap below root + largest unit is a ConfigError at initialize naming the
  key; a nested model needing more at run time raises RuntimeError, never exceeds.

Fails on the code before this change: with ``reshard_after_forward: false``
every unit stayed gathered through forward (on-demand gathers ignored the cap),
so the sampled peak was root + 4 blocks = 64 KiB against a 48 KiB cap; and no
peak was recorded, and a too-small cap was silently exceeded.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from infinity.zero.units import TensorClass

import offload_cases
import zero_cases
from zero_cases import FP32_TOL, VOCAB, Out, compare, global_batch

NVME = dict(optimizer="nvme", params="nvme", grads="host")
BASE = dict(stage=3, steps=3, batch=8, lr=1e-2, groups=False, offload=NVME,
            host_bytes=(192 + 124) * 1024, device_bytes=64 * 1024, prefetch_bytes=20 * 1024)
DEFAULT_CAP = 1 << 30


def full_bytes(kind: str, world: int) -> tuple:
    """(root unit's full bytes, largest other unit's) in fp32 at this world size, from the engine's own layout."""
    from infinity.zero.units import plan_units, shard_align_numel
    model = kind_model(kind)
    group_of = {id(p): 0 for p in model.parameters()}
    units = plan_units(model, group_of, (), world, shard_align_numel({torch.float32}))
    root = next(u.padded_numel * 4 for u in units if u.is_root)
    return root, max(u.padded_numel * 4 for u in units if not u.is_root)


# ---------------------------------------------------------------- a model the cap cannot serve

class _Inner(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Outer(nn.Module):
    """Runs another unit inside its own forward: both units are in use at once."""

    def __init__(self, width: int, inner: nn.Module):
        super().__init__()
        self.fc = nn.Linear(width, width)
        object.__setattr__(self, "inner", inner)   # not a submodule: its parameters stay in its own unit

    def forward(self, x):
        return x + self.inner(torch.tanh(self.fc(x)))


class Nested(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        inner = _Inner(width)
        self.blocks = nn.ModuleList([_Outer(width, inner), inner])

    def forward(self, input_ids, labels=None):
        logits = self.blocks[0](self.emb(input_ids)) @ self.emb.weight.t()
        return Out(F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits)


def kind_model(kind: str, seed: int = 0) -> nn.Module:
    if kind == "nested":
        torch.manual_seed(seed)
        return Nested()
    return offload_cases.build(kind, seed)


# ---------------------------------------------------------------- rank side

def cap_case(spec: dict) -> dict:
    """Train ``spec``; per step the engine's stats and the live peak sampled at every all-gather."""
    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = kind_model(spec["model"], spec.get("seed", 0))
    try:
        model, opt = infinity.initialize(model, offload_cases.offload_config(spec, rank, world))
    except Exception as e:
        return {"init_error": f"{type(e).__name__}: {e}"}
    engine = infinity.engine_of(model)
    sampled: list = []
    gather = engine.coll.all_gather

    def sampling_all_gather(*args, **kwargs):   # the unit being gathered is already GATHERING here
        out = gather(*args, **kwargs)
        sampled.append(sum(u.padded_numel * u.full_param.element_size()
                           for u in engine.units if u.state.value != "sharded"))
        return out

    engine.coll.all_gather = sampling_all_gather
    losses, stats, sampled_peaks = [], [], []
    try:
        for step in range(spec["steps"]):
            if spec["model"] == "reorder":
                model.route = offload_cases.route_for(step)
            sampled.clear()
            losses.append(zero_cases.backward_on_share(model, global_batch(step, spec["batch"]), rank, world))
            opt.step()
            opt.zero_grad()
            stats.append(engine.stats.last_step)
            sampled_peaks.append(max(sampled, default=0))
        engine.coll.all_gather = gather
        with engine.gathered():
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()} if rank == 0 else None
    except RuntimeError as e:
        return {"run_error": str(e)}
    finally:
        engine.close()
    return {"losses": losses, "norms": [], "params": params, "stats": stats, "sampled_peaks": sampled_peaks,
            # where the gathered shards come from: store keys (offloaded params) or memory
            "param_keys": [u.shard.keys(TensorClass.PARAM) or None for u in engine.units]}


def many(specs: list) -> list:
    return [cap_case(s) for s in specs]


# ---------------------------------------------------------------- the tests

def _cases(tmp_path, world: int) -> dict:
    """name -> spec; a capped case's default-cap twin is named ``<name>:default``."""
    g_root, g_block = full_bytes("gpt", world)
    r_root, r_block = full_bytes("reorder", world)
    n_root, n_block = full_bytes("nested", world)
    capped = {
        # the least the check allows: root + one block, nothing gathered ahead
        "gpt-tight": dict(model="gpt", max_live=g_root + g_block),
        # room for one block and a half: the one-ahead gather fits at the root only, and step 2 leaves
        # the trace, so that block (gathered ahead) is released for the one needed instead
        "reorder-ahead": dict(model="reorder", max_live=r_root + r_block + r_block // 2, steps=5),
        # reshard_after_forward off keeps blocks for backward; two fit, the rest must be released
        "reorder-kept": dict(model="reorder", max_live=r_root + 2 * r_block, reshard=False),
        "reorder-kept-memory": dict(model="reorder", max_live=r_root + 2 * r_block, reshard=False,
                                    offload=dict(optimizer="none", params="none", grads="none")),
    }
    specs = {}
    for name, c in capped.items():
        specs[name] = dict(BASE, **c)
        specs[name + ":default"] = dict(BASE, **dict(c, max_live=DEFAULT_CAP))
    specs["gpt-too-small"] = dict(BASE, model="gpt", max_live=g_root + g_block - 1)
    specs["memory-too-small"] = dict(BASE, model="gpt", max_live=g_root + g_block - 1,
                                     offload=dict(optimizer="none", params="none", grads="none"))
    specs["nested"] = dict(BASE, model="nested", max_live=n_root + n_block, steps=1)
    for name, s in specs.items():
        s["tmp"] = str(tmp_path / name.replace(":", "-"))
    return specs


_REF: dict = {}


def _reference(spec: dict) -> dict:
    key = (spec["model"], spec["steps"])
    if key not in _REF:
        _REF[key] = offload_cases.reference_run(spec)
    return _REF[key]


@pytest.mark.parametrize("world_size", (1, 2))
def test_cap_holds_for_every_gather(worlds, tmp_path, world_size):
    specs = _cases(tmp_path, world_size)
    per_rank = worlds(world_size).run(many, list(specs.values()))
    for rank, results in enumerate(per_rank):
        got = dict(zip(specs, results))
        try:
            _check(specs, got, rank)
        except AssertionError as e:
            raise AssertionError(f"world size {world_size}, rank {rank}: {e}") from None


CAPPED = ("gpt-tight", "reorder-ahead", "reorder-kept", "reorder-kept-memory")


def _check(specs: dict, got: dict, rank: int) -> None:
    for name in CAPPED:   # first what the code before the cap covered on-demand gathers got wrong
        run, cap = got[name], specs[name]["max_live"]
        assert "sampled_peaks" in run, f"{name}: {run}"
        assert all(0 < p <= cap for p in run["sampled_peaks"]), f"{name}: peaks {run['sampled_peaks']} vs cap {cap}"
    for name in CAPPED:
        spec, run, default = specs[name], got[name], got[name + ":default"]
        cap = spec["max_live"]
        peaks = [s["live_peak_bytes"] for s in run["stats"]]
        assert run["sampled_peaks"] == peaks, f"{name}: sampled peaks {run['sampled_peaks']} vs recorded {peaks}"
        if spec["offload"]["params"] != "none":
            assert [s["offload"]["live_peak_bytes"] for s in run["stats"]] == peaks
            assert all(k is not None for k in run["param_keys"]), run["param_keys"]
        else:
            assert all(k is None for k in run["param_keys"]), run["param_keys"]
        # the default cap holds more at once, the capped run the same values
        assert max(default["sampled_peaks"]) > cap, f"{name}: default run never exceeded {cap}; no test"
        assert run["losses"] == default["losses"], f"{name}: losses {run['losses']} vs {default['losses']}"
        if rank == 0:
            for p, ref in default["params"].items():
                assert torch.equal(run["params"][p], ref), f"{name}: parameter {p} differs from the default cap"
            compare(run, _reference(spec), **FP32_TOL)
    tight = got["gpt-tight"]
    assert all(p == specs["gpt-tight"]["max_live"] for p in tight["sampled_peaks"]), tight["sampled_peaks"]
    releases = [s["live_cap_releases"] for s in got["reorder-ahead"]["stats"]]
    assert releases[2] > 0, f"the prefetched block was not released when step 2 left the trace: {releases}"
    for name in ("reorder-kept", "reorder-kept-memory"):
        releases = [s["live_cap_releases"] for s in got[name]["stats"]]
        assert all(r > 0 for r in releases), f"{name}: kept blocks never released for the cap: {releases}"
    for name in ("gpt-too-small", "memory-too-small"):
        msg, cap = got[name].get("init_error", ""), specs[name]["max_live"]
        assert msg.startswith("ConfigError: prefetch.max_live_bytes"), f"{name}: {got[name]}"
        assert f"{cap} bytes" in msg and "'<root>'" in msg and "'transformer.h.0'" in msg, msg
        assert f"at least {cap + 1}" in msg, msg
    msg = got["nested"].get("run_error", "")
    assert msg.startswith(f"prefetch.max_live_bytes = {specs['nested']['max_live']} bytes cannot be honoured"), \
        got["nested"]
    assert "unit blocks.1" in msg and "blocks.0" in msg and "in_use" in msg, msg


# ---------------------------------------------------------------- the bookkeeping alone

def test_live_units_release_order_and_transitions():
    from infinity.zero.live_units import LiveUnits
    from infinity.zero.units import FlatUnit, UnitUse
    u = [FlatUnit(i, f"u{i}", torch.nn.Module(), [], [], {}, shard_world=1, align_numel=1) for i in range(5)]
    live = LiveUnits(u, {0: 40, 1: 10, 2: 10, 3: 10, 4: 10}, max_live_bytes=70)
    for i in range(5):   # units start gathered, as FlatUnits do
        live.released(u[i])
    live.reset_step()
    for i, use in ((0, UnitUse.IN_USE), (1, UnitUse.IN_USE), (2, UnitUse.AHEAD), (3, UnitUse.AHEAD)):
        live.set_use(u[i], use)
        live.gathering(u[i])
    live.set_use(u[1], UnitUse.KEPT)
    assert not live.fits(u[4]) and live.live_bytes == 70
    assert live.victims_for(u[4], rank=0) == [u[3]]           # the newest ahead unit first
    live.released(u[3])
    live.gathering(u[4])
    live.set_use(u[4], UnitUse.IN_USE)
    assert live.victims_for(u[3], rank=0) == [u[2]]           # then the other ahead one
    live.released(u[2])
    live.set_use(u[4], UnitUse.KEPT)
    live.gathering(u[2])
    live.set_use(u[2], UnitUse.IN_USE)
    assert live.victims_for(u[3], rank=0) == [u[1]]           # then kept ones, oldest first
    assert live.take_step_stats() == {"live_peak_bytes": 70, "live_cap_releases": 3}
    assert live.peak_bytes == 70 and live.cap_releases == 0   # the next step starts from what is live
    live.set_use(u[1], UnitUse.IN_USE)
    live.set_use(u[4], UnitUse.IN_USE)
    with pytest.raises(RuntimeError, match=r"prefetch.max_live_bytes = 70 bytes cannot be honoured on rank 3: "
                                           r"unit u3 \(10 bytes\).*u0 \(40 bytes, in_use\).*at least 80"):
        live.victims_for(u[3], rank=3)
    with pytest.raises(RuntimeError, match="illegal use transition in_use -> ahead"):
        live.set_use(u[0], UnitUse.AHEAD)
    assert u[0].use is UnitUse.IN_USE                          # the refused move changed nothing
    with pytest.raises(RuntimeError, match="u3: released while not gathered"):
        live.released(u[3])


def test_check_cap_names_root_and_largest_unit():
    from infinity.config import ConfigError
    from infinity.zero.live_units import check_cap
    sizes = {"<root>": 100, "h.0": 300, "h.1": 300, "h.2": 200}
    check_cap(400, sizes, "<root>")
    with pytest.raises(ConfigError, match=r"^prefetch.max_live_bytes: 399 bytes cannot hold unit '<root>' \(100 "
                                          r"bytes\) and unit 'h.0' \(300 bytes\).*at least 400$"):
        check_cap(399, sizes, "<root>")
    check_cap(300, {"h.0": 300, "h.1": 200}, None)          # no root unit: the largest alone
    with pytest.raises(ConfigError, match="unit 'h.0' \\(300 bytes\\) gathered at once"):
        check_cap(299, {"h.0": 300, "h.1": 200}, None)


def test_auto_cap_is_a_gibibyte_or_what_large_units_need():
    """The default never refuses a model: 1 GiB, or root + 2 x the largest unit when that is more."""
    from infinity.config import Config
    from infinity.zero.live_units import check_cap, resolve_cap
    assert Config.from_dict({}).prefetch.max_live_bytes == "auto"
    small = {"<root>": 100, "h.0": 300}
    assert resolve_cap("auto", small, "<root>") == 1 << 30
    huge = {"<root>": 2 << 30, "h.0": 700 << 20, "h.1": 900 << 20}   # e.g. a 2 GiB embedding
    assert resolve_cap("auto", huge, "<root>") == (2 << 30) + 2 * (900 << 20)
    check_cap(resolve_cap("auto", huge, "<root>"), huge, "<root>")
    assert resolve_cap(12345, huge, "<root>") == 12345


class _Stack(nn.Module):
    """Root (an embedding) and five units of different sizes, for driving the engine by hand."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16 * k) for k in (1, 9, 3, 17, 5))


def test_engine_never_exceeds_the_cap_in_any_order():
    """Any sequence of uses, prefetches, forward ends and releases (the in-memory stage-3 engine, world size
    1): live bytes stay within the cap, a unit in use is never released, the books match the units' states,
    and an impossible use raises instead of exceeding."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    import infinity
    from infinity.zero.live_units import UnitUse

    torch.manual_seed(0)
    model, _ = infinity.initialize(_Stack(), {"zero": {"stage": 3, "reshard_after_forward": False}})
    engine = infinity.engine_of(model)
    full = {u.index: engine.live.full_bytes[u.index] for u in engine.units}
    root = next(u.index for u in engine.units if u.is_root)
    least = full[root] + max(b for i, b in full.items() if i != root)
    ops = st.lists(st.tuples(st.sampled_from(["use", "ahead", "forward_done", "release"]),
                             st.integers(0, len(engine.units) - 1)), max_size=40)

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
    @hypothesis.given(extra=st.integers(0, sum(full.values())), ops=ops)
    def run(extra, ops):
        engine.live.max_live_bytes = least + extra
        for u in engine.units:
            engine.gathers.release(u)
        for op, i in ops:
            unit = engine.units[i]
            in_use = {j for j in full if engine.units[j].use is UnitUse.IN_USE}
            if op == "use":
                try:
                    engine.gathers.acquire(unit)
                except RuntimeError as e:
                    assert "cannot be honoured" in str(e)
                    assert sum(full[j] for j in in_use) + full[i] > engine.live.max_live_bytes
            elif op == "ahead":
                engine.gathers.gather_ahead(unit)
            elif op == "forward_done" and unit.use is UnitUse.IN_USE:
                engine.gathers.after_forward(unit)
            elif op == "release":
                engine.gathers.release(unit)
                in_use.discard(i)
            states = {j: u.state.value for j, u in enumerate(engine.units)}
            assert engine.live.live_bytes <= engine.live.max_live_bytes, (engine.live.live_bytes, states)
            assert engine.live.live_bytes == sum(full[j] for j, s in states.items() if s != "sharded")
            assert all(states[j] != "sharded" for j in in_use), f"a unit in use was released: {states}"

    try:
        run()
    finally:
        engine.close()
