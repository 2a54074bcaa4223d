"""Byte counts as the program prints them: decimal units, as the ZeRO paper quotes them."""

from __future__ import annotations

__all__ = ["decimal_size"]


def decimal_size(n_bytes: int) -> str:
    """Decimal units, as the ZeRO paper quotes them: 112 GB = 112e9 bytes."""
    if n_bytes == 0:
        return "0"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes} B"

