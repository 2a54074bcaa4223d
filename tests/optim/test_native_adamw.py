"""The compiled int8-moment AdamW step (``infinity/optim/native.py``, ``adamw_int8.c``) against the torch
path it replaces: the same codes, scales and parameters bitwise where the update's arithmetic is exact,
within the last bit of the Adam arithmetic otherwise; the same whatever the thread split; and a clear
fallback where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from infinity.native_build import LazyLibrary
from infinity.optim import native
from infinity.optim.cpu_adam import CpuAdamW
from infinity.optim.moment_codes import BLOCK, MOMENT_FORMATS, decode_, scales_of
from infinity.optim.split_master import join_bf16_, split_bf16_

INT8 = MOMENT_FORMATS["int8"]



@pytest.fixture
def compiled():
    """Skips where this machine cannot build the kernel (no C compiler), saying why."""
    if native.kernel() is None:
        pytest.skip(f"no compiled kernel: {native.native_reason()}")


def _states(master32: torch.Tensor, master: str) -> tuple:
    """``(param, exp_avg, exp_avg_sq, out)``: the fp32 master or its remainder beside the bf16 parameter,
    zeroed int8 moments."""
    numel = master32.numel()
    out = torch.empty(numel, dtype=torch.bfloat16)
    param = master32.clone()
    if master == "remainder":
        param = torch.empty(numel, dtype=torch.int16)
        split_bf16_(master32, out, param)
    else:
        out.copy_(master32)
    zeros = torch.zeros(INT8.shape(numel), dtype=torch.uint8)
    return param, zeros, zeros.clone(), out


def _run(states, grads, segments_of, *, native_on: bool, threads: int = 1, **kw) -> tuple:
    """Every step of ``grads`` through CpuAdamW.step_segments_, by the compiled kernel or the torch path."""
    param, m, v, out = (None if t is None else t.clone() for t in states)
    with pytest.MonkeyPatch.context() as mp:
        if not native_on:
            mp.setattr(native, "kernel", lambda: None)
        adam = CpuAdamW(threads=threads, chunk_numel=4096)
        for step, g in enumerate(grads, start=1):
            adam.step_segments_(param, g, m, v, segments_of(step), out=out, seed=5, index=12288, **kw)
        adam.close()
    return param, m, v, out


def _wide_grads(numel: int, steps: int, seed: int) -> list:
    """Gradients over 30 decades with random signs, a block of zeros, a block of huge values (its
    scale's decode gain overflows fp32), and subnormal-range blocks."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        g = torch.randn(numel, generator=gen) * 10.0 ** torch.empty(numel).uniform_(-15, 3, generator=gen)
        g[BLOCK:2 * BLOCK] = 0
        g[2 * BLOCK:3 * BLOCK] *= 1e30
        g[3 * BLOCK:4 * BLOCK] *= 1e-25
        grads.append(g)
    return grads


@pytest.mark.parametrize("master", ("fp32", "remainder"))
def test_codes_and_parameters_are_the_torch_paths_bits_where_the_update_is_exact(master, compiled):
    """With lr = 0 and betas (0, 0) each step sets the moments to g and g**2 exactly in both paths, so
    what is compared is the code alone: the scale of every block (zeros, huge, subnormal range), the
    stochastic rounding, the fp8 conversion, the re-encoding of decoded elements no segment updates
    (a group boundary and padding inside blocks), and the bf16 parameter / remainder written back
    (master ties included)."""
    numel = 4096 + 3 * BLOCK + 77
    master32 = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    ties = master32[:64].view(torch.int32)
    ties.copy_((ties & ~0xFFFF) | 0x8000)   # exact bf16 ties: the rounding goes away from zero
    hyper = dict(lr=0.0, betas=(0.0, 0.0), eps=1e-8, weight_decay=0.0)

    def segments(step):   # step 1 covers everything; later steps only parts of blocks
        if step == 1:
            return [(0, numel, dict(hyper, step=1))]
        return [(100, 1000, dict(hyper, step=step)), (1000 + 64 * step, numel - 300, dict(hyper, step=step))]

    states = _states(master32, master)
    grads = _wide_grads(numel, 3, seed=2)
    ours = _run(states, grads, segments, native_on=True)
    theirs = _run(states, grads, segments, native_on=False)
    for a, b, name in zip(ours, theirs, ("param", "exp_avg", "exp_avg_sq", "out")):
        assert torch.equal(a, b), name
    assert torch.isinf(scales_of(ours[1]) * 2.0 ** 120).any()   # the two-step decode was exercised
    # ... and it is the code it claims: decoded, the last step's first moment is g within one step of the
    # 3-bit mantissa (stochastic rounding) wherever g is within 1e-4 of its block's largest
    m = decode_(ours[1], torch.empty(ours[1].shape[0] * BLOCK), squared=False)
    lo, hi = 5 * BLOCK, numel - 300 - (numel - 300) % BLOCK   # whole blocks of the last step's segment
    g = grads[-1][lo:hi].view(-1, BLOCK)
    kept = g.abs() >= 1e-4 * g.abs().amax(dim=1, keepdim=True)
    assert kept.float().mean() > 0.1
    assert ((m[lo:hi].view(-1, BLOCK) - g).abs() <= g.abs() / 8)[kept].all()


@pytest.mark.parametrize("master,grad_dtype,out_dtype", [
    ("fp32", torch.float32, torch.bfloat16), ("fp32", torch.bfloat16, None), ("fp32", torch.float32, torch.float32),
    ("remainder", torch.bfloat16, torch.bfloat16)])
def test_a_real_update_matches_the_torch_path_within_the_last_bit(master, grad_dtype, out_dtype, compiled):
    """Real hyper-parameters over several steps, two param groups sharing a block, a gradient scale, any
    parameter copy and gradient dtype the engine uses: the masters within 1e-6 of how far they moved,
    fewer than 1% of the codes different (where the kernels' last bits round a code the other way), and
    most masters bitwise equal."""
    numel = 3 * 4096 + BLOCK
    master32 = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    grads = [(torch.randn(numel, generator=gen) * torch.linspace(1e-4, 1, numel)).to(grad_dtype) for _ in range(5)]

    def segments(step):
        return [(0, 5000, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=step)),
                (5000, numel - BLOCK, dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, step=step))]

    param, m, v, out = _states(master32, master)
    out = None if out_dtype is None else out.to(out_dtype)
    results = [_run((param, m, v, out), grads, segments, native_on=on, grad_scale=0.5) for on in (True, False)]
    masters = [join_bf16_(r[3], r[0], torch.empty(numel)) if master == "remainder" else r[0] for r in results]
    moved = (masters[1] - master32).abs().max()
    differ = masters[0] != masters[1]
    assert moved > 1e-3 and differ.float().mean() < 0.05
    assert ((masters[0] - masters[1]).abs() <= 1e-6 * (masters[1].abs() + moved))[differ].all()
    for i in (1, 2):
        assert (results[0][i] != results[1][i]).float().mean() < 0.01
    assert torch.equal(masters[0][numel - BLOCK:], master32[numel - BLOCK:])   # padding untouched
    if out_dtype is not None:
        assert (results[0][3].float() - masters[0]).abs().max() <= masters[0].abs().max() / 128


def test_the_result_does_not_depend_on_the_thread_split(compiled):
    numel = 5 * 4096 + 3 * BLOCK
    master32 = torch.randn(numel, generator=torch.Generator().manual_seed(6))
    grads = _wide_grads(numel, 3, seed=7)

    def segments(step):
        return [(0, 7000, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=step)),
                (7000, numel, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=step))]

    states = _states(master32, "remainder")
    one = _run(states, grads, segments, native_on=True, threads=1)
    for threads in (2, 3):
        for a, b in zip(one, _run(states, grads, segments, native_on=True, threads=threads)):
            assert torch.equal(a, b)


def test_an_fp16_gradient_takes_the_torch_path(monkeypatch):
    called = []
    monkeypatch.setattr(native, "kernel", lambda: called.append(1) or None)
    numel = 4096
    param, m, v, out = _states(torch.randn(numel), "fp32")
    adam = CpuAdamW(threads=1)
    adam.step_segments_(param, torch.randn(numel).half(), m, v,
                        [(0, numel, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1))], out=out)
    adam.close()
    assert not called and decode_(m, torch.empty(numel), squared=False).abs().max() > 0


def test_without_a_compiler_the_reason_is_said_once_and_the_torch_path_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("INFINITY_CACHE", str(tmp_path / "infinity"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_KERNEL", LazyLibrary(native._load, native._say_torch_path))
    with caplog.at_level(logging.WARNING, logger="infinity.optim.native"):
        assert native.kernel() is None and native.kernel() is None
    assert native.native_reason() == f"no C compiler {str(tmp_path / 'no-such-cc')!r} (set CC)"
    assert len(caplog.records) == 1 and "torch path" in caplog.records[0].getMessage()
    monkeypatch.setattr(native, "_KERNEL", LazyLibrary(native._load, native._say_torch_path))
    monkeypatch.setenv("CC", "false")   # a compiler that fails
    assert native.kernel() is None and native.native_reason().startswith("false failed to build adamw_int8.c")
    assert list(tmp_path.glob("infinity/*")) == []   # no half-written library left behind
    monkeypatch.setattr(native, "_KERNEL", LazyLibrary(native._load, native._say_torch_path))
    monkeypatch.setenv("INFINITY_NATIVE", "0")
    assert native.kernel() is None and native.native_reason() == "INFINITY_NATIVE=0"


def test_a_fresh_cache_builds_the_library_once_and_reuses_it(monkeypatch, tmp_path, compiled):
    monkeypatch.setenv("INFINITY_CACHE", str(tmp_path / "infinity"))
    monkeypatch.setattr(native, "_KERNEL", LazyLibrary(native._load, native._say_torch_path))
    assert native.kernel() is not None
    built = list((tmp_path / "infinity").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_KERNEL", LazyLibrary(native._load, native._say_torch_path))
    assert native.kernel() is not None and built[0].stat().st_mtime_ns == stamp


def test_an_unusable_cache_directory_is_named_and_the_torch_path_runs(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("INFINITY_CACHE", str(blocker / "infinity"))
    monkeypatch.setattr(native, "_KERNEL", LazyLibrary(native._load, native._say_torch_path))
    assert native.kernel() is None
    assert native.native_reason().startswith(f"cannot build adamw_int8.c in {blocker / 'infinity'}: ")


def test_a_damaged_cached_library_is_built_again(monkeypatch, tmp_path, compiled):
    """A cache holding a truncated build under the kernel's name (in a directory this process never loaded
    from: a loaded library must not be rewritten in place) is rebuilt and loads."""
    monkeypatch.setenv("INFINITY_CACHE", str(tmp_path / "good"))
    monkeypatch.setattr(native, "_KERNEL", LazyLibrary(native._load, native._say_torch_path))
    assert native.kernel() is not None
    (good,) = (tmp_path / "good").iterdir()
    damaged = tmp_path / "damaged" / good.name
    damaged.parent.mkdir()
    damaged.write_bytes(good.read_bytes()[:100])   # truncated, as a full disk would leave it
    monkeypatch.setenv("INFINITY_CACHE", str(damaged.parent))
    monkeypatch.setattr(native, "_KERNEL", LazyLibrary(native._load, native._say_torch_path))
    assert native.kernel() is not None and native.native_reason() is None
    assert damaged.stat().st_size > 100   # the rebuilt library, not the truncated one
