"""The profile's ``cpu_adam`` section: :class:`~infinity.optim.cpu_adam.CpuAdamW` beside
``torch.optim.AdamW(fused=True)`` on one flat fp32 shard, and CpuAdamW with each stored format of the master
and the moments."""

from __future__ import annotations

import itertools

import torch

from infinity.config import MASTER_FORMATS, MOMENT_FORMATS
from infinity.optim.cpu_adam import CpuAdamW
from infinity.optim.moment_codes import moment_format
from infinity.optim.split_master import split_bf16_
from infinity.profile.timing import _best_s

__all__ = ["measure_cpu_adam", "measure_adam_formats", "format_states"]

_ADAM_HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
_ADAM_STATE_BYTES_PER_PARAM = 16  # fp32 param + grad + exp_avg + exp_avg_sq, each streamed once a step


def measure_cpu_adam(numel: int, repeats: int = 3, threads: int | None = None) -> dict:
    """CpuAdamW and torch.optim.AdamW(fused=True) on the same flat fp32 shard, same run."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(1e-3)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    adam = CpuAdamW(threads=threads)
    step = [0]

    def ours():
        step[0] += 1
        adam.step_(param, grad, exp_avg, exp_avg_sq, step=step[0], **_ADAM_HYPER)

    try:
        ours()  # warm-up: the thread pool starts, the kernels load
        ours_s = _best_s(ours, repeats)
    finally:
        adam.close()
    del exp_avg, exp_avg_sq  # the baseline makes its own moments; keep peak memory at one optimizer's
    formats = measure_adam_formats(param, grad, repeats, threads)
    weight = torch.nn.Parameter(param)
    weight.grad = grad
    lr, betas, eps, wd = (_ADAM_HYPER[k] for k in ("lr", "betas", "eps", "weight_decay"))
    baseline = torch.optim.AdamW([weight], lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True)
    baseline.step()  # warm-up: allocates exp_avg / exp_avg_sq
    torch_s = _best_s(baseline.step, repeats)
    state_bytes = numel * _ADAM_STATE_BYTES_PER_PARAM
    return {
        "numel": numel,
        "state_bytes_per_param": _ADAM_STATE_BYTES_PER_PARAM,
        "threads": adam.threads,
        "torch_threads": torch.get_num_threads(),
        "gbps": state_bytes / ours_s / 1e9,
        "params_per_s": numel / ours_s,
        "torch_fused_gbps": state_bytes / torch_s / 1e9,
        "torch_fused_params_per_s": numel / torch_s,
        "ratio": torch_s / ours_s,
        "baseline": "torch.optim.AdamW(fused=True), same shard, same run",
        "formats": formats,
    }


def format_states(master_fp32: torch.Tensor, master: str, moments: str) -> tuple:
    """``(param, exp_avg, exp_avg_sq, out)`` for :meth:`CpuAdamW.step_` with states stored as
    ``optimizer.master`` / ``optimizer.moments`` say: the master as given (a copy) or its int16
    remainder beside ``out``, its bf16 parameter; zeroed moments in their stored format (fp32, bf16, or
    int8's rows of blocks)."""
    numel = master_fp32.numel()
    out = torch.empty(numel, dtype=torch.bfloat16)
    if master == "remainder":
        param = torch.empty(numel, dtype=torch.int16)
        split_bf16_(master_fp32, out, param)
    else:
        param = master_fp32.clone()
    fmt = moment_format(moments)
    return param, *(torch.zeros(fmt.shape(numel), dtype=fmt.dtype) for _ in range(2)), out


def measure_adam_formats(param: torch.Tensor, grad: torch.Tensor, repeats: int, threads: int | None) -> dict:
    """CpuAdamW with each stored format the config accepts other than fp32 / fp32 (``optimizer.master``
    x ``optimizer.moments``, keyed ``master/moments``), the bf16 parameter written back as a bf16 run's
    update does: ``{format: {"params_per_s": ...}}``. The planner prices each format's update by it."""
    numel = param.numel()
    rows = {}
    adam = CpuAdamW(threads=threads)
    try:
        for master, moments in itertools.product(MASTER_FORMATS, MOMENT_FORMATS):
            if (master, moments) == ("fp32", "fp32"):
                continue
            p, m, v, out = format_states(param, master, moments)
            step = [0]

            def run():
                step[0] += 1
                adam.step_(p, grad, m, v, step=step[0], out=out, **_ADAM_HYPER)

            run()   # warm-up: the format's work buffers
            rows[f"{master}/{moments}"] = {"params_per_s": numel / _best_s(run, repeats)}
    finally:
        adam.close()
    return rows

