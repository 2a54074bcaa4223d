"""CRC-32C of a request, assembled from the CRCs of its pieces.

Worker threads checksum each piece as they move it, in parallel and while the
data is hot in cache, with the ``crc32c`` package: the CPU's CRC32 instruction
where it has one (SSE 4.2, ARMv8), and it releases the GIL above 32 KiB.
Measured here: ~15 GB/s a core, against zlib's CRC-32 at 2-4 GB/s, which cost
a 124M-parameter NVMe step on 2 cores about a tenth of its time. The request's
CRC is then combined from the pieces' in order: CRC arithmetic in GF(2)[x]
modulo the Castagnoli polynomial, ``crc(A + B) = crc(A) * x^(8 len(B)) + crc(B)``.
The package has no combine, so it is done here (~32 shift-xor rounds a piece).
"""

from __future__ import annotations

import functools

from crc32c import crc32c

__all__ = ["crc32c", "crc32c_combine"]

# CRC-32C (Castagnoli) in bit-reflected form, as crc32c computes it: bit 31 holds x^0.
_POLY_REFLECTED = 0x82F63B78
_X0 = 1 << 31


def _mulmod(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both in reflected form."""
    product = 0
    bit = _X0
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY_REFLECTED if b & 1 else b >> 1
    return product


def _x_pow_2k_table() -> tuple:
    """x^(2^k) mod P for k = 0..63: shifts past up to 2^61 bytes, with no assumption on P's factors."""
    table = [_X0 >> 1]  # x^1
    for _ in range(63):
        table.append(_mulmod(table[-1], table[-1]))
    return tuple(table)


_X_POW_2K = _x_pow_2k_table()


@functools.lru_cache(maxsize=64)
def _x_pow_8n(nbytes: int) -> int:
    """x^(8 * nbytes) mod P: shifting a CRC past nbytes of data. Cached: pieces repeat sizes."""
    result = _X0
    k = 3  # 8 * nbytes = nbytes << 3
    while nbytes:
        if nbytes & 1:
            result = _mulmod(_X_POW_2K[k], result)
        nbytes >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``crc32c(a + b)`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    if len_b == 0:
        return crc_a
    return _mulmod(_x_pow_8n(len_b), crc_a) ^ crc_b
