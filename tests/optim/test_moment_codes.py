"""int8 moments (``optimizer.moments: int8``): the 8-bit block code and CPU Adam's update through it."""

from __future__ import annotations

import pytest
import torch

from infinity.optim.cpu_adam import CpuAdamW
from infinity.optim.moment_codes import (BLOCK, FLAT_LAYOUT, MOMENT_FORMATS, ROW_BYTES, codes_of, decode_,
                                         decode_codes_, dither, encode_, moment_format, scales_of)

INT8 = MOMENT_FORMATS["int8"]
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _encoded(x: torch.Tensor, root: bool = False) -> torch.Tensor:
    rows = torch.zeros(INT8.shape(x.numel()), dtype=torch.uint8)
    return encode_(x.clone(), rows, root)


def _decoded(rows: torch.Tensor, squared: bool = False) -> torch.Tensor:
    return decode_(rows, torch.empty(rows.shape[0] * BLOCK), squared).clone()


def test_every_code_decodes_to_its_fp8_value_times_the_scale():
    """All 256 byte patterns (both signs, subnormal codes, zero) under scales from 2**-100 to 2**126 read
    back as torch's own float8_e4m3fn value times the scale, exactly, the largest scales included (where
    the decode's gain overflows fp32 and takes two exact steps); but NaN patterns, which read as 480."""
    codes = torch.arange(256, dtype=torch.uint8).view(1, BLOCK).repeat(5, 1)
    scales = torch.tensor([[2.0 ** -100], [2.0 ** -7], [1.0], [2.0 ** 40], [2.0 ** 126]])
    got = decode_codes_(codes, scales, torch.empty(codes.numel()), squared=False).view(5, BLOCK)
    want = codes.view(torch.float8_e4m3fn).float() * scales
    finite = ~torch.isnan(want)
    assert finite.sum() == 5 * 254   # 0x7F and 0xFF are e4m3fn's NaNs
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[~finite].abs(), (480 * scales).expand(5, 2).reshape(-1))


def test_the_scale_is_a_power_of_two_and_decoding_again_changes_nothing():
    """Each block's scale is the power of two putting its largest magnitude in (224, 448] (down to 2**-100);
    decoded values
    encode to the same values (a checkpoint round trip is exact); a zero block is zeros with scale 1."""
    torch.manual_seed(0)
    x = torch.randn(8 * BLOCK) * torch.logspace(-6, 0, 8 * BLOCK)[torch.randperm(8 * BLOCK)]
    x[:BLOCK] = 0
    x[BLOCK:2 * BLOCK] *= 1e-33    # decayed far below 1e-28: flushed, not overflowed
    x[2 * BLOCK:3 * BLOCK] *= 1e33
    x[3 * BLOCK:4 * BLOCK] = 448.0 * 4   # every value at the top of its block
    rows = _encoded(x)
    scales = scales_of(rows).view(-1)
    assert torch.equal(torch.frexp(scales).mantissa, torch.full_like(scales, 0.5))
    top = codes_of(rows).float().abs().amax(dim=1)
    assert scales[0] == 1 and top[0] == 0 and (_decoded(rows)[:BLOCK] == 0).all()
    # (224, 448] before rounding, so [224, 448] after; the decayed block is coded against 2**-100 instead
    assert ((top[2:] >= 224) & (top[2:] <= 448)).all() and scales[1] == 2.0 ** -100
    values = _decoded(rows)
    assert torch.isfinite(values).all()
    assert torch.equal(_decoded(_encoded(values)), values)
    assert torch.equal(values[3 * BLOCK:4 * BLOCK], x[3 * BLOCK:4 * BLOCK])


def test_the_rounding_error_is_one_sixteenth_at_most_and_small_values_stay_nonzero():
    """A value within 2**-6 * 224 of its block's largest is read back within 1/16 relative (3 mantissa
    bits, round to nearest). The second moment is coded as its square root, so a v 1e-9 of its
    block's largest reads back nonzero, where coding v itself loses it."""
    torch.manual_seed(1)
    x = torch.randn(16 * BLOCK)
    back = _decoded(_encoded(x))
    top = x.view(-1, BLOCK).abs().amax(dim=1, keepdim=True)
    normal = (x.view(-1, BLOCK).abs() >= top * 2 ** -6 / 2).view(-1)
    assert ((back - x).abs()[normal] <= x.abs()[normal] / 16).all()
    assert torch.equal(back.sign()[normal], x.sign()[normal])
    v = torch.full((BLOCK,), 1.0)
    v[1:] = 1e-9
    assert (_decoded(_encoded(v, root=True), squared=True) > 0).all()
    assert (_decoded(_encoded(v))[1:] == 0).all()


def test_stochastic_rounding_is_unbiased_and_keeps_what_is_exact():
    """With a dither, a value between two codes is rounded up with the probability of its distance from
    the lower one (the mean of many roundings is the value), an exact code stays itself, and the dither
    of an element is the same however its moment is cut (``index`` counts from the same origin)."""
    n = 64 * BLOCK
    x = torch.full((n,), 1.3)
    x[::BLOCK] = 448.0 / 224 * 1.3   # each block's largest: the scale puts 1.3 between 1.25 and 1.375
    rounded = _decoded(encode_(x.clone(), torch.zeros(INT8.shape(n), dtype=torch.uint8), False,
                               dither(3, 1, 0, 0, n)))
    body = torch.ones(n, dtype=torch.bool)
    body[::BLOCK] = False
    assert set(rounded[body].unique().tolist()) == {1.25, 1.375}
    assert abs(rounded[body].mean().item() - 1.3) < 0.004   # 16320 Bernoulli(0.4) draws: sd 0.0005
    exact = _decoded(_encoded(torch.randn(n)))
    assert torch.equal(_decoded(encode_(exact.clone(), torch.zeros_like(_encoded(exact)), False,
                                        dither(3, 2, 1, 0, n))), exact)
    whole = dither(5, 9, 1, 1000, 3000)
    assert torch.equal(torch.cat([dither(5, 9, 1, 1000, 1000), dither(5, 9, 1, 2000, 2000)]), whole)
    assert not torch.equal(dither(5, 10, 1, 1000, 3000), whole) and not torch.equal(dither(6, 9, 1, 1000, 3000), whole)
    assert int(whole.min()) >= 0 and int(whole.max()) < 2 ** 20


def test_the_layout_counts_rows_of_blocks():
    """int8 stores ceil(n / 256) rows of 260 bytes (65/64 B per element for whole blocks) and is read in
    whole blocks; the other formats are flat."""
    assert INT8.shape(1024) == (4, ROW_BYTES) and INT8.shape(1025) == (5, ROW_BYTES)
    assert INT8.nbytes(1024) == 1040 == 1024 * INT8.itemsize
    assert MOMENT_FORMATS["bf16"].nbytes(1024) == 2048 and FLAT_LAYOUT.shape(7) == (7,)
    rows = torch.arange(4 * ROW_BYTES, dtype=torch.int32).view(4, ROW_BYTES)
    assert torch.equal(INT8.rows(rows, 512, 1024), rows[2:4])
    with pytest.raises(ValueError, match="whole blocks of 256"):
        INT8.rows(rows, 100, 1024)
    with pytest.raises(ValueError, match=r"optimizer.moments must be one of \['fp32', 'bf16', 'int8'\]"):
        moment_format("int4")


@pytest.mark.parametrize("master", ("fp32", "remainder"))
def test_an_int8_update_is_the_fp32_kernel_between_a_decode_and_an_encode(master, monkeypatch):
    """CpuAdamW's torch path for int8 moments (where the compiled kernel cannot be built; the kernel is
    checked against this path in test_native_adamw.py): every segment (param group) of a job, two of
    them sharing a block, is updated by the fp32 kernel from the decoded moments and the result encoded
    with the stochastic
    rounding of the job's elements (unit seed, step, element index): bitwise what a reference doing that
    by hand on the whole job gives, at 1 and 2 threads and any work-chunk size; elements in no segment
    keep their parameter and moments. With a split master the bf16 parameter is read and written."""
    from infinity.optim import native
    from infinity.optim.split_master import join_bf16_

    monkeypatch.setattr(native, "kernel", lambda: None)
    numel, steps = 3 * 4096 + 2 * BLOCK, 4
    torch.manual_seed(2)
    master32 = torch.randn(numel)
    grads = [torch.randn(numel) * torch.linspace(1e-4, 1, numel) for _ in range(steps)]
    # a group boundary inside a block, and a tail of padding no group covers
    cuts = [(0, 5056, 0.1), (5056, numel - 320, 0.0)]

    def run(threads: int, chunk_numel: int):
        param, m, v, out = _initial_states(master32, master)
        adam = CpuAdamW(threads=threads, chunk_numel=chunk_numel)
        for step, g in enumerate(grads, start=1):
            segments = [(lo, hi, dict(HYPER, step=step, weight_decay=wd)) for lo, hi, wd in cuts]
            adam.step_segments_(param, g, m, v, segments, out=out, seed=7, index=4096)
        adam.close()
        fp32 = join_bf16_(out, param, torch.empty(numel)) if master == "remainder" else param
        return fp32, m, v, out

    # the reference: decode, run each segment through the fp32 path, encode
    ref_p, ref_m, ref_v, ref_out = _initial_states(master32, master)
    plain = CpuAdamW(threads=1)
    for step, g in enumerate(grads, start=1):
        m, v = _decoded(ref_m)[:numel].clone(), _decoded(ref_v, squared=True)[:numel].clone()
        for lo, hi, wd in cuts:
            plain.step_(ref_p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step=step, out=ref_out[lo:hi],
                        **dict(HYPER, weight_decay=wd))
        pad = torch.zeros(ref_m.shape[0] * BLOCK)
        encode_(torch.cat([m, pad[numel:]]), ref_m, root=False, dither=dither(7, step, 0, 4096, pad.numel()))
        encode_(torch.cat([v, pad[numel:]]), ref_v, root=True, dither=dither(7, step, 1, 4096, pad.numel()))
    ref32 = join_bf16_(ref_out, ref_p, torch.empty(numel)) if master == "remainder" else ref_p

    results = [run(threads, chunk) for threads, chunk in ((1, 1 << 20), (2, 4096), (2, 1 << 20))]
    for fp32, m, v, out in results:
        assert torch.equal(fp32, ref32) and torch.equal(m, ref_m) and torch.equal(v, ref_v)
        assert torch.equal(out, ref_out)
    assert torch.equal(results[0][0][numel - 320:], master32[numel - 320:])   # padding untouched
    assert (_decoded(results[0][1])[numel - 320:] == 0).all()
    # and it trains like fp32 moments: after 4 steps the masters differ by a few % of how far they moved
    p32, m32, v32 = master32.clone(), torch.zeros(numel), torch.zeros(numel)
    for step, g in enumerate(grads, start=1):
        for lo, hi, wd in cuts:
            plain.step_(p32[lo:hi], g[lo:hi], m32[lo:hi], v32[lo:hi], step=step, **dict(HYPER, weight_decay=wd))
    assert (results[0][0] - p32).norm() <= 0.03 * (p32 - master32).norm()
    plain.close()


def _initial_states(master32: torch.Tensor, master: str) -> tuple:
    """``(param, exp_avg, exp_avg_sq, out)`` for a job starting from ``master32``: the fp32 master, or its
    remainder beside the bf16 parameter; zeroed int8 moments."""
    from infinity.optim.split_master import split_bf16_

    numel = master32.numel()
    out = master32.to(torch.bfloat16)
    param = master32.clone()
    if master == "remainder":
        param = torch.empty(numel, dtype=torch.int16)
        split_bf16_(master32, out, param)
    return (param, torch.zeros(INT8.shape(numel), dtype=torch.uint8), torch.zeros(INT8.shape(numel), dtype=torch.uint8),
            out)


def test_int8_moments_are_refused_in_a_wrong_shape():
    adam = CpuAdamW(threads=1)
    with pytest.raises(ValueError, match=r"int8 exp_avg must be contiguous CPU uint8 rows of shape \(4, 260\)"):
        adam.step_segments_(torch.zeros(1024), torch.zeros(1024), torch.zeros(1024, dtype=torch.uint8),
                            torch.zeros(4, ROW_BYTES, dtype=torch.uint8), [(0, 1024, dict(HYPER, step=1))])
    adam.close()


@pytest.mark.parametrize("master", ("fp32", "remainder"))
def test_the_device_path_of_int8_moments_matches_the_cpu_path(master, monkeypatch):
    """int8 moments kept in device memory (CUDA) are updated by :func:`device_adamw_blocks_`: the whole job
    decoded, each segment updated by the device kernel, encoded with the same stochastic rounding. Run here
    on CPU tensors, it matches CpuAdamW's chunked torch path (the one of the same torch ops; the compiled
    kernel is held to that path in test_native_adamw.py): the same moments' codes but where the two
    kernels' last bits round a code the other way, masters within 1e-6 relative of each other's step."""
    from infinity.optim import native
    from infinity.optim.cpu_adam import device_adamw_blocks_
    from infinity.optim.split_master import join_bf16_

    monkeypatch.setattr(native, "kernel", lambda: None)

    numel = 2 * 4096 + BLOCK
    torch.manual_seed(3)
    master32 = torch.randn(numel)
    cuts = [(0, 3000, 0.1), (3000, numel - BLOCK, 0.0)]
    states = [_initial_states(master32, master) for _ in range(2)]
    adam = CpuAdamW(threads=1, chunk_numel=4096)
    for step in range(1, 4):
        g = torch.randn(numel)
        segments = [(lo, hi, dict(HYPER, step=step, weight_decay=wd)) for lo, hi, wd in cuts]
        p, m, v, out = states[0]
        adam.step_segments_(p, g, m, v, segments, out=out, grad_scale=0.5, seed=2, index=8192)
        p, m, v, out = states[1]
        device_adamw_blocks_(p, g, m, v, segments, out=out, grad_scale=0.5, seed=2, index=8192)
    adam.close()
    (p1, m1, v1, o1), (p2, m2, v2, o2) = states
    if master == "remainder":
        p1, p2 = join_bf16_(o1, p1, torch.empty(numel)), join_bf16_(o2, p2, torch.empty(numel))
    moved = (p1 - master32).abs().max()
    assert moved > 1e-3 and (p1 - p2).abs().max() <= 1e-6 * moved + 1e-7
    assert (m1 != m2).float().mean() < 0.01 and (v1 != v2).float().mean() < 0.01
    assert torch.equal(p2[numel - BLOCK:], master32[numel - BLOCK:])
