"""Block quantization for ZeRO++'s compressed collectives (qwZ, qgZ).

A flat tensor is cut into blocks of ``block_numel`` values; each block gets one
fp32 scale, ``absmax / qmax``, and its values are rounded to the nearest of
the ``2 * qmax + 1`` integers ``-qmax..qmax`` (symmetric, so zero is exact):
int8 has ``qmax = 127``, int4 ``qmax = 7`` with two values packed in a byte.

Guarantees (what ``tests/comm/test_quantize.py`` checks):

- a value's round-trip error is at most half a step of its block:
  ``|x - dequantize(quantize(x))| <= absmax(block) / (2 * qmax)`` (plus the
  rounding of the scale itself, a few ulps of fp32, and 1.2e-38 absolute:
  a block of values below fp32's normal range may underflow to zeros);
- a block of zeros has scale 0 and comes back as exact zeros; a block whose
  values are all equal comes back equal to them (to fp32 rounding);
- a non-finite input (inf or nan) raises :class:`QuantizationError`, naming the
  first bad block: a block scale cannot carry it, and quietly sending a wrong
  tensor would corrupt every rank's copy. Inside a collective, where one rank
  raising alone would leave the others waiting forever, ``nonfinite="propagate"``
  sends the block with a NaN scale instead: the whole block dequantizes to NaN
  on every rank, as an unquantized collective would spread the value.

The wire format is one ``uint8`` row per tensor: the packed integers, then the
scales' bytes (see :func:`payload_bytes`), so one collective moves both. The
last block of a tensor whose size is not a multiple of the block is padded
with zeros on the wire and cut off again by :func:`dequantize`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["QuantizationError", "BlockQuantizer", "payload_bytes"]

SCALE_BYTES = 4   # one fp32 scale per block
_QMAX = {8: 127, 4: 7}


class QuantizationError(ValueError):
    """The tensor cannot be block-quantized (a non-finite value)."""


def payload_bytes(numel: int, bits: int, block_numel: int) -> int:
    """Bytes of the wire row for ``numel`` values: packed integers plus one fp32 scale per block."""
    if bits not in _QMAX:
        raise ValueError(f"quantization bits must be 8 or 4, got {bits}")
    blocks = math.ceil(numel / block_numel)
    padded = blocks * block_numel
    return padded * bits // 8 + blocks * SCALE_BYTES


class BlockQuantizer:
    """int8 or int4 block quantization with fp32 per-block scales (see the module doc).

    ``block_numel`` must be a multiple of 8 (so a row's scales start 4-byte aligned for either width).
    """

    def __init__(self, bits: int = 8, block_numel: int = 256):
        if bits not in _QMAX:
            raise ValueError(f"BlockQuantizer: bits must be 8 or 4, got {bits}")
        if block_numel < 8 or block_numel % 8:
            raise ValueError(f"BlockQuantizer: block_numel must be a positive multiple of 8, got {block_numel}")
        self.bits, self.block_numel, self.qmax = bits, block_numel, _QMAX[bits]

    def payload_bytes(self, numel: int) -> int:
        return payload_bytes(numel, self.bits, self.block_numel)

    def quantize(self, x: torch.Tensor, what: str = "tensor", nonfinite: str = "raise") -> torch.Tensor:
        """``x`` (any float dtype) -> its wire row (uint8, :meth:`payload_bytes` long).

        A 2-D ``x`` is a batch: each row is quantized on its own and the result is
        ``[rows, payload_bytes(columns)]`` (one wire row per destination of an all-to-all).
        Raises :class:`QuantizationError` naming ``what`` and the block if ``x`` holds inf or nan, or
        with ``nonfinite="propagate"`` gives such a block a NaN scale (it dequantizes to all NaN).
        """
        batch = x.dim() == 2
        v = x.float().reshape(x.shape[0] if batch else 1, -1)
        rows, numel = v.shape
        blocks = math.ceil(numel / self.block_numel)
        if blocks * self.block_numel != numel:
            v = torch.nn.functional.pad(v, (0, blocks * self.block_numel - numel))
        v = v.reshape(rows, blocks, self.block_numel)
        absmax = v.abs().amax(dim=2)
        finite = torch.isfinite(absmax)
        if nonfinite == "propagate":
            absmax = torch.where(finite, absmax, torch.full_like(absmax, float("nan")))
            v = torch.where(finite.unsqueeze(2), v, torch.zeros_like(v))
        elif not bool(finite.all()):
            row, bad = (int(i) for i in (~finite).nonzero()[0])
            where = f"row {row}, " if batch else ""
            raise QuantizationError(
                f"cannot quantize {what}: {where}block {bad} (values {bad * self.block_numel}.."
                f"{min(numel, (bad + 1) * self.block_numel) - 1}) holds inf or nan; a block scale cannot carry "
                "a non-finite value (look for a diverged loss, or turn off zeropp quantization)")
        scale = absmax / self.qmax
        # a zero block keeps scale 0 (its values are all 0 anyway); divide by 1 instead of 0 (or NaN)
        q = torch.round(v / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(2))
        q = q.clamp_(-self.qmax, self.qmax).to(torch.int8).reshape(rows, -1)
        data_bytes = blocks * self.block_numel * self.bits // 8
        out = torch.empty(rows, data_bytes + blocks * SCALE_BYTES, dtype=torch.uint8, device=x.device)
        if self.bits == 8:
            out[:, :data_bytes].copy_(q.view(torch.uint8))
        else:
            nib = (q.reshape(rows, -1, 2).to(torch.int16) + 8).to(torch.uint8)   # -7..7 -> 1..15
            out[:, :data_bytes].copy_(nib[..., 0] | (nib[..., 1] << 4))
        out[:, data_bytes:].copy_(scale.contiguous().view(torch.uint8))
        return out if batch else out[0]

    def dequantize(self, row: torch.Tensor, numel: int, out: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A wire row -> ``numel`` values in ``dtype`` (into ``out`` if given, whose dtype wins).
        A 2-D ``row`` is a batch of rows -> ``[rows, numel]``."""
        batch = row.dim() == 2
        rows = row.reshape(row.shape[0] if batch else 1, -1)
        blocks = math.ceil(numel / self.block_numel)
        data_bytes = blocks * self.block_numel * self.bits // 8
        if rows.shape[1] != data_bytes + blocks * SCALE_BYTES:
            raise ValueError(f"dequantize: a row of {numel} values is {data_bytes + blocks * SCALE_BYTES} bytes, "
                             f"got {rows.shape[1]}")
        scale = rows[:, data_bytes:].contiguous().view(torch.float32)      # [rows, blocks]
        data = rows[:, :data_bytes]
        if self.bits == 8:
            q = data.contiguous().view(torch.int8).float()
        else:
            lo = (data & 0x0F).to(torch.int16) - 8
            hi = (data >> 4).to(torch.int16) - 8
            q = torch.stack((lo, hi), dim=2).reshape(rows.shape[0], -1).float()
        v = (q.view(rows.shape[0], blocks, self.block_numel) * scale.unsqueeze(2)).reshape(rows.shape[0], -1)
        v = v[:, :numel] if batch else v[0, :numel]
        if out is None:
            return v.to(dtype)
        out.copy_(v.view(out.shape))
        return out
