"""How one config key is read: sizes, the per-field parsers, and the field declaration that carries them.

Each section field (:mod:`infinity.config.sections`) is declared with :func:`_f`: its
default, the parser in its ``metadata["parse"]`` and one line of doc in ``metadata["doc"]``.
A parser takes the raw value and the key's dotted name, and returns the value or raises
:class:`ConfigError` naming the key and what was expected. Sizes are bytes: an int, or a
string such as ``"512MiB"``/``"8GiB"`` (:func:`parse_size`).
"""

from __future__ import annotations

import math
import re
from dataclasses import field
from pathlib import Path
from typing import Any, Callable

__all__ = ["ConfigError", "parse_size", "format_size"]


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or an impossible value."""


# ---------------------------------------------------------------- sizes

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any, what: str = "size") -> int:
    """``"512MiB"`` -> 536870912; ints pass through. Raises ConfigError naming ``what``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size in bytes or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(
                f"{what}: cannot read {value!r} as a size; use bytes or a number with one of "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '512MiB')"
            )
        number = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(number):   # "1e400" reads as inf, and int(inf) raises OverflowError
            raise ConfigError(f"{what}: {value!r} is not a finite size")
        n = int(number)
    else:
        raise ConfigError(f"{what}: expected a size in bytes or a string like '512MiB', got {value!r}")
    if n < 0:
        raise ConfigError(f"{what}: size must be >= 0, got {value!r}")
    return n


def format_size(n_bytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.5KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n_bytes) < 1024 or unit == "TiB":
            return f"{n_bytes:.0f}{unit}" if unit == "B" else f"{n_bytes:.1f}{unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- field parsers

def _size(v, key):
    return parse_size(v, key)


def _size_or_auto(v, key):
    return "auto" if v == "auto" else parse_size(v, key)


def _size_or_off_or_auto(v, key):
    if v in ("auto", "off"):
        return v
    n = parse_size(v, key)
    if not 0 < n <= 32 * 2**20:
        raise ConfigError(f"{key}: {v!r} must be 'auto', 'off' or a size in (0, 32MiB] (glibc's limit)")
    return n


def _choice(*options):
    def parse(v, key):
        if v not in options:
            raise ConfigError(f"{key}: expected one of {list(options)}, got {v!r}")
        return v
    return parse


def _int(lo=None, hi=None):
    def parse(v, key):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{key}: expected an integer, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"{key}: expected an integer {rng}, got {v}")
        return v
    return parse


def _multiple_of(k, lo, hi):
    inner = _int(lo, hi)

    def parse(v, key):
        v = inner(v, key)
        if v % k:
            raise ConfigError(f"{key}: expected a multiple of {k}, got {v}")
        return v
    return parse


def _int_or_auto(lo):
    inner = _int(lo)
    return lambda v, key: "auto" if v == "auto" else inner(v, key)


def _float(lo=None, lo_open=False):
    def parse(v, key):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {v!r}")
        v = float(v)
        if not math.isfinite(v):   # NaN fails no comparison below, and inf makes every update inf
            raise ConfigError(f"{key}: expected a finite number, got {v}")
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise ConfigError(f"{key}: expected a number {'>' if lo_open else '>='} {lo}, got {v}")
        return v
    return parse


def _bool(v, key):
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false, got {v!r}")
    return v


def _bool_or_auto(v, key):
    return "auto" if v == "auto" else _bool(v, key)


def _bool_or_count(v, key):
    """true, false, or a count >= 0 (0 reads as false)."""
    if isinstance(v, bool):
        return v
    if not isinstance(v, int) or v < 0:
        raise ConfigError(f"{key}: expected true, false or a count of units >= 0, got {v!r}")
    return v if v else False


def _betas(v, key):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{key}: expected two numbers [beta1, beta2], got {v!r}")
    b = tuple(_float(0.0)(x, key) for x in v)
    if not all(0.0 <= x < 1.0 for x in b):
        raise ConfigError(f"{key}: each beta must be in [0, 1), got {list(b)}")
    return b


def _str_list(v, key):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{key}: expected a list of class names, got {v!r}")
    return tuple(v)


def _optional_path(v, key):
    if v is None:
        return None
    if not isinstance(v, (str, Path)) or str(v) == "":
        raise ConfigError(f"{key}: expected a directory path, got {v!r}")
    return str(v)


def _optional_positive(v, key):
    return None if v in (None, "none") else _float(0.0, lo_open=True)(v, key)


def _loss_scale(v, key):
    if v in ("dynamic", "none"):
        return v
    return _float(0.0, lo_open=True)(v, key)


def _f(default, parse: Callable, doc: str):
    """A config field: its default, its parser, one line on what it trades."""
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults")
    return field(default=default, metadata={"parse": parse, "doc": doc})
