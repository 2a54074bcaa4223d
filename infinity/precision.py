"""Which dtype this machine computes fast in: known on CUDA, measured on a CPU.

bf16 is native on CUDA devices of compute capability 8.0 and up (A100, H100,
RTX 30xx+); older ones (V100, T4) train in fp16 with loss scaling. On a CPU it
depends on the instruction set: with ``avx512_bf16`` or AMX, torch's bf16 matmul
is faster than fp32; without them it falls to a reference loop some 50-90x
slower. So ``precision.param_dtype: auto`` decides by capability on CUDA and by
a short matmul probe at the model's own shapes on a CPU (:func:`measure_rates`,
bounded to seconds, cached per machine and torch version beside the
native-kernel cache).

Two dtypes are chosen (:class:`PrecisionChoice`): the stored one, which the
parameter shards have in every tier and in every gather, and the compute one,
which forward and backward run in. Where bf16 computes slowly but the
parameters are offloaded, bf16 is still stored (half the bytes read from NVMe
and gathered) and each gathered unit is upcast to fp32 once per use.

Below the engine: imports only the config and the native-build cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from infinity.config import Config
from infinity.native_build import cache_dir, cpu_flags

__all__ = ["DTYPES", "PrecisionChoice", "choose", "cpu_description", "cpu_rates", "hardware_record",
           "measure_rates", "model_shapes", "nominal_dtypes", "resolve_precision", "slow_choice_warning"]

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The probe's rows (tokens): enough for the matmul kernels' steady rate, small enough for milliseconds.
PROBE_ROWS = 256
# A first look at each dtype before the full shapes: SCREEN_LOOKS turns of one small weight at
# SCREEN_ROWS rows, on one thread, each dtype's best. There fp32 runs near its steady rate (the weight
# stays in cache) and a dtype emulated in software shows some 15-90x slower (its look takes about a
# second at 1 GFLOP/s). One thread, as a step of milliseconds on several measures how soon a busy
# machine's scheduler wakes the others more than the kernel. A few rows of a large weight would not do:
# fp32 then reads the whole weight from memory and runs at a tenth of its rate, so an emulated bf16 can
# look less than FAR_SLOWER slower (under AVX2 caps: fp32 4.1, bf16 0.9 GFLOP/s at 8 x 2048 x 2048).
SCREEN_SHAPE = (768, 768)
SCREEN_ROWS = 64
SCREEN_LOOKS = 3
# A dtype FAR_SLOWER than the fastest at the first look is not measured further, nor one whose two
# full-size rounds (the fewest the probe runs) would take more than FAR_SLOWER budgets at that rate.
FAR_SLOWER = 4.0
# Time the full-size probe may take, all dtypes together.
PROBE_BUDGET_S = 0.6
# An explicit choice this much slower than the other gets a warning.
WARN_RATIO = 1.5
# Weight shapes probed, at most: the model's most common (by elements) two-dimensional weights.
MAX_SHAPES = 3
DEFAULT_SHAPES = ((1024, 1024), (1024, 4096))
# Environment variables that hold torch's CPU kernels below the CPU's instruction set.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


# ---------------------------------------------------------------- the hardware

def cpu_description() -> dict:
    """The CPU: its model name, family/model numbers, and whether it computes bf16 natively
    (``avx512_bf16`` or AMX, as ``/proc/cpuinfo`` says) and torch's kernel level for it."""
    info = {"model": platform.processor() or platform.machine(), "family": None, "model_number": None}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    info["model"] = value
                elif key == "cpu family":
                    info["family"] = int(value)
                elif key == "model":
                    info["model_number"] = int(value) if value.isdigit() else value
                elif not line.strip():
                    break
    except OSError:
        pass
    flags = set(cpu_flags().decode(errors="replace").split())
    info["avx512_bf16"] = "avx512_bf16" in flags
    info["amx_bf16"] = "amx_bf16" in flags
    info["avx512f"] = "avx512f" in flags
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    # kernels held below what the CPU has (e.g. to AVX2: then bf16 is emulated despite the flags)
    info["isa_caps"] = {k: os.environ[k] for k in ISA_CAPS if os.environ.get(k)}
    info["threads"] = torch.get_num_threads()
    info["cores"] = os.cpu_count()
    return info


def hardware_record(device: torch.device | str | None = None) -> dict:
    """What a benchmark records beside its figures: the CPU (:func:`cpu_description`), torch's version,
    and on CUDA the device's name and compute capability. Figures from two records that differ here
    are not to be put in one ratio."""
    out = {"cpu": cpu_description(), "torch": torch.__version__}
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        out["cuda"] = {"name": torch.cuda.get_device_name(device),
                       "capability": list(torch.cuda.get_device_capability(device))}
    return out


# ---------------------------------------------------------------- the probe

def model_shapes(model: nn.Module, limit: int = MAX_SHAPES) -> tuple:
    """The weight shapes the model's matmuls use most: its trainable two-dimensional parameters outside
    embeddings, distinct shapes ranked by the elements they hold all together (``limit`` of them).
    A model without any gives :data:`DEFAULT_SHAPES`."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total: dict = {}
    for p in model.parameters():
        if p.requires_grad and p.dim() == 2 and id(p) not in embedded:
            shape = (int(p.shape[0]), int(p.shape[1]))
            total[shape] = total.get(shape, 0) + p.numel()
    ranked = sorted(total, key=lambda s: (-total[s], s))[:limit]
    return tuple(ranked) if ranked else DEFAULT_SHAPES


def _time_step(a: torch.Tensor, w: torch.Tensor) -> float:
    """Seconds for one linear layer's three matmuls: forward, input gradient, weight gradient."""
    if a.is_cuda:   # CUDA: the matmuls are queued, not done, when the calls return
        torch.cuda.synchronize(a.device)
    t0 = time.perf_counter()
    y = a @ w
    y @ w.t()
    a.t() @ y
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    return time.perf_counter() - t0


def _flops(rows: int, shape: tuple) -> float:
    return 3 * 2.0 * rows * shape[0] * shape[1]


def _screen(dtypes, device, gen: torch.Generator) -> dict:
    """GFLOP/s of each dtype at the first look (:data:`SCREEN_SHAPE`, :data:`SCREEN_ROWS` rows, one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        inputs = {n: (torch.randn(SCREEN_ROWS, SCREEN_SHAPE[0], generator=gen).to(device, DTYPES[n]),
                      torch.randn(*SCREEN_SHAPE, generator=gen).to(device, DTYPES[n])) for n in dtypes}
        for n in dtypes:
            _time_step(*inputs[n])   # the first call loads kernels and sizes caches
        best = dict.fromkeys(dtypes, float("inf"))
        for _ in range(SCREEN_LOOKS):   # in turns: a burst of load from elsewhere misses one of them
            for n in dtypes:
                best[n] = min(best[n], _time_step(*inputs[n]))
    finally:
        torch.set_num_threads(threads)
    return {n: _flops(SCREEN_ROWS, SCREEN_SHAPE) / best[n] / 1e9 for n in dtypes}


def measure_rates(shapes, dtypes=("fp32", "bf16"), rows: int = PROBE_ROWS, budget_s: float = PROBE_BUDGET_S,
                  device: torch.device | str = "cpu") -> dict:
    """GFLOP/s of each dtype's linear-layer matmuls (forward and both gradients) at ``shapes``, with
    ``rows`` tokens. Bounded on any machine: a first look (:func:`_screen`) drops a dtype that is far
    slower (see :data:`FAR_SLOWER`; its figure is the look's, listed in ``"stopped_early"``); the rest
    are measured in turns, best time per shape, for about ``budget_s`` (two rounds at least).
    Returns ``{"gflops": {dtype: rate}, "stopped_early": [dtypes], "rows", "shapes", "screen"}``."""
    gen = torch.Generator().manual_seed(0)
    screen = _screen(dtypes, device, gen)
    fastest = max(screen.values())
    round_flops = sum(_flops(rows, s) for s in shapes)
    stopped = [n for n in dtypes if screen[n] < fastest and (
        screen[n] * FAR_SLOWER < fastest or 2 * round_flops / (screen[n] * 1e9) > FAR_SLOWER * budget_s)]
    kept = [n for n in dtypes if n not in stopped]
    inputs = {n: [(torch.randn(rows, s[0], generator=gen).to(device, DTYPES[n]),
                   torch.randn(*s, generator=gen).to(device, DTYPES[n])) for s in shapes] for n in kept}
    best = {n: [float("inf")] * len(shapes) for n in kept}
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < 3 or (time.perf_counter() < deadline and rounds < 50):
        for n in kept:   # in turns, so a burst of load from elsewhere hits both dtypes alike
            for i, (a, w) in enumerate(inputs[n]):
                if rounds:   # round 0 warms up
                    best[n][i] = min(best[n][i], _time_step(a, w))
                else:
                    _time_step(a, w)
        rounds += 1
    gflops = {n: round_flops / sum(best[n]) / 1e9 for n in kept}
    gflops.update({n: screen[n] for n in stopped})
    return {"gflops": {n: gflops[n] for n in dtypes}, "stopped_early": stopped, "rows": rows,
            "shapes": [list(s) for s in shapes],
            "screen": {"shape": list(SCREEN_SHAPE), "rows": SCREEN_ROWS, "threads": 1, "gflops": screen}}


def _cache_key(shapes, dtypes) -> str:
    parts = [cpu_flags(), json.dumps(cpu_description(), sort_keys=True).encode(), torch.__version__.encode(),
             json.dumps([list(s) for s in shapes]).encode(), ",".join(dtypes).encode(), str(PROBE_ROWS).encode(),
             # the kernels' instruction-set caps change the rates on the same CPU
             *(os.environ.get(k, "").encode() for k in ISA_CAPS)]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def cpu_rates(shapes, dtypes=("fp32", "bf16")) -> tuple:
    """``(measure_rates(...) on the CPU, cached: bool)``: read from the cache when this machine (CPU, flags,
    threads) and torch version measured these shapes before, else measured and kept there.
    ``INFINITY_CACHE`` moves the cache; a damaged file is measured again."""
    path = cache_dir() / "precision" / f"rates-{_cache_key(shapes, dtypes)}.json"
    try:
        rates = json.loads(path.read_text())
        if set(rates["gflops"]) == set(dtypes):
            return rates, True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rates = measure_rates(shapes, dtypes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(rates, f)
        os.replace(tmp, path)   # ranks probing at once each write whole files
    except OSError as e:
        log.info("infinity: precision probe not cached (%s)", e)
    return rates, False


# ---------------------------------------------------------------- the rule

@dataclass(frozen=True)
class PrecisionChoice:
    """The dtypes ``auto`` resolved to, and why."""

    param_dtype: str       # stored: parameter shards in every tier, gathers
    compute_dtype: str     # forward and backward
    reason: str            # one clause, for the log line
    gflops: dict = dataclasses.field(default_factory=dict)   # the probe's rates, if one ran

    def for_config(self, params_offloaded: bool, needs_bf16_storage: bool) -> tuple:
        """``(param_dtype, compute_dtype)`` this answer gives a config that does (not) offload its parameters
        or keep a remainder master: a bf16 store over fp32 compute only where one of those holds."""
        if self.param_dtype != self.compute_dtype and not (params_offloaded or needs_bf16_storage):
            return self.compute_dtype, self.compute_dtype
        return self.param_dtype, self.compute_dtype

    def line(self) -> str:
        """The log line: the choice, its reason and the timings."""
        stored = (f"param_dtype {self.param_dtype}" if self.param_dtype == self.compute_dtype else
                  f"param_dtype {self.param_dtype} stored, compute_dtype {self.compute_dtype}")
        return f"infinity: precision auto -> {stored}: {self.reason}"


def nominal_dtypes(precision) -> tuple:
    """``(stored, compute)`` of a ``precision`` config section before any measurement, for estimates made
    without the hardware at hand: ``auto`` counted as bf16, what it picks wherever bf16 computes natively
    or the parameters are offloaded (an fp32 answer only comes where neither holds)."""
    stored = "bf16" if precision.param_dtype == "auto" else precision.param_dtype
    compute = stored if precision.compute_dtype == "auto" else precision.compute_dtype
    return stored, compute


def _rates_text(gflops: dict, stopped=()) -> str:
    return ", ".join(f"{n} {r:.1f}" + (" (stopped early)" if n in stopped else "") for n, r in gflops.items())


def choose(device: torch.device, shapes, params_offloaded: bool, needs_bf16_storage: bool = False,
           capability: tuple | None = None, rates: dict | None = None) -> PrecisionChoice:
    """The ``auto`` rule. CUDA: bf16 from compute capability 8.0 (native there), else fp16 (dynamic loss
    scaling). CPU: bf16 if its probe (``rates``, else :func:`cpu_rates`) beats fp32, else fp32 compute;
    then stored in bf16 anyway where the parameters are offloaded (half the bytes read and gathered) or
    ``needs_bf16_storage`` (the remainder master), each gathered unit upcast once per use.
    ``capability`` and ``rates`` stand in for the device's in tests."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = capability if capability is not None else torch.cuda.get_device_capability(device)
        if major >= 8:
            return PrecisionChoice("bf16", "bf16", f"CUDA compute capability {major}.{minor} computes bf16 natively")
        if needs_bf16_storage:
            return PrecisionChoice("bf16", "fp32", f"CUDA compute capability {major}.{minor} has no native bf16; "
                                   "the remainder master needs bf16 parameters, computed in fp32")
        return PrecisionChoice("fp16", "fp16", f"CUDA compute capability {major}.{minor} has no native bf16 "
                               "(from 8.0); fp16 with dynamic loss scaling")
    cached = None
    if rates is None:
        rates, cached = cpu_rates(shapes)
    g = rates["gflops"]
    timings = f"matmul GFLOP/s at the model's shapes: {_rates_text(g, rates.get('stopped_early', ()))}"
    if cached:
        timings += ", cached"
    if g["bf16"] > g["fp32"]:
        return PrecisionChoice("bf16", "bf16", f"bf16 computes {g['bf16'] / g['fp32']:.2f}x faster than fp32 on "
                               f"this CPU ({timings})", dict(g))
    slower = f"bf16 computes {g['fp32'] / g['bf16']:.1f}x slower than fp32 on this CPU ({timings})"
    if params_offloaded or needs_bf16_storage:
        why = "the parameters are offloaded" if params_offloaded else "the remainder master needs bf16 parameters"
        return PrecisionChoice("bf16", "fp32", f"{slower}; stored in bf16 as {why}, each gathered unit upcast "
                               "once per use", dict(g))
    return PrecisionChoice("fp32", "fp32", slower, dict(g))


def slow_choice_warning(device: torch.device, compute_dtype: str, shapes, capability: tuple | None = None,
                        rates: dict | None = None) -> str | None:
    """One warning line when an explicit compute dtype is slow here, saying how much faster the other
    is; None when it is not (or nothing is known: fp32, or a CUDA device)."""
    device = torch.device(device)
    if compute_dtype == "fp32":
        return None
    if device.type == "cuda":
        major, minor = capability if capability is not None else torch.cuda.get_device_capability(device)
        if compute_dtype == "bf16" and major < 8:
            return (f"infinity: precision.param_dtype bf16 on CUDA compute capability {major}.{minor} is emulated "
                    "(native from 8.0); fp16 or param_dtype auto is faster")
        return None
    if rates is None:
        rates, _ = cpu_rates(shapes, ("fp32", compute_dtype))
    g = rates["gflops"]
    if g["fp32"] > WARN_RATIO * g[compute_dtype]:
        return (f"infinity: precision {compute_dtype} computes {g['fp32'] / g[compute_dtype]:.1f}x slower than "
                f"fp32 on this CPU (matmul GFLOP/s: {_rates_text(g, rates.get('stopped_early', ()))}); "
                "precision.param_dtype auto chooses by this measurement")
    return None


# ---------------------------------------------------------------- the config

def resolve_precision(cfg: Config, model: nn.Module, device: torch.device, agree=None,
                      announce: bool = True) -> tuple:
    """``(config, choice)``: ``cfg`` with ``precision.param_dtype`` / ``compute_dtype`` ``auto`` resolved
    (choice None when nothing was ``auto``; then a slow explicit compute dtype is warned about).
    ``agree(choice)`` makes every rank take the same answer (rank 0's), where ranks could measure
    differently; it is given the local answer and returns the one to use. ``announce``: log the choice
    (or the warning) here; other ranks pass False."""
    prec = cfg.precision
    shapes = model_shapes(model)
    if prec.param_dtype != "auto" and prec.compute_dtype != "auto":
        _warn_if_slow(device, prec.compute_dtype, shapes, announce)
        return cfg, None
    if prec.param_dtype != "auto":   # compute_dtype auto: the parameter dtype
        _warn_if_slow(device, prec.param_dtype, shapes, announce)
        return cfg.replace(precision={"compute_dtype": prec.param_dtype}), None
    choice = choose(device, shapes, params_offloaded=cfg.offload.params != "none",
                    needs_bf16_storage=cfg.optimizer.master == "remainder")
    if prec.compute_dtype != "auto":   # the stored dtype is auto, the compute one given
        choice = dataclasses.replace(choice, compute_dtype=prec.compute_dtype,
                                     param_dtype=_stored_for(choice.param_dtype, prec.compute_dtype))
    if agree is not None:
        choice = agree(choice)
    if announce:
        log.warning(choice.line())
    return cfg.replace(precision={"param_dtype": choice.param_dtype, "compute_dtype": choice.compute_dtype}), choice


def _stored_for(stored: str, compute: str) -> str:
    """The stored dtype beside an explicit compute one: a 16-bit compute dtype is stored as it is (fp16's
    loss scaling works in the parameter dtype); fp32 compute keeps a 16-bit choice as bf16 storage."""
    if compute != "fp32":
        return compute
    return "fp32" if stored == "fp32" else "bf16"


def _warn_if_slow(device, compute_dtype: str, shapes, announce: bool) -> None:
    if not announce:
        return
    warning = slow_choice_warning(device, compute_dtype, shapes)
    if warning is not None:
        log.warning(warning)
