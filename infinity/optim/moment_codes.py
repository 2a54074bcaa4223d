"""Stored formats of Adam's two moments (``optimizer.moments``), and the 8-bit block code.

``fp32`` and ``bf16`` store a moment as a flat tensor of that dtype, one element per parameter
element. ``int8`` stores it in blocks of :data:`BLOCK` = 256 elements, each block one row of
:data:`ROW_BYTES` = 260 bytes: 256 one-byte codes, then the block's fp32 scale. A stored int8 moment
of ``n`` elements is a ``(ceil(n / 256), 260)`` uint8 tensor, 65/64 B per element.

Which code: a linear 8-bit code (``round(127 x / absmax)``) rounds every element below 1/254 of its
block's largest to zero, and Adam divides by the second moment's square root, so a parameter whose
gradients are small beside its neighbours' gets a zero first moment (no update) or a zero second
moment (an update of ``m / eps``). Dettmers et al.'s dynamic (tree) code, which bitsandbytes and
torchao use, spends its bits on an exponent instead. Here each code is an fp8 e4m3 number
(``torch.float8_e4m3fn``: sign, 4 exponent bits, 3 mantissa bits), the same idea with a fixed
layout: relative error at most 1/16 from 448 down to 2**-6, subnormals to 2**-9, and the
conversion is a single vectorized torch op one way and five integer ops the other
(``tools/bench_offload.py`` measures them beside torchao's dynamic-code quantizer).
The second moment is stored as its square root: ``exp_avg_sq`` spans the square of the
gradients' range, and the square root halves that span in exponent, so an element 10**-10 of its
block's largest still reads back nonzero.

The scale is the power of two that puts the block's largest magnitude in (224, 448]. Dividing by it
is exact, so decoding gives the code's exact value times the scale, and encoding decoded values
again gives the same values: a checkpoint saved and loaded in int8 holds bitwise the same moments
(decode of encode of decoded rows is the decoded rows; the rows themselves may differ where
rounding put a block's largest code at 224, which re-encodes as 448 at half the scale). A block of
zeros is stored as zeros (scale 1).

Rows compose: every chunk bound of a unit shard is a multiple of 4096 elements, so chunk ``[lo,
hi)`` of a moment is rows ``[lo / 256, ceil(hi / 256))`` of the shard's, and chunks concatenate
into the shard (:meth:`MomentFormat.rows`).

Everything is plain torch on contiguous tensors (the device path calls it on a job's device tensors,
the CPU optimizer per cache-sized work chunk where its compiled kernel, ``adamw_int8.c``, which does
the same operations in one pass, cannot be built; checkpoints convert with it). Decoding reads subnormal fp32 patterns
(codes below 2**-6), so it relies on IEEE subnormals, torch's default
(``torch.set_flush_denormal(False)``). NaN is not kept: a NaN moment reads back as 480 times its
block's scale (the parameter it updated is NaN already, and stays so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "ROW_BYTES", "MomentFormat", "FLAT_LAYOUT", "MOMENT_FORMATS", "moment_format", "encode_", "decode_",
           "codes_of", "scales_of", "decode_codes_", "dither", "dither_offset", "dither_table"]

BLOCK = 256                # elements per block, one fp32 scale each
ROW_BYTES = BLOCK + 4      # a block's codes, then its scale
_FP8_MAX = 448.0           # largest finite float8_e4m3fn
# an fp8 e4m3 code's magnitude bits (exponent, mantissa) shifted to an fp32 pattern's exponent/mantissa
# field give the code's value times 2**-120 (subnormal codes included: the shift maps them onto fp32
# subnormals of the same significand); the sign bit moves from bit 7 to bit 31
_MAGNITUDE_SHIFT = 20
_SIGN_SHIFT = 24
_DECODE_GAIN = 2.0 ** 120
# scale exponents are kept where 2**-e is a finite fp32 (a block of moments decayed below ~1e-28 is
# coded against 2**-100 and flushes to zero rather than overflow the multiply)
_MIN_EXPONENT, _MAX_EXPONENT = -100, 126


@dataclass(frozen=True)
class MomentFormat:
    """How one Adam moment is stored: its dtype, its tensor's shape for ``n`` elements, its bytes."""

    name: str
    dtype: torch.dtype
    blocked: bool = False   # int8: rows of BLOCK codes and a scale, not one element per parameter element

    def shape(self, numel: int) -> tuple:
        """The stored tensor's shape for ``numel`` moment elements."""
        return (math.ceil(numel / BLOCK), ROW_BYTES) if self.blocked else (numel,)

    def nbytes(self, numel: int) -> int:
        """Stored bytes of ``numel`` moment elements."""
        return math.prod(self.shape(numel)) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def itemsize(self) -> float:
        """Stored bytes per element: 4, 2, or 65/64 for int8 (exact in binary, so whole numbers of blocks
        give whole bytes)."""
        return ROW_BYTES / BLOCK if self.blocked else torch.empty((), dtype=self.dtype).element_size()

    def rows(self, stored: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of a stored moment (``lo`` a multiple of BLOCK when blocked)."""
        if not self.blocked:
            return stored[lo:hi]
        if lo % BLOCK:
            raise ValueError(f"int8 moments are read in whole blocks of {BLOCK}: lo={lo}")
        return stored[lo // BLOCK:math.ceil(hi / BLOCK)]


# the layout of every stored tensor but an int8 moment: one element per element
FLAT_LAYOUT = MomentFormat("flat", torch.float32)

MOMENT_FORMATS = {"fp32": MomentFormat("fp32", torch.float32), "bf16": MomentFormat("bf16", torch.bfloat16),
                  "int8": MomentFormat("int8", torch.uint8, blocked=True)}


def moment_format(name: str) -> MomentFormat:
    """The :class:`MomentFormat` named by ``optimizer.moments``."""
    try:
        return MOMENT_FORMATS[name]
    except KeyError:
        raise ValueError(f"optimizer.moments must be one of {list(MOMENT_FORMATS)}, got {name!r}") from None


def codes_of(rows: torch.Tensor) -> torch.Tensor:
    """The ``(rows, BLOCK)`` float8_e4m3fn codes of stored int8 rows (a view)."""
    return rows[:, :BLOCK].view(torch.float8_e4m3fn)


def scales_of(rows: torch.Tensor) -> torch.Tensor:
    """The ``(rows, 1)`` fp32 scales of stored int8 rows (a view)."""
    return rows[:, BLOCK:].view(torch.float32)


def encode_(x: torch.Tensor, rows: torch.Tensor, root: bool, dither: torch.Tensor | None = None) -> torch.Tensor:
    """Store fp32 ``x`` (flat, ``rows.shape[0] * BLOCK`` elements or more) into int8 ``rows``; returns
    ``rows``. ``root``: store the square root (the second moment). ``dither`` (:func:`dither`, int32,
    as many elements): round stochastically, else to nearest. ``x`` is used as work space: its contents
    are undefined afterwards."""
    n = rows.shape[0]
    work = x[:n * BLOCK].view(n, BLOCK)
    if root:
        work.sqrt_()
    # 2**e with amax / 448 in (2**(e-1), 2**e]: the largest magnitude lands in (224, 448]
    fraction, exponent = torch.frexp(work.abs().amax(dim=1, keepdim=True).div_(_FP8_MAX))
    exponent -= (fraction == 0.5).int()
    exponent.clamp_(_MIN_EXPONENT, _MAX_EXPONENT)
    work.mul_(_power_of_two(-exponent))   # exact
    if dither is not None:
        # stochastic rounding to 3 mantissa bits on the pattern: a magnitude is rounded up with the
        # probability of the fraction it drops (the sign bit is left alone: no magnitude reaches it)
        bits = work.view(torch.int32)
        bits.add_(dither[:n * BLOCK].view(n, BLOCK)).bitwise_and_(_KEPT_BITS)
        work.clamp_(-_FP8_MAX, _FP8_MAX)   # 448 may round up to 480, which e4m3fn does not hold
    codes_of(rows).copy_(work)   # nearest even fp8: the rounding, or exact after a stochastic one
    scales_of(rows).copy_(_power_of_two(exponent))
    return rows


def dither(seed: int, step: int, which: int, index: int, numel: int, device=None) -> torch.Tensor:
    """int32 random in [0, 2**20) for :func:`encode_`'s stochastic rounding of elements
    ``[index, index + numel)`` of a moment: a fixed random table read from an offset that hashes
    ``(seed, step, which)``, so it is the same wherever the elements are updated (any chunking, thread
    split, tier or world size, given ``index`` counts from the same origin) and new each step.
    ``seed``: the unit; ``which``: 0 for the first moment, 1 for the second."""
    table = dither_table(device)
    start = dither_offset(seed, step, which, index)
    if numel <= _DITHER_NUMEL:
        return table[start:start + numel]
    return table[(start + torch.arange(numel, device=table.device)) % _DITHER_NUMEL]


def dither_offset(seed: int, step: int, which: int, index: int) -> int:
    """Where :func:`dither` of element ``index`` starts in :func:`dither_table` (in ``[0, 2**20)``)."""
    return (_mix(seed, step, which) + index) % _DITHER_NUMEL


def _mix(*values: int) -> int:
    """splitmix64 over ``values``: an offset into the dither table."""
    h = 0
    for v in values:
        h = (h + 0x9E3779B97F4A7C15 + v) & _U64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _U64
        h ^= h >> 31
    return h


_DITHER_NUMEL = 1 << 20
_U64 = (1 << 64) - 1
_KEPT_BITS = ~((1 << 20) - 1)   # fp32 keeps 23 mantissa bits, e4m3 3: the low 20 are rounded off
_DITHER_TABLES: dict = {}


def dither_table(device=None) -> torch.Tensor:
    """The dither table (2**20 entries twice over, so any slice up to 2**20 long is contiguous), per
    device."""
    key = str(torch.device(device or "cpu"))
    if key not in _DITHER_TABLES:
        g = torch.Generator().manual_seed(0x1F8)
        table = torch.randint(0, 1 << 20, (_DITHER_NUMEL,), generator=g, dtype=torch.int32)
        _DITHER_TABLES[key] = torch.cat([table, table]).to(key)
    return _DITHER_TABLES[key]


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**exponent`` built from its bit pattern (exact; ``exponent`` in [-126, 127])."""
    return exponent.add(127).bitwise_left_shift_(23).view(torch.float32)


def decode_(rows: torch.Tensor, out: torch.Tensor, squared: bool) -> torch.Tensor:
    """fp32 values of int8 ``rows`` into flat ``out`` (``rows.shape[0] * BLOCK`` elements or more);
    returns that many elements of ``out``. ``squared``: the rows hold a square root (the second moment)."""
    return decode_codes_(rows[:, :BLOCK], scales_of(rows), out, squared)


def decode_codes_(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, squared: bool) -> torch.Tensor:
    """:func:`decode_` from the codes (``(rows, BLOCK)`` uint8 or float8_e4m3fn) and their scales
    (``(rows, 1)`` fp32) held apart, as a checkpoint file holds them."""
    n = codes.shape[0]
    bits = out[:n * BLOCK].view(torch.int32).view(n, BLOCK)
    bits.copy_(codes.view(torch.uint8))
    sign = torch.bitwise_and(bits, 0x80).bitwise_left_shift_(_SIGN_SHIFT)
    bits.bitwise_and_(0x7F).bitwise_left_shift_(_MAGNITUDE_SHIFT).bitwise_or_(sign)
    values = bits.view(torch.float32)
    gain = scales * _DECODE_GAIN   # exact, both powers of two: the pattern's value times the scale
    if bool(torch.isinf(gain).any()):   # a block above 448 * 2**7: its gain overflows fp32, so two exact steps
        values.mul_(_DECODE_GAIN).mul_(scales)
    else:
        values.mul_(gain)
    if squared:
        values.mul_(values)
    return out[:n * BLOCK]
