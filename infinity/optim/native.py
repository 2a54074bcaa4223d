"""The compiled int8-moment AdamW step (``adamw_int8.c``), built at first use.

Why a compiled kernel: an int8 step in torch ops is about fifteen elementwise passes over each work
chunk (decode both moments, the fused AdamW kernel, the scale, the stochastic rounding, the fp8
conversion, twice over), measured at about six times the fp32 step's time per element on one core.
The C kernel decodes each 256-element block into a stack buffer, updates it and encodes it while it
is in L1, in one pass over the state (``tools/bench_offload.py --only formats`` measures both).

Build: the one C file, with the system C compiler (``$CC``, else ``cc``) and ``-march=native``, cached
per kind of CPU by :func:`infinity.native_build.load_library` (``$INFINITY_CACHE``, else
``~/.cache/infinity``). About a second, once per machine.

Without a compiler, when the build fails, or with ``INFINITY_NATIVE=0``, :func:`kernel` returns None
and the torch path runs (a one-line warning says why, once). Both give the same codes, scales and
parameters for the same updated fp32 values; only the Adam arithmetic's last bit may differ (torch's
kernel uses fused multiply-adds).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
from pathlib import Path

from infinity.native_build import LazyLibrary, cpu_flags, load_library

__all__ = ["kernel", "native_reason"]

_SOURCE = Path(__file__).with_name("adamw_int8.c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
_ARGTYPES = (
    ctypes.c_int64, ctypes.c_int64,                     # block_lo, block_hi
    ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,   # param, its kind, out, its kind
    ctypes.c_void_p, ctypes.c_int, ctypes.c_float,      # grad, its kind, grad_scale
    ctypes.c_void_p, ctypes.c_void_p,                   # the moments' rows
    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,   # segments: count, bounds, hyper-parameters
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,    # dither table, each moment's offset
)

log = logging.getLogger(__name__)


def kernel():
    """The ctypes function ``infinity_adamw_int8``, or None where it cannot be had (see
    :func:`native_reason`)."""
    return _KERNEL.get()


def native_reason() -> str | None:
    """Why :func:`kernel` is None (None when it is not, or not yet asked)."""
    return _KERNEL.reason


def _load():
    """``(function, None)``, or ``(None, why not)``."""
    command = [*shlex.split(os.environ.get("CC", "cc")), *_FLAGS]
    lib, why = load_library(_SOURCE, command, depends=cpu_flags(), symbols=("infinity_adamw_int8",))
    if lib is None:
        return None, why
    fn = lib.infinity_adamw_int8
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn, None


def _say_torch_path(why: str) -> None:
    log.warning("infinity: int8 moments use the torch path (about 5x slower per element): %s", why)


_KERNEL = LazyLibrary(_load, _say_torch_path)
