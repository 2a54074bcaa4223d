"""The compiled int8-moment AdamW step (``adamw_int8.c``), built at first use.

Why a compiled kernel: an int8 step in torch ops is about fifteen elementwise passes over each work
chunk (decode both moments, the fused AdamW kernel, the scale, the stochastic rounding, the fp8
conversion, twice over), measured at about six times the fp32 step's time per element on one core.
The C kernel decodes each 256-element block into a stack buffer, updates it and encodes it while it
is in L1, in one pass over the state (``tools/bench_offload.py --only formats`` measures both).

Build: the one C file, with the system C compiler (``$CC``, else ``cc``) and ``-march=native``, into
``$INFINITY_CACHE``, else the user cache (``$XDG_CACHE_HOME/infinity``, else ``~/.cache/infinity``),
under a name that hashes the source, the command and the machine's CPU flags, so a cache shared
between machines keeps one build per kind of CPU. Ranks that start together may build at once: each
writes its own temporary file and renames it into place, so the library loaded is always whole. A
cached library that does not load (truncated, say) is built again once. About a second, once per
machine.

Without a compiler, when the build fails, or with ``INFINITY_NATIVE=0``, :func:`kernel` returns None
and the torch path runs (a one-line warning says why, once). Both give the same codes, scales and
parameters for the same updated fp32 values; only the Adam arithmetic's last bit may differ (torch's
kernel uses fused multiply-adds).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

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
_lock = threading.Lock()
_loaded: dict = {}   # "fn": the kernel or None, "reason": why None


def kernel():
    """The ctypes function ``infinity_adamw_int8``, or None where it cannot be had (see
    :func:`native_reason`)."""
    if "fn" not in _loaded:
        with _lock:
            if "fn" not in _loaded:
                _loaded["fn"], _loaded["reason"] = _load()
                if _loaded["fn"] is None:
                    log.warning("infinity: int8 moments use the torch path (about 5x slower per element): %s",
                                _loaded["reason"])
    return _loaded["fn"]


def native_reason() -> str | None:
    """Why :func:`kernel` is None (None when it is not, or not yet asked)."""
    return _loaded.get("reason")


def _load():
    """``(function, None)``, or ``(None, why not)``."""
    if os.environ.get("INFINITY_NATIVE", "1") == "0":
        return None, "INFINITY_NATIVE=0"
    compiler = shlex.split(os.environ.get("CC", "cc"))
    command = [*compiler, *_FLAGS]
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), " ".join(command).encode(), _cpu_flags()])).hexdigest()
    cache = Path(os.environ.get("INFINITY_CACHE") or
                 Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infinity")
    library = cache / f"adamw_int8-{key[:16]}.so"
    for attempt in range(2):
        if not library.exists():
            why = _build(command, library)
            if why is not None:
                return None, why
        try:
            fn = ctypes.CDLL(str(library)).infinity_adamw_int8
        except (OSError, AttributeError) as e:
            if attempt == 0:   # a damaged cached build: build it again, once
                library.unlink(missing_ok=True)
                continue
            return None, f"cannot load {library}: {e}"
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        return fn, None


def _build(command: list, library: Path) -> str | None:
    """Compile the kernel into ``library`` (through a temporary file renamed into place); why not, or
    None."""
    cache = library.parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=library.stem, suffix=".tmp")
        os.close(fd)
    except OSError as e:
        return f"cannot build {_SOURCE.name} in {cache}: {e}"
    try:
        done = subprocess.run([*command, "-o", tmp, str(_SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            return f"{command[0]} failed to build {_SOURCE.name}: {first}"
        os.replace(tmp, library)
        return None
    except FileNotFoundError:
        return f"no C compiler {command[0]!r} (set CC)"
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot build {_SOURCE.name} in {cache}: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_flags() -> bytes:
    """The CPU's feature flags (what ``-march=native`` builds for), or b"" where not on Linux."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return b""
