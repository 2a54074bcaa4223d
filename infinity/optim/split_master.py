"""The lossless split master: an fp32 master stored as its bf16 parameter plus a 16-bit remainder.

With bf16 parameters the fp32 master costs 4 more bytes per element in every tier it is stored in,
and an offloaded step reads and writes it once. But the bf16 parameter already holds the master's
top 16 bits, rounded: storing only the rest, a signed 16-bit remainder, keeps the master exactly at
half the bytes (``optimizer.master: remainder``). On the bit patterns (integer arithmetic, so
crossing an exponent, subnormals and signs need no case of their own)::

    master_bits = (param_bits << 16) + remainder        remainder in [-32768, 32767]

Which rounding: a 16-bit remainder distinguishes 65536 fp32 patterns per bf16 value, and
round-to-nearest-*even* maps 65537 of them onto each even bf16 value (both ties, ``low16 ==
0x8000`` below and above it), so it cannot be inverted from 16 bits. Round-to-nearest with ties
*away from zero* (in magnitude: ``param_bits = (master_bits + 0x8000) >> 16`` on the pattern) maps
exactly 65536, ``[param << 16 - 0x8000, param << 16 + 0x7FFF]``, and then the remainder is simply the
master's low 16 bits read as a signed int16. It differs from torch's ``.to(torch.bfloat16)`` only on
exact ties (about one element in 65536 per update). :func:`round_bf16_` is the one bf16 rounding of
a master the project uses, in every master format, so a remainder run is bitwise the fp32-master run
and a checkpoint converts between the two exactly.

NaN: a NaN master gives a NaN parameter (quiet bit set, its sign and top payload kept) and a
remainder that joins back to a NaN; the payload's low bits are not kept (a diverged run stays
visibly diverged, which is all a NaN has to say). +-inf and the largest finite values (which
round to +-inf, as in torch) are exact.

Everything is plain torch on contiguous tensors (int32 arithmetic on the patterns; torch's int32 ->
int16 conversion keeps the low 16 bits, which the tests pin down), so it runs on any device; the CPU
optimizer calls it per cache-sized chunk.
"""

from __future__ import annotations

import torch

__all__ = ["round_bf16_", "split_bf16_", "join_bf16_", "remainder_of"]

_QUIET_NAN = 0x0040   # bf16's quiet-NaN mantissa bit
_HALF = 0x8000        # half a bf16 ulp in the fp32 pattern's low 16 bits


def _exact_bits(master: torch.Tensor) -> torch.Tensor:
    """int32 holding each bf16 pattern: ``(master_bits + 0x8000) >> 16`` (arithmetic shift: a negative
    pattern stays negative; the int16 conversion then keeps the low 16 bits), NaN patterns (which carry
    into the sign bit or round to inf there) given a NaN. Every pattern, but four passes and a mask:
    :func:`round_bf16_` takes it only for chunks holding an inf or NaN."""
    bits = master.view(torch.int32)
    out = bits + _HALF
    out >>= 16
    return torch.where(torch.isnan(master), (bits >> 16) | _QUIET_NAN, out)


def round_bf16_(master: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (bf16) = ``master`` (fp32) rounded to nearest, ties away from zero (see the module doc);
    returns ``out``. ``scratch``: an int32 work buffer of as many elements (else one is allocated: a
    fresh multi-MB tensor per chunk costs more in page faults than the rounding).

    Two passes for finite values: set the pattern's lowest bit, then torch's round-to-nearest-even.
    The bit turns an exact tie (low half 0x8000) into just above it, so it rounds away from zero, and
    moves nothing else across the half-way point (0x7FFF stays below it, an exact bf16 value stays
    itself). It would turn inf into NaN: a chunk whose sum is not finite (an inf or NaN in it, or an
    overflowing sum) takes the exact integer path instead. It relies on torch's fp32 -> bf16
    conversion being exact round-to-nearest-even, subnormals included (no flush to zero), which
    tests/optim/test_split_master.py checks over every exponent."""
    _check(master, out)
    if not torch.isfinite(master.sum()):
        out.view(torch.int16).copy_(_exact_bits(master))
        return out
    nudged = torch.bitwise_or(master.view(torch.int32), 1, out=scratch)
    out.copy_(nudged.view(torch.float32))
    return out


def split_bf16_(master: torch.Tensor, param_out: torch.Tensor, remainder_out: torch.Tensor,
                scratch: torch.Tensor | None = None) -> None:
    """``param_out`` (bf16) = :func:`round_bf16_` of ``master`` (fp32); ``remainder_out`` (int16) = what
    :func:`join_bf16_` needs to give ``master`` back exactly: the master's low 16 bits, read as signed.
    ``scratch``: as for :func:`round_bf16_`."""
    _check(master, param_out, remainder_out)
    remainder_out.copy_(master.view(torch.int32))   # int32 -> int16 keeps the low 16 bits
    round_bf16_(master, param_out, scratch)


def remainder_of(master: torch.Tensor) -> torch.Tensor:
    """A new int16 tensor: the remainder :func:`split_bf16_` gives for ``master`` (its parameter being
    :func:`round_bf16_` of it)."""
    if master.dtype != torch.float32:
        raise ValueError(f"split master: the master must be fp32, got {master.dtype}")
    return master.contiguous().view(torch.int32).to(torch.int16)


def join_bf16_(param: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32) = the master whose :func:`split_bf16_` gave ``param`` (bf16) and ``remainder`` (int16);
    returns ``out``: ``(param_bits << 16) + remainder`` in int32 (a negative remainder borrows from the
    parameter's bits; the sum wraps only where a NaN's did)."""
    _check(out, param, remainder)
    bits = out.view(torch.int32)   # built in place: no work buffer
    bits.copy_(param.view(torch.int16))   # sign-extended
    bits <<= 16
    bits += remainder
    return out


def _check(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor | None = None) -> None:
    want = ((master, torch.float32, "master"), (param, torch.bfloat16, "parameter"),
            (remainder, torch.int16, "remainder"))
    for t, dtype, name in want:
        if t is None:
            continue
        if t.dtype != dtype or not t.is_contiguous() or t.numel() != master.numel():
            raise ValueError(f"split master: the {name} must be a contiguous {dtype} tensor of "
                             f"{master.numel()} elements, got {t.dtype} {tuple(t.shape)} "
                             f"(contiguous={t.is_contiguous()})")
