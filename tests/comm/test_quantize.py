"""The block quantizer behind ZeRO++'s qwZ and qgZ (infinity/comm/quantize.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from infinity.comm.quantize import BlockQuantizer, QuantizationError, payload_bytes


def _per_block_bound(x: torch.Tensor, q: BlockQuantizer) -> torch.Tensor:
    """Half a quantization step of each value's block (+ fp32 rounding of scale and product)."""
    n = x.numel()
    blocks = -(-n // q.block_numel)
    v = torch.nn.functional.pad(x.float(), (0, blocks * q.block_numel - n)).view(blocks, q.block_numel)
    absmax = v.abs().amax(dim=1, keepdim=True)
    # fp32 cannot hold a scale below its subnormals: values under ~1e-38 may come back as 0
    bound = absmax / (2 * q.qmax) + absmax * 4e-7 + torch.finfo(torch.float32).tiny
    return bound.expand_as(v).reshape(-1)[:n]


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("block", (8, 64, 256))
def test_round_trip_error_within_half_a_step_per_block(bits, block):
    torch.manual_seed(0)
    # blocks of very different magnitude: each must be bounded by its own scale, not the tensor's
    x = torch.randn(10 * block + 3) * torch.logspace(-6, 3, 10 * block + 3)
    q = BlockQuantizer(bits, block)
    row = q.quantize(x)
    assert row.dtype == torch.uint8 and row.numel() == payload_bytes(x.numel(), bits, block)
    y = q.dequantize(row, x.numel())
    err = (x - y).abs()
    bound = _per_block_bound(x, q)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    # and it is a real quantizer: the error is not zero everywhere, and far above bf16 rounding for int4
    assert err.max() > 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=300),
       st.sampled_from([8, 4]), st.sampled_from([8, 16, 256]))
def test_round_trip_bound_holds_for_any_values(values, bits, block):
    x = torch.tensor(values, dtype=torch.float32)
    q = BlockQuantizer(bits, block)
    y = q.dequantize(q.quantize(x), x.numel())
    assert bool(((x - y).abs() <= _per_block_bound(x, q)).all())


@pytest.mark.parametrize("bits", (8, 4))
def test_zero_blocks_come_back_exact_zeros(bits):
    q = BlockQuantizer(bits, 16)
    x = torch.zeros(64)
    x[16:32] = torch.linspace(-3, 5, 16)   # one live block between zero blocks
    y = q.dequantize(q.quantize(x), 64)
    assert torch.equal(y[:16], torch.zeros(16)) and torch.equal(y[32:], torch.zeros(32))
    assert not torch.isnan(y).any()


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("value", (1.0, -2.5, 3.0e-7, 6.0e4))
def test_all_equal_blocks_come_back_equal(bits, value):
    q = BlockQuantizer(bits, 32)
    x = torch.full((96,), value)
    y = q.dequantize(q.quantize(x), 96)
    assert torch.allclose(y, x, rtol=1e-6, atol=0), (y[:4], value)


@pytest.mark.parametrize("bad", (float("inf"), float("-inf"), float("nan")))
def test_non_finite_input_is_a_clear_error(bad):
    q = BlockQuantizer(8, 16)
    x = torch.ones(64)
    x[37] = bad
    with pytest.raises(QuantizationError, match=r"gradient of unit h\.0: block 2 \(values 32\.\.47\) holds inf or nan"):
        q.quantize(x, what="gradient of unit h.0")


def test_bf16_input_dequantizes_into_the_compute_dtype_and_out_buffer():
    q = BlockQuantizer(8, 256)
    x = torch.randn(512).bfloat16()
    out = torch.empty(2, 256, dtype=torch.bfloat16)
    q.dequantize(q.quantize(x), 512, out=out)
    assert out.dtype == torch.bfloat16
    assert float((out.view(-1).float() - x.float()).abs().max()) <= float(x.float().abs().max()) / 127


def test_payload_is_int8_plus_one_fp32_scale_per_block_to_the_byte():
    assert payload_bytes(2048, 8, 256) == 2048 + 8 * 4          # vs 4096 in bf16: 0.5156x
    assert payload_bytes(2048, 4, 256) == 1024 + 8 * 4
    assert payload_bytes(2049, 8, 256) == 9 * 256 + 9 * 4       # the last block is padded on the wire
    with pytest.raises(ValueError, match="multiple of 8"):
        BlockQuantizer(8, 12)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        BlockQuantizer(2, 256)


def test_inside_a_collective_a_non_finite_block_comes_back_nan_not_an_error():
    q = BlockQuantizer(8, 16)
    x = torch.arange(64, dtype=torch.float32)
    x[37] = float("inf")
    y = q.dequantize(q.quantize(x, nonfinite="propagate"), 64)
    assert torch.isnan(y[32:48]).all()
    assert torch.equal(torch.isnan(y).nonzero().flatten(), torch.arange(32, 48))
    assert float((y[:32] - x[:32]).abs().max()) <= 31 / 254 + 1e-5   # the other blocks as usual


def test_a_batch_of_rows_is_each_row_on_its_own():
    torch.manual_seed(1)
    for bits in (8, 4):
        q = BlockQuantizer(bits, 16)
        x = torch.randn(3, 40) * torch.tensor([[1.0], [100.0], [1e-3]])
        rows = q.quantize(x)
        assert rows.shape == (3, q.payload_bytes(40))
        for i in range(3):
            assert torch.equal(rows[i], q.quantize(x[i]))
        assert torch.equal(q.dequantize(rows, 40)[2], q.dequantize(rows[2], 40))
