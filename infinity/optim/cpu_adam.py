"""AdamW over flat fp32 shards on the CPU, with the low-precision copy-back fused in.

An offloaded optimizer step is memory-bound: it streams the fp32 master, the two
moments and the gradient once, and must also produce the compute-precision copy
of the parameter that goes back to the parameter's home tier. Done the obvious
way (``torch.optim.AdamW(fused=True)`` then ``out.copy_(param)``) that copy is a
second full pass over memory. Here the shard is cut into cache-sized chunks;
each worker thread runs torch's fused AdamW kernel on a chunk and converts the
same chunk while it is still in cache. The chunks are independent elementwise
work, so the result is bitwise the one torch's fused kernel gives on the whole
tensor.

Trade-off of ``chunk_numel``: smaller chunks stay in cache for the copy-back
but pay a kernel launch each (~10 µs); 256K-1M fp32 elements measured best here
(``tools/bench_offload.py`` measures it).

Threads: torch's fused kernel already spreads each chunk over torch's intra-op
threads. Running our own worker threads on top of that oversubscribes the
cores (measured 0.87x of the baseline on 2 cores), so the worker pool is used
only when torch runs single-threaded (``torch.get_num_threads() == 1``, as in
ranks that share a machine); otherwise chunks run in order on the caller's
thread and torch parallelizes inside each.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.optim import native
from infinity.optim.moment_codes import BLOCK, ROW_BYTES, decode_, dither, dither_offset, dither_table, encode_
from infinity.optim.split_master import join_bf16_, round_bf16_, split_bf16_

__all__ = ["CpuAdamW", "adamw_", "device_adamw_", "device_adamw_blocks_", "uses_fused_adamw", "default_adam_threads",
           "write_param_"]

_HAS_FUSED = hasattr(torch, "_fused_adamw_")
# The fused kernel runs vector lanes over the body of a tensor and scalar code
# over its tail, and the two round differently (FMA). Starting every chunk on a
# multiple of this keeps the vector/scalar split where a whole-tensor call puts
# it, so chunked results stay bitwise equal to it.
_CHUNK_ALIGN_NUMEL = 64
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)   # optimizer.moments: fp32 | bf16
# Chunk of a step that converts (bf16 rounding, a split master, bf16 moments), and so the size of each
# thread's kept fp32/int32 work buffers (up to 4, 1 MiB each): a multiple of _CHUNK_ALIGN_NUMEL, so
# results stay bitwise those of any chunking
_WORK_CHUNK_NUMEL = 256 * 1024


def default_adam_threads(local_ranks: int = 1) -> int:
    """Cores available to this process divided among the ranks on this machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


class CpuAdamW:
    """Decoupled-weight-decay Adam on flat fp32 tensors, multi-threaded.

    ``step_`` updates ``param``, ``exp_avg`` and ``exp_avg_sq`` in place, exactly
    like ``torch.optim.AdamW`` with ``fused=True`` (the same kernel), and writes
    ``param`` converted to ``out.dtype`` into ``out`` when given (bf16: rounded by
    :func:`~infinity.optim.split_master.round_bf16_`, the rounding every master format shares).

    A split master (``optimizer.master: remainder``): ``param`` is the int16 remainder and ``out`` the
    bf16 parameter, read as well as written. Each chunk's fp32 master is joined from the two, updated,
    and split back while in cache: bitwise the update of the fp32 master it represents.

    bf16 moments (``optimizer.moments: bf16``): ``exp_avg`` / ``exp_avg_sq`` may be bf16; each chunk is
    widened to fp32, updated by the same kernel and rounded back to nearest (even) while in cache.

    int8 moments (``optimizer.moments: int8``, :mod:`~infinity.optim.moment_codes`): :meth:`step_segments_`
    updates a whole job, every param group's range of it, by the compiled one-pass kernel
    (:mod:`~infinity.optim.native`) where it can be built, else in torch ops decoding each work chunk's
    blocks once.
    """

    def __init__(self, threads: int | None = None, chunk_numel: int = 1024 * 1024):
        if chunk_numel <= 0:
            raise ValueError(f"chunk_numel must be > 0, got {chunk_numel}")
        self.threads = threads or default_adam_threads()
        self.chunk_numel = -(-chunk_numel // _CHUNK_ALIGN_NUMEL) * _CHUNK_ALIGN_NUMEL
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="infinity-adam") if self.threads > 1 else None
        self._buffers = threading.local()   # per thread: a chunk's work buffers (see _work)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def step_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        step: int,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        out: torch.Tensor | None = None,
        grad_scale: float = 1.0,
    ) -> None:
        """One AdamW update; ``step`` is the 1-based step count after this update.

        ``grad_scale`` multiplies the gradient as each chunk is read (fp16 unscaling, clipping), so a
        gradient that lives in a slower tier is never rewritten just to scale it; ``grad`` is not changed.
        int8 moments (uint8 rows of blocks) go to :meth:`step_segments_` as one segment.
        """
        if exp_avg.dtype == torch.uint8:
            hyper = dict(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            self.step_segments_(param, grad, exp_avg, exp_avg_sq, [(0, param.numel(), hyper)], out=out,
                                grad_scale=grad_scale)
            return
        numel = param.numel()
        self._check(param, grad, out, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t.dtype not in _MOMENT_DTYPES:
                raise ValueError(f"CpuAdamW: {name} must be fp32 or bf16, got {t.dtype}")
        if numel == 0:
            return
        hyper = _kernel_hyper(dict(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._run(self._update_range, self._split(numel, _CHUNK_ALIGN_NUMEL),
                  param, grad, exp_avg, exp_avg_sq, out, hyper, grad_scale)

    def step_segments_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        segments: list,
        *,
        out: torch.Tensor | None = None,
        grad_scale: float = 1.0,
        seed: int = 0,
        index: int = 0,
    ) -> None:
        """One AdamW update of a job whose moments are stored int8: ``exp_avg`` / ``exp_avg_sq`` are its
        ``(blocks, ROW_BYTES)`` uint8 rows, ``segments`` ``[(lo, hi, hyper), ...]`` the element ranges to
        update, each with its param group's ``hyper`` (``step, lr, betas, eps, weight_decay``, as
        :meth:`step_` takes them). One block may hold two groups' elements, so the job is updated whole:
        each work chunk's blocks are decoded to fp32 once, every segment in it updated by the fused
        kernel, and the chunk encoded back while in cache, rounding stochastically
        (:func:`~infinity.optim.moment_codes.dither` of ``seed``, the step and the element's ``index +
        i``: the same result however the job is cut into chunks and threads). Work chunks no segment
        touches (padding) are left as they are. ``param``, ``grad``, ``out`` and ``grad_scale`` are as in
        :meth:`step_`."""
        numel = param.numel()
        rows = (math.ceil(numel / BLOCK), ROW_BYTES)
        for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t.dtype != torch.uint8 or tuple(t.shape) != rows or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"CpuAdamW: int8 {name} must be contiguous CPU uint8 rows of shape {rows}, got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        self._check(param, grad, out)
        if not (numel and segments):
            return
        kinds = _native_kinds(param, grad, out)
        fn = native.kernel() if kinds is not None else None
        if fn is not None:
            self._native_blocks(fn, kinds, param, grad, exp_avg, exp_avg_sq, out, segments, grad_scale, seed, index)
            return
        segments = [(lo, hi, _kernel_hyper(h)) for lo, hi, h in segments]
        self._run(self._update_blocks, self._split(numel, BLOCK), param, grad, exp_avg, exp_avg_sq, out,
                  segments, grad_scale, (seed, segments[0][2]["step"], index))

    def _native_blocks(self, fn, kinds, param, grad, exp_avg, exp_avg_sq, out, segments, grad_scale, seed, index):
        """:meth:`step_segments_` by the compiled kernel (:mod:`~infinity.optim.native`; ``kinds``: its
        :func:`_native_kinds`): one call per thread's range of blocks, on the pool whatever torch's thread
        count (the kernel releases the GIL and runs single-threaded)."""
        param_kind, out_kind, grad_kind = kinds
        segments = sorted(segments, key=lambda seg: seg[0])
        bounds = torch.tensor([b for lo, hi, _ in segments for b in (lo, hi)], dtype=torch.int64)
        hyper = torch.tensor([_native_hyper(h) for _, _, h in segments], dtype=torch.float32)
        step = segments[0][2]["step"]
        table = dither_table()
        offsets = (dither_offset(seed, step, 0, index), dither_offset(seed, step, 1, index))
        pointers = (param.data_ptr(), param_kind, 0 if out is None else out.data_ptr(), out_kind,
                    grad.data_ptr(), grad_kind, float(grad_scale), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                    len(segments), bounds.data_ptr(), hyper.data_ptr(), table.data_ptr(), *offsets)

        def blocks(lo: int, hi: int) -> None:
            fn(lo // BLOCK, math.ceil(hi / BLOCK), *pointers)

        self._run(blocks, self._split(param.numel(), BLOCK), own_threads=True)

    def _run(self, work, ranges: list, *args, own_threads: bool = False) -> None:
        """``work(*args[:5], lo, hi, *args[5:])`` over each thread's range: on the pool when torch runs
        single-threaded or ``work`` uses no torch threads (``own_threads``), else in order on this thread
        (torch spreads each op over its own threads)."""
        head, tail = args[:5], args[5:]
        if self._pool is None or len(ranges) == 1 or (torch.get_num_threads() > 1 and not own_threads):
            for lo, hi in ranges:
                work(*head, lo, hi, *tail)
            return
        futures = [self._pool.submit(work, *head, lo, hi, *tail) for lo, hi in ranges]
        for f in futures:
            f.result()  # re-raises a worker's exception here

    def _split(self, numel: int, align: int) -> list[tuple[int, int]]:
        # One contiguous range per thread keeps each thread's stream sequential.
        per_thread = math.ceil(numel / self.threads / align) * align
        return [(lo, min(numel, lo + per_thread)) for lo in range(0, numel, per_thread)]

    @staticmethod
    def _check(param, grad, out, **moments) -> None:
        numel = param.numel()
        for name, t in (("grad", grad), *moments.items(), ("out", out)):
            if t is not None and (t.numel() != numel or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError(
                    f"CpuAdamW: {name} must be a contiguous CPU tensor of {numel} elements, "
                    f"got {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")
        if param.dtype == torch.int16 and (out is None or out.dtype != torch.bfloat16):
            raise ValueError("CpuAdamW: an int16 param is a split master's remainder; it needs its bf16 "
                             f"parameter as out, got {None if out is None else out.dtype}")
        if param.dtype not in (torch.float32, torch.int16):
            raise ValueError(f"CpuAdamW: param must be fp32 (or a split master's int16 remainder), got {param.dtype}")

    def _work(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """This thread's work buffer ``name`` of one work chunk, made on first use and kept: a fresh
        multi-MB tensor per call would page-fault its way in every step."""
        buffers = self._buffers.__dict__
        if name not in buffers:
            buffers[name] = torch.empty(min(self.chunk_numel, _WORK_CHUNK_NUMEL), dtype=dtype)
        return buffers[name]

    def _buffers_for(self, param, out) -> tuple:
        """This thread's fp32 work chunk for a split master and int32 one for bf16 rounding (None where
        not needed): reused chunk after chunk and step after step."""
        joined = self._work("joined", torch.float32) if param.dtype == torch.int16 else None
        scratch = self._work("scratch", torch.int32) if out is not None and out.dtype == torch.bfloat16 else None
        return joined, scratch

    def _update_range(self, param, grad, exp_avg, exp_avg_sq, out, lo, hi, hyper, grad_scale):
        joined, scratch = self._buffers_for(param, out)
        # fp32 working chunks of moments stored narrower (bf16)
        wide = [self._work(name, torch.float32) if t.dtype != torch.float32 else None
                for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))]
        converts = joined is not None or scratch is not None or wide != [None, None]
        stride = min(self.chunk_numel, _WORK_CHUNK_NUMEL) if converts else self.chunk_numel
        for s in range(lo, hi, stride):
            e = min(hi, s + stride)
            m, v = (t[s:e] if w is None else w[:e - s].copy_(t[s:e]) for t, w in zip((exp_avg, exp_avg_sq), wide))
            self._piece(param, grad, out, s, e, m, v, hyper, grad_scale, joined, scratch)
            for t, w, wide_chunk in ((exp_avg, wide[0], m), (exp_avg_sq, wide[1], v)):
                if w is not None:
                    t[s:e].copy_(wide_chunk)   # bf16 moments: round to nearest even

    def _update_blocks(self, param, grad, exp_avg, exp_avg_sq, out, lo, hi, segments, grad_scale, where):
        """:meth:`step_segments_` over elements ``[lo, hi)`` (``lo`` a multiple of BLOCK); ``where``:
        ``(seed, step, index)`` of the stochastic rounding."""
        joined, scratch = self._buffers_for(param, out)
        m_work, v_work = self._work("exp_avg", torch.float32), self._work("exp_avg_sq", torch.float32)
        stride = max(BLOCK, min(self.chunk_numel, _WORK_CHUNK_NUMEL) // BLOCK * BLOCK)
        seed, step, index = where
        for s in range(lo, hi, stride):
            e = min(hi, s + stride)
            pieces = [(max(a, s), min(b, e), hyper) for a, b, hyper in segments if max(a, s) < min(b, e)]
            if not pieces:
                continue
            blocks = slice(s // BLOCK, math.ceil(e / BLOCK))
            m = decode_(exp_avg[blocks], m_work, squared=False)
            v = decode_(exp_avg_sq[blocks], v_work, squared=True)
            for a, b, hyper in pieces:
                self._piece(param, grad, out, a, b, m[a - s:b - s], v[a - s:b - s], hyper, grad_scale,
                            joined, scratch)
            encode_(m, exp_avg[blocks], root=False, dither=dither(seed, step, 0, index + s, m.numel()))
            encode_(v, exp_avg_sq[blocks], root=True, dither=dither(seed, step, 1, index + s, v.numel()))

    @staticmethod
    def _piece(param, grad, out, s, e, m, v, hyper, grad_scale, joined, scratch) -> None:
        """The fused kernel on elements ``[s, e)`` with their fp32 moments ``m``, ``v``: the fp32 master
        joined from a split one first and split back after, the parameter written to ``out``."""
        split = param.dtype == torch.int16
        p = join_bf16_(out[s:e], param[s:e], joined[:e - s]) if split else param[s:e]
        g = grad[s:e]
        if g.dtype != torch.float32:
            g = g.float()  # reduce dtype may be bf16/fp16; upcast the chunk while it is in cache
        if grad_scale != 1.0:
            g = g * grad_scale   # a new chunk: the caller's gradient stays as it was
        _adamw_chunk(p, g, m, v, **hyper)
        work = scratch[:e - s] if scratch is not None else None
        if split:
            split_bf16_(p, out[s:e], param[s:e], work)
        elif out is not None:
            write_param_(p, out[s:e], work)


def _native_kinds(param, grad, out) -> tuple | None:
    """``(param, out, grad)`` kind codes of the compiled int8 kernel (``adamw_int8.c``'s enums), or None
    for what only the torch path handles (an fp16 gradient or parameter copy)."""
    grad_kind = {torch.float32: 0, torch.bfloat16: 1}.get(grad.dtype)
    out_kind = {None: 0, torch.bfloat16: 1, torch.float32: 2}.get(None if out is None else out.dtype)
    if grad_kind is None or out_kind is None:
        return None
    return (1 if param.dtype == torch.int16 else 0), out_kind, grad_kind


def _native_hyper(h: dict) -> list:
    """A param group's hyper-parameters as the compiled kernel takes them (``adamw_int8.c``'s ``H_*``):
    the weight-decay factor, the first moment's lerp weight, beta2, 1 - beta2, the square root of the
    second bias correction, eps, and the step size (lr over the first bias correction)."""
    beta1, beta2 = h["betas"]
    step = h["step"]
    return [1 - h["lr"] * h["weight_decay"], 1 - beta1, beta2, 1 - beta2, (1 - beta2 ** step) ** 0.5, h["eps"],
            h["lr"] / (1 - beta1 ** step)]


def _kernel_hyper(h: dict) -> dict:
    """The kernel's keywords from a param group's hyper-parameters (``betas`` split in two)."""
    return dict(step=h["step"], lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"],
                weight_decay=h["weight_decay"])


def write_param_(master: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` = the fp32 ``master`` in ``out``'s dtype: bf16 by :func:`round_bf16_` (the rounding a split
    master can invert, shared by every master format; ``scratch`` its int32 work buffer), other dtypes by
    torch's conversion; returns ``out``."""
    if out.dtype == torch.bfloat16:
        return round_bf16_(master, out, scratch)
    return out.copy_(master)


def _adamw_chunk(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay) -> None:
    if _HAS_FUSED:
        _fused_adamw(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        return
    adamw_(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


def uses_fused_adamw(device: torch.device | str) -> bool:
    """Whether :func:`device_adamw_` updates states on ``device`` with torch's fused AdamW kernel: on
    CUDA (one kernel for the whole update instead of about ten elementwise ones, each a pass over the
    states), where torch has it; on any other device the plain ops of :func:`adamw_`."""
    return torch.device(device).type == "cuda" and _HAS_FUSED


def device_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of optimizer states kept in device memory, in place: torch's fused kernel
    where :func:`uses_fused_adamw` says so (then bitwise ``torch.optim.AdamW(fused=True)``), else
    :func:`adamw_`. ``step`` is the 1-based count after this update."""
    if uses_fused_adamw(param.device):
        _fused_adamw(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=weight_decay)
        return
    adamw_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay)


def device_adamw_blocks_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         segments: list, *, out: torch.Tensor | None = None, grad_scale: float = 1.0, seed: int = 0,
                         index: int = 0) -> None:
    """:meth:`CpuAdamW.step_segments_` for int8 moments kept in device memory, on any device: the job's
    moments decoded whole, each segment updated by :func:`device_adamw_`, encoded back with the same
    stochastic rounding (so only the kernel's last bits differ from the CPU path's). ``param`` is fp32,
    or a split master's int16 remainder beside its bf16 parameter ``out``."""
    if not segments:
        return
    dev, n = param.device, param.numel()
    rows = exp_avg.shape[0] * BLOCK
    m = decode_(exp_avg, torch.empty(rows, dtype=torch.float32, device=dev), squared=False)
    v = decode_(exp_avg_sq, torch.empty(rows, dtype=torch.float32, device=dev), squared=True)
    split = param.dtype == torch.int16
    master = join_bf16_(out, param, torch.empty(n, dtype=torch.float32, device=dev)) if split else param
    for lo, hi, h in segments:
        device_adamw_(master[lo:hi], grad[lo:hi].float() * grad_scale, m[lo:hi], v[lo:hi], **_kernel_hyper(h))
    step = segments[0][2]["step"]
    encode_(m, exp_avg, root=False, dither=dither(seed, step, 0, index, rows, dev))
    encode_(v, exp_avg_sq, root=True, dither=dither(seed, step, 1, index, rows, dev))
    if split:
        split_bf16_(master, out, param)
    elif out is not None:
        write_param_(master, out)


def _fused_adamw(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay) -> None:
    # The step count lives on the states' device, as torch.optim.AdamW(fused=True) keeps it, and is made
    # there by a fill (no host->device copy); the kernel expects it already incremented.
    step_t = torch.full((), float(step), dtype=torch.float32, device=p.device)
    torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
           step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update in place on flat fp32 tensors (any device); the same ops as torch's
    ``_single_tensor_adam``, so bitwise equal to ``torch.optim.AdamW``'s default path. The project's
    one copy of the math: CPU Adam's fallback where torch has no fused kernel, and the update of
    optimizer states kept in memory of a device without one (:func:`device_adamw_`). ``step`` is the
    1-based count after this update."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
