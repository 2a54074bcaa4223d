"""The split master: an fp32 master as a bf16 parameter plus an int16 remainder, exactly.

Every fp32 bit pattern class is covered: all 65536 high halves (every sign, exponent, subnormal,
inf and NaN) with the low halves around the rounding boundary (0, 1, 0x7FFF, the tie 0x8000,
0x8001, 0xFFFF, ...), plus a million random patterns.
"""

import pytest
import torch

from infinity.optim.cpu_adam import CpuAdamW
from infinity.optim.split_master import join_bf16_, remainder_of, round_bf16_, split_bf16_

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _patterns() -> torch.Tensor:
    highs = torch.arange(-32768, 32768, dtype=torch.int32)
    lows = torch.tensor([0, 1, 0x1234, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFE, 0xFFFF], dtype=torch.int32)
    edges = (highs[:, None] * 65536 + lows[None, :]).reshape(-1)
    rand = torch.randint(-2**31, 2**31 - 1, (1_000_000,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int64).to(torch.int32)
    return torch.cat([edges, rand])


def _split(master):
    param = torch.empty(master.shape, dtype=torch.bfloat16)
    remainder = torch.empty(master.shape, dtype=torch.int16)
    split_bf16_(master, param, remainder)
    return param, remainder


def test_join_gives_every_non_nan_master_back_bit_for_bit():
    bits = _patterns()
    master = bits.view(torch.float32)
    param, remainder = _split(master)
    back = join_bf16_(param, remainder, torch.empty_like(master))
    nan = torch.isnan(master)
    assert torch.equal(back.view(torch.int32)[~nan], bits[~nan])
    # a NaN stays a NaN in the parameter and in the joined master (its low payload bits are not kept)
    assert torch.isnan(param[nan].float()).all() and torch.isnan(back[nan]).all()
    assert torch.equal(remainder, remainder_of(master))
    assert torch.equal(param.view(torch.int16), round_bf16_(master, torch.empty_like(param)).view(torch.int16))


def test_the_parameter_is_the_nearest_bf16_and_differs_from_torch_only_on_ties():
    """Round to nearest, ties away from zero: torch's round-to-nearest-even agrees except where the
    low half is exactly 0x8000 (65537 fp32 values round to an even bf16 under RNE: 16 bits cannot
    tell them apart, which is why the split rounds ties away)."""
    bits = _patterns()
    master = bits.view(torch.float32)
    param, _ = _split(master)
    rne = master.to(torch.bfloat16)
    nan = torch.isnan(master)
    differ = (param.view(torch.int16) != rne.view(torch.int16)) & ~nan
    tie = (bits & 0xFFFF) == 0x8000
    assert differ.any() and not (differ & ~tie).any()
    # ties: the one away from zero
    assert (param.float()[differ].abs() > master[differ].abs()).all()
    # the largest finite values round to inf as torch's do; infs are kept
    for value in (float("inf"), -float("inf"), 3.4028235e38, -3.4028235e38, 0.0, -0.0, 1e-45, -1e-45):
        m = torch.tensor([value])
        assert torch.equal(_split(m)[0].view(torch.int16), m.to(torch.bfloat16).view(torch.int16)), value


def test_remainder_fits_int16_and_sign_and_exponent_crossings_are_exact():
    """Values whose rounding carries into the exponent (1.9999 -> 2.0) and negative ones join back exactly."""
    master = torch.tensor([1.99999, -1.99999, 1.0 - 2**-24, 2.0**-126 * (1 - 2**-20), -(2.0**-140), 65504.0,
                           torch.finfo(torch.float32).tiny, -torch.finfo(torch.float32).max])
    param, remainder = _split(master)
    assert torch.equal(join_bf16_(param, remainder, torch.empty_like(master)), master)
    assert param[0].item() == 2.0 and param[1].item() == -2.0


@pytest.mark.parametrize("threads, chunk", [(1, 256 * 1024), (2, 64), (3, 1000)])
def test_cpu_adam_on_a_split_master_is_bitwise_the_fp32_masters_update(threads, chunk):
    numel = 10_000
    torch.manual_seed(0)
    master = torch.randn(numel)
    grads = [torch.randn(numel) for _ in range(4)]
    adam = CpuAdamW(threads=threads, chunk_numel=chunk)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)   # the worker pool only runs when torch itself is single-threaded
    try:
        p, m, v, out = master.clone(), torch.zeros(numel), torch.zeros(numel), torch.empty(numel, dtype=torch.bfloat16)
        param, remainder = _split(master)
        m2, v2 = torch.zeros(numel), torch.zeros(numel)
        for step, g in enumerate(grads, start=1):
            adam.step_(p, g, m, v, step=step, out=out, **HYPER)
            adam.step_(remainder, g, m2, v2, step=step, out=param, **HYPER)
            assert torch.equal(param.view(torch.int16), out.view(torch.int16)), f"step {step}"
    finally:
        torch.set_num_threads(saved)
        adam.close()
    assert torch.equal(join_bf16_(param, remainder, torch.empty(numel)), p)
    assert torch.equal(m, m2) and torch.equal(v, v2)


def test_bad_tensors_are_refused_in_words():
    with pytest.raises(ValueError, match="remainder must be a contiguous torch.int16"):
        split_bf16_(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32))
    adam = CpuAdamW(threads=1)
    with pytest.raises(ValueError, match="needs its bf16 parameter as out"):
        adam.step_(torch.zeros(4, dtype=torch.int16), torch.zeros(4), torch.zeros(4), torch.zeros(4), step=1, **HYPER)


def test_bf16_moments_are_the_fp32_update_rounded_each_step():
    """bf16 moments: each step widens them, runs the fp32 kernel and rounds to nearest; the master is updated
    from the unrounded moments of that step, as a reference doing the same by hand gives bitwise."""
    numel = 5000
    torch.manual_seed(1)
    master, grads = torch.randn(numel), [torch.randn(numel) for _ in range(3)]
    adam = CpuAdamW(threads=1, chunk_numel=1024)
    p, m, v = master.clone(), torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)
    rp, rm, rv = master.clone(), torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)
    for step, g in enumerate(grads, start=1):
        adam.step_(p, g, m, v, step=step, **HYPER)
        wide_m, wide_v = rm.float(), rv.float()
        one = CpuAdamW(threads=1, chunk_numel=1024)
        one.step_(rp, g, wide_m, wide_v, step=step, **HYPER)
        rm.copy_(wide_m)
        rv.copy_(wide_v)
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    # the round trip error of a bf16 moment is at most half a bf16 ulp: 2**-8 relative (8 significant bits)
    fp32_m = torch.zeros(numel)
    fp32_v = torch.zeros(numel)
    CpuAdamW(threads=1).step_(master.clone(), grads[0], fp32_m, fp32_v, step=1, **HYPER)
    one_m = torch.zeros(numel, dtype=torch.bfloat16)
    CpuAdamW(threads=1).step_(master.clone(), grads[0], one_m, torch.zeros(numel, dtype=torch.bfloat16), step=1, **HYPER)
    assert ((one_m.float() - fp32_m).abs() <= fp32_m.abs() * 2**-8).all()


def test_the_two_pass_rounding_of_finite_chunks_is_the_exact_one():
    """Chunks of finite values take the fast path (lowest bit set, then round-to-nearest-even); it gives
    the exact integer path's parameter for every finite pattern, ties, exponent carries and the values
    that round to inf included; a chunk holding an inf or a NaN takes the exact path."""
    from infinity.optim.split_master import _exact_bits

    bits = _patterns()
    master = bits.view(torch.float32)
    finite = master[torch.isfinite(master)].contiguous()
    fast = round_bf16_(finite, torch.empty(finite.shape, dtype=torch.bfloat16))
    assert torch.equal(fast.view(torch.int16), _exact_bits(finite).to(torch.int16))
    for special in (float("inf"), -float("inf"), float("nan")):
        chunk = torch.tensor([1.0, special, -3.0])
        got = round_bf16_(chunk, torch.empty(3, dtype=torch.bfloat16)).float()
        assert got[0] == 1.0 and got[2] == -3.0
        assert (torch.isnan(got[1]) if special != special else got[1] == special)
