"""The measured rates the cost model runs on: read from an ``infinity profile`` JSON, plus the model's compute.

Every rate the planner uses is a measurement of this machine:

- :class:`Rates` from the profile (:mod:`infinity.profile`): host memcpy GB/s, the I/O engine's disk
  read and write GB/s alone (the best sweep row, the one the planner's ``io`` section uses) and at
  once (the profile's ``nvme.mixed`` point: a read and a write stream sharing the disk), CPU Adam
  parameters per second per state format, and collective algorithm bandwidth per op and size.
- :class:`ComputeRates` from timing the model itself (:func:`measure_compute`): forward and backward
  seconds of the root unit and of one block, at the step's token count and compute dtype, found by
  running the model (whole, or cut to two blocks when it is large), each block timed by hooks and the
  root as the rest.
  FLOP/s at the model's own shapes, attention, norms and the loss included, not a matmul's peak.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from infinity.estimate.activations import SavedBytes
from infinity.zero.units import choose_unit_modules

__all__ = ["Rates", "ComputeRates", "PlanInputError", "load_profile", "measure_compute", "truncated_model",
           "ADAM_MODES", "adam_mode"]

# CPU Adam per stored state format ("master/moments", as optimizer.master / optimizer.moments name
# them): the fp32 update is the profile's cpu_adam params_per_s; every other format's figure is in its
# cpu_adam "formats" section (:func:`infinity.profile.measure_cpu_adam` measures each format the config
# accepts), so a format added to the config is profiled and planned without a row here.
ADAM_MODES = {"fp32/fp32": "params_per_s"}


def adam_mode(config) -> str:
    """The state-format key of ``config``'s optimizer (``master/moments``), as :attr:`Rates.adam_params_per_s` keys it."""
    return f"{config.optimizer.master}/{config.optimizer.moments}"


class PlanInputError(ValueError):
    """A profile or model the planner cannot use; the message names which and why."""


@dataclass(frozen=True)
class Rates:
    """Rates from one profile, GB/s = 1e9 bytes per second. ``lower_bound``: the profile marked its
    figures as lower bounds (a quick run with points too small for set-up cost to vanish)."""

    memcpy_gbps: float
    read_gbps: float                 # disk read alone, the I/O engine at ``io``'s settings
    write_gbps: float                # disk write alone
    mixed_read_gbps: float           # each direction's rate while both run at once
    mixed_write_gbps: float
    adam_params_per_s: dict          # state format -> parameters per second (ADAM_MODES)
    collectives: dict                # op -> [(bytes, algbw GB/s), ...] ascending; {} at one rank
    io: dict                         # the config io section the disk figures were measured with
    lower_bound: bool = False
    source: str = "profile"
    cores: int = 1
    ram_available_bytes: int = 0
    # CPU compute beside the disk streaming reads and writes at once / alone (profile "contention");
    # None: a profile older than that section (the compute is then priced unslowed, and said so)
    compute_slowdown: float | None = None
    # a copy into a block allocated for it (its pages faulted in and zeroed; profile "memcpy" fresh_gbps);
    # None: a profile older than that figure (such copies are priced at memcpy_gbps, and said so)
    memcpy_fresh_gbps: float | None = None

    @classmethod
    def from_profile(cls, profile: dict, source: str = "profile") -> "Rates":
        """Read the sections :mod:`infinity.profile` writes; a missing one is named."""
        try:
            nvme, adam, best = profile["nvme"], profile["cpu_adam"], profile["io"]
            row = next(r for r in nvme["sweep"] if all(r[k] == best[k] for k in ("block_bytes", "threads",
                                                                                 "queue_depth")))
            read, write = row["read_gbps"], row["write_gbps"]
            mixed = nvme.get("mixed") or {}
            # no at-once point (an older profile): the disk is one resource, each direction gets its share
            mixed_read = mixed.get("read_gbps", read / 2)
            mixed_write = mixed.get("write_gbps", write / 2)
            coll = {}
            if profile.get("collectives", {}).get("available"):
                for r in profile["collectives"]["rows"]:
                    coll.setdefault(r["op"], []).append((r["bytes"], r["algbw_gbps"]))
                coll = {k: sorted(v) for k, v in coll.items()}
            modes = {mode: adam[key] for mode, key in ADAM_MODES.items() if key in adam}
            modes.update({mode: row["params_per_s"] for mode, row in (adam.get("formats") or {}).items()
                          if mode not in modes})
            return cls(memcpy_gbps=profile["memcpy"]["gbps"], read_gbps=read, write_gbps=write,
                       mixed_read_gbps=mixed_read, mixed_write_gbps=mixed_write, adam_params_per_s=modes,
                       collectives=coll, io=dict(best),
                       lower_bound=bool(profile.get("settings", {}).get("lower_bound", False)), source=source,
                       cores=profile["machine"].get("cores_available", 1),
                       ram_available_bytes=profile["machine"].get("ram_available_bytes", 0),
                       compute_slowdown=(profile.get("contention") or {}).get("slowdown"),
                       memcpy_fresh_gbps=profile["memcpy"].get("fresh_gbps"))
        except (KeyError, StopIteration, TypeError) as e:
            raise PlanInputError(f"{source}: not an infinity profile (missing {e}); make one with "
                                 "`infinity profile`") from None

    def adam_s(self, numel: int, mode: str = "fp32/fp32") -> float:
        """Seconds of CPU Adam over ``numel`` parameters with states in ``mode`` (``master/moments``)."""
        if mode not in self.adam_params_per_s:
            raise PlanInputError(f"{self.source}: no CPU Adam figure for state format {mode!r} (a profile "
                                 "older than the format: run `infinity profile` again)")
        return numel / self.adam_params_per_s[mode]

    def has_adam_mode(self, mode: str) -> bool:
        """Whether the profile measured CPU Adam with states in ``mode``."""
        return mode in self.adam_params_per_s

    def collective_s(self, op: str, nbytes: int, calls: int = 1) -> float:
        """Seconds for ``calls`` collectives of ``op`` moving ``nbytes`` in all (full-tensor bytes), at the
        algorithm bandwidth measured nearest the per-call size (log scale)."""
        if nbytes <= 0 or calls <= 0:
            return 0.0
        rows = self.collectives.get(op)
        if not rows:
            raise PlanInputError(f"{self.source}: no {op} figure (profile with --nproc >= 2 for a multi-rank plan)")
        per_call = nbytes / calls
        _, gbps = min(rows, key=lambda r: abs(math.log(r[0] / per_call)))
        return nbytes / (gbps * 1e9)

    def to_dict(self) -> dict:
        return asdict(self)


def load_profile(path: str | Path) -> Rates:
    """:class:`Rates` from an ``infinity profile`` JSON file (or its output directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "profile.json"
    try:
        profile = json.loads(p.read_text())
    except OSError as e:
        raise PlanInputError(f"--profile {p}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise PlanInputError(f"--profile {p}: not JSON ({e})") from None
    return Rates.from_profile(profile, source=str(p))


@dataclass(frozen=True)
class ComputeRates:
    """Measured compute seconds per step for ``tokens`` tokens per rank in ``dtype``: the root unit's
    and one block's forward and backward (backward excludes the recompute; activation checkpointing
    adds one block forward per block to it)."""

    tokens: int
    dtype: str
    root_forward_s: float
    root_backward_s: float
    block_forward_s: float
    block_backward_s: float
    blocks: int
    flops_per_s: float = 0.0          # 6 x parameters x tokens over the measured forward + backward
    root_saved_bytes: int = 0         # tensors the forward saves for backward outside the blocks
    block_saved_bytes: int = 0        # ... inside one block (what activation checkpointing drops)
    block_input_bytes: int = 0        # one block's input (what activation checkpointing keeps instead)
    measured: dict = field(default_factory=dict)

    @property
    def saved(self) -> SavedBytes:
        """The measured saves, split as checkpointing and offload split them."""
        return SavedBytes(self.root_saved_bytes, self.block_saved_bytes, self.block_input_bytes, self.blocks)

    def activation_bytes(self, checkpointed: int, offload: str = "none") -> int:
        """Saved-for-backward bytes of the whole model's forward at the measured micro-batch held in device
        memory at once, with ``checkpointed`` of the blocks recomputed in backward
        (``ZeroConfig.checkpointed_units``) and their saves in ``offload``'s tier
        (:meth:`SavedBytes.on_device`)."""
        return self.saved.on_device(checkpointed, offload)

    def offloaded_bytes(self, checkpointed: int) -> int:
        return self.saved.offloaded(checkpointed)

    def block_offload_bytes(self, checkpointed: int) -> int:
        return self.saved.per_block(checkpointed)

    def forward_s(self) -> float:
        return self.root_forward_s + self.blocks * self.block_forward_s

    def backward_s(self, checkpointed: int) -> float:
        """Backward with ``checkpointed`` blocks' forwards run again inside it."""
        recompute = self.saved.recomputed(checkpointed) * self.block_forward_s
        return self.root_backward_s + self.blocks * self.block_backward_s + recompute

    def to_dict(self) -> dict:
        return asdict(self)


def truncated_model(build: Callable[[], nn.Module], blocks: int) -> tuple:
    """``(model, blocks in the full model)``: ``build()`` on the meta device with its unit ModuleList cut to
    its first ``blocks`` children, then materialized on the CPU with small random weights (speed does not
    depend on their values)."""
    with torch.device("meta"):
        model = build()
    units = choose_unit_modules(model)
    if not units:
        raise PlanInputError(f"{type(model).__name__}: no ModuleList of blocks to time one block by")
    parent_name = units[0][0].rsplit(".", 1)[0]
    parent = model.get_submodule(parent_name)
    full = len(list(parent))
    if blocks < full:
        keep = nn.ModuleList(list(parent)[:blocks])
        owner_name, _, attr = parent_name.rpartition(".")
        setattr(model.get_submodule(owner_name) if owner_name else model, attr, keep)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).mul_(0.02))
        for b in model.buffers():
            if b.is_floating_point():
                b.zero_()
    return model, full


class _BlockClock:
    """Forward and backward seconds inside each block, from hooks: forward between the block's pre- and
    post-hooks; backward from the gradient reaching its output to the gradient leaving for its input."""

    def __init__(self, blocks: list):
        self.forward_s = [0.0] * len(blocks)
        self.backward_s = [0.0] * len(blocks)
        self.input_bytes = 0
        self._t: dict = {}
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(functools.partial(self._pre, i)))
            self.handles.append(block.register_forward_hook(functools.partial(self._post, i)))

    def _pre(self, i, _module, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None:
            self.input_bytes = max(self.input_bytes, x.numel() * x.element_size())
            if x.requires_grad:   # the gradient leaving the block for its input: its backward is done
                x.register_hook(functools.partial(self._left, i))
        self._t[("f", i)] = time.perf_counter()

    def _post(self, i, _module, _args, out):
        self.forward_s[i] += time.perf_counter() - self._t.pop(("f", i))
        y = out[0] if isinstance(out, tuple) else out
        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(functools.partial(self._entered, i))

    def _entered(self, i, grad):
        self._t[("b", i)] = time.perf_counter()

    def _left(self, i, grad):
        t0 = self._t.pop(("b", i), None)
        if t0 is not None:
            self.backward_s[i] += time.perf_counter() - t0

    def remove(self):
        for h in self.handles:
            h.remove()


# The whole model is timed when its weights and gradients in the compute dtype take at most this much
# memory; a bigger one is cut to two blocks and the blocks' time extrapolated (which reads low where the
# whole model's working set runs slower than two blocks')
WHOLE_MODEL_BYTES = 4 * 2**30


def measure_compute(build: Callable[[], nn.Module], loss_fn, batch: int, seq: int, dtype: torch.dtype,
                    vocab: int, repeats: int = 1, blocks: int | None = None) -> ComputeRates:
    """Time forward and backward of the model (cut to ``blocks`` blocks, :func:`truncated_model`; default:
    the whole model if it is within :data:`WHOLE_MODEL_BYTES`, else two blocks), the median of ``repeats``
    after a warm-up (a measured step's median is what it is compared with; the best of them came out 7-33%
    below the engine's steps in tools/bench_plan.py), each block timed by hooks (:class:`_BlockClock`) and
    the root as the rest; also the bytes the forward saves for backward, in the blocks and outside.
    ``loss_fn(model, input_ids, labels)`` is the training loss."""
    from infinity.zero.memory_report import SavedTensorMeter

    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    if blocks is None:
        with torch.device("meta"):
            numel = sum(p.numel() for p in build().parameters())
        item = torch.empty((), dtype=dtype).element_size()
        blocks = 10**9 if 2 * numel * item <= WHOLE_MODEL_BYTES else 2
    model, blocks_full = truncated_model(build, blocks)
    blocks = min(blocks, blocks_full)
    model.to(dtype)
    mods = [m for _, m in choose_unit_modules(model)]
    params = sum(p.numel() for p in model.parameters())
    block_params = sum(p.numel() for p in mods[0].parameters())
    runs: dict = {k: [] for k in ("fwd", "bwd", "block_f", "block_b")}
    saved = inside = 0
    for i in range(repeats + 1):
        clock = _BlockClock(mods)
        meter, in_blocks = SavedTensorMeter(), SavedTensorMeter()
        try:
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                loss = loss_fn(model, ids, ids)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
        finally:
            clock.remove()
        model.zero_grad(set_to_none=True)
        saved = meter.peak_bytes
        del loss
        if i == 0:   # the warm-up (kernels load, the allocator grows); also where the blocks' saves are counted
            inside = _saved_inside(model, mods, loss_fn, ids, in_blocks)
            continue
        runs["fwd"].append(t1 - t0)
        runs["bwd"].append(t2 - t1)
        runs["block_f"].append(sum(clock.forward_s) / len(mods))
        runs["block_b"].append(sum(clock.backward_s) / len(mods))
    del model
    mid = {k: statistics.median(v) for k, v in runs.items()}
    block_f, block_b = mid["block_f"], mid["block_b"]
    root_f = max(mid["fwd"] - blocks * block_f, 0.0)
    root_b = max(mid["bwd"] - blocks * block_b, 0.0)
    tokens = batch * seq
    total_params = params + (blocks_full - blocks) * block_params
    total_s = root_f + root_b + blocks_full * (block_f + block_b)
    return ComputeRates(tokens=tokens, dtype=str(dtype).removeprefix("torch."), root_forward_s=root_f,
                        root_backward_s=root_b, block_forward_s=block_f, block_backward_s=block_b,
                        blocks=blocks_full, flops_per_s=6 * total_params * tokens / max(total_s, 1e-9),
                        root_saved_bytes=max(saved - inside, 0), block_saved_bytes=inside // blocks,
                        block_input_bytes=clock.input_bytes,
                        measured={"forward_s": mid["fwd"], "backward_s": mid["bwd"], "timed_blocks": blocks,
                                  "saved_bytes": saved})


def _saved_inside(model, mods, loss_fn, ids, meter) -> int:
    """Bytes the blocks' own forwards save for backward (the meter pushed only while a block runs)."""
    ctx: list = []

    def pre(_m, _a):
        c = torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)
        c.__enter__()
        ctx.append(c)

    def post(_m, _a, _o):
        ctx.pop().__exit__(None, None, None)
    handles = [h for m in mods for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        loss = loss_fn(model, ids, ids)
    finally:
        for h in handles:
            h.remove()
    peak = meter.peak_bytes
    del loss
    return peak
