"""The profile's ``compute`` section: matmul GFLOP/s of each dtype at transformer linear-layer shapes on the CPU
and a CUDA device, and what ``precision.param_dtype: auto`` chooses from them."""

from __future__ import annotations

import time

import torch

from infinity.precision import choose, hardware_record, measure_rates

__all__ = ["COMPUTE_SHAPES", "measure_compute", "cpu_compute_dtype", "describe_compute"]

# Linear-layer weight shapes of the compute section: (d, d) and (d, 4d) at a small and a mid-sized width.
# Ascending, so the probe's first pass (at its middle shape, a few rows) is not at the largest one.
COMPUTE_SHAPES = ((768, 768), (768, 3072), (2048, 2048), (2048, 8192))
# Seconds the compute section's full-size rounds may take per device, all dtypes together (at least two
# rounds run whatever the budget: the shapes above are small enough for that to stay in seconds).
COMPUTE_BUDGET_S = {True: 0.5, False: 2.0}   # by --quick
COMPUTE_ROWS = 256   # tokens: the matmul kernels' steady rate, milliseconds a step at fp32's


def _choice_record(choice) -> dict:
    return {"param_dtype": choice.param_dtype, "compute_dtype": choice.compute_dtype, "reason": choice.reason}


def _device_compute(device: torch.device, dtypes: tuple, budget_s: float) -> dict:
    """One device's matmul rates at :data:`COMPUTE_SHAPES` (:func:`~infinity.precision.measure_rates`:
    a dtype far slower at its first look is not measured at the full shapes, and is listed in
    ``stopped_early``) and the ``auto`` answers they give."""
    t0 = time.perf_counter()
    rates = measure_rates(COMPUTE_SHAPES, dtypes, rows=COMPUTE_ROWS, budget_s=budget_s, device=device)
    rates["elapsed_s"] = time.perf_counter() - t0
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    rates["auto"] = {key: _choice_record(choose(device, COMPUTE_SHAPES, params_offloaded=offloaded,
                                                capability=capability, rates=rates))
                     for key, offloaded in (("params_offloaded", True), ("params_not_offloaded", False))}
    return rates


def measure_compute(quick: bool) -> dict:
    """The ``compute`` section (module doc): ``{"hardware": ..., "cpu": {...}, "cuda": {...}}``, each device's
    entry :func:`infinity.precision.measure_rates`'s (``gflops``, ``stopped_early``, ``rows``, ``shapes``)
    with the first look's (``screen``), its ``elapsed_s`` and ``auto`` (``params_offloaded`` /
    ``params_not_offloaded``: the stored and compute dtype ``auto`` takes, and why). ``cuda`` only where a
    CUDA device is."""
    budget_s = COMPUTE_BUDGET_S[bool(quick)]
    cuda = torch.cuda.is_available()
    out = {"hardware": hardware_record("cuda" if cuda else "cpu"),
           "cpu": _device_compute(torch.device("cpu"), ("fp32", "bf16"), budget_s)}
    if cuda:
        out["cuda"] = _device_compute(torch.device("cuda"), ("fp32", "bf16", "fp16"), budget_s)
    return out


def cpu_compute_dtype(compute: dict) -> str:
    """The dtype a CPU device computes in here (``auto``'s answer; the same offloaded or not)."""
    return compute["cpu"]["auto"]["params_offloaded"]["compute_dtype"]


def describe_compute(compute: dict) -> list[str]:
    """The ``compute`` section as text lines, one per device: its rates and ``auto``'s answer."""
    cpu = compute["hardware"]["cpu"]
    native = next((f for f in ("amx_bf16", "avx512_bf16") if cpu.get(f)), "no bf16 instructions")
    lines = [f"cpu {cpu['model']} ({native}, torch kernels {cpu['torch_cpu_capability']}, {cpu['threads']} threads)"]
    for name in ("cpu", "cuda"):
        if name not in compute:
            continue
        dev = compute[name]
        rates = ", ".join(f"{d} {g:.1f}" + (" (stopped early)" if d in dev["stopped_early"] else "")
                          for d, g in dev["gflops"].items())
        off, on = dev["auto"]["params_offloaded"], dev["auto"]["params_not_offloaded"]
        auto = (f"{on['compute_dtype']}" if off == on else
                f"{on['param_dtype']}; offloaded params stored {off['param_dtype']}, computed {off['compute_dtype']}")
        lines.append(f"{name} matmul GFLOP/s {rates}; auto -> {auto}")
    return lines

