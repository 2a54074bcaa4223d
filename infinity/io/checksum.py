"""CRC-32 of a request assembled from the CRCs of its pieces.

Worker threads checksum each piece as they move it (``zlib.crc32`` releases the
GIL above 5 KiB, so pieces are checksummed in parallel and while the data is hot
in cache); the request's CRC is then combined from the pieces' in order. The
combination is CRC arithmetic in GF(2)[x] modulo the CRC-32 polynomial:
``crc(A + B) = crc(A) * x^(8 len(B)) + crc(B)``. Python's zlib has no
``crc32_combine``, so it is done here; it costs ~32 shift-xor rounds per piece.
"""

from __future__ import annotations

import functools

__all__ = ["crc32_combine"]

# CRC-32 (IEEE 802.3) in zlib's bit-reflected form: bit 31 holds x^0.
_POLY_REFLECTED = 0xEDB88320
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
    """x^(2^k) mod P for k = 0..31 (x^(2^k) repeats with period dividing 2^32 - 1 there)."""
    table = [_X0 >> 1]  # x^1
    for _ in range(31):
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
            result = _mulmod(_X_POW_2K[k & 31], result)
        nbytes >>= 1
        k += 1
    return result


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``."""
    if len_b == 0:
        return crc_a
    return _mulmod(_x_pow_8n(len_b), crc_a) ^ crc_b
