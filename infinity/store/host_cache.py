"""A cache of large host blocks for torch's CPU allocator, so a step's big temporaries stop faulting.

With anything offloaded, :mod:`infinity.store.host_malloc` fixes glibc's mmap threshold (4 MiB) so
freed memory goes back to the OS and the host budget bounds RSS. The price: every block above the
threshold is fresh memory each time it is made — autograd's activations and weight gradients, the
stage 2-3 full gradients, at 2.7B width 5-160 MB each, dozens per layer — and its first writes fault and
zero its pages. Measured (stop 38, ``perf``): 14.8% of all CPU in page faults at 2.7B. Raising the
threshold to 32 MiB took 9-21% off the step, but glibc's heaps then grew without bound (peak RSS 7.5 →
10 GiB over four steps at 2.7B): blocks of many sizes from several threads' arenas fragment them.

This cache takes the blocks at or above the threshold (``host_cache.cpp``: each its own mapping, by
size class) and keeps freed ones for the next request of the same class, up to ``cap_bytes`` cached:
the same shapes come back every layer, so most requests reuse a block whose pages are already there.
Where a freed block would pass the cap, the blocks freed longest ago are unmapped to make room (the
shapes just used come back soonest: backward's after forward's). The cap bounds what it adds to RSS,
and it is all it adds: a step of many big temporaries fills it. Smaller requests go to glibc as before.

Process-wide, like ``mallopt``: :func:`configure` makes the cache torch's CPU allocator (once; it stays,
since blocks it handed out may be freed at any time) and sets its threshold and cap; a cap of 0 turns
it off (requests go straight through, cached blocks are unmapped). Built at first use with the C++
compiler (``$CXX``, else ``c++``) against the installed torch's headers and ``libc10``
(:func:`infinity.native_build.load_library`); without one, or with ``INFINITY_NATIVE=0``,
:func:`configure` returns why and nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import shlex
from pathlib import Path

import torch

from infinity.native_build import LazyLibrary, load_library
from infinity.store.host_malloc import mmap_threshold

__all__ = ["configure", "library_reason", "trim", "stats", "take_peak_bytes", "cache_bytes", "cap_of", "AUTO_CACHE_BYTES"]

_SOURCE = Path(__file__).with_name("host_cache.cpp")
# tiers.host_cache_bytes: auto, with anything offloaded: about two layers' temporaries at 2.7B width
AUTO_CACHE_BYTES = 512 * 2**20
_STATS = ("cached_bytes", "in_use_bytes", "hits", "misses", "dropped", "peak_cached_bytes")


def _load():
    root = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    command = [*shlex.split(os.environ.get("CXX", "c++")), "-O2", "-std=c++17", "-fPIC", "-shared",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}"]
    libs = (f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}")
    lib, why = load_library(_SOURCE, command, libs, depends=torch.__version__.encode(),
                            symbols=("infinity_host_cache_set",), compiler="C++ compiler", env="CXX")
    if lib is None:
        return None, why
    lib.infinity_host_cache_set.argtypes = (ctypes.c_longlong, ctypes.c_longlong)
    lib.infinity_host_cache_set.restype = ctypes.c_int
    lib.infinity_host_cache_trim.argtypes = (ctypes.c_longlong,)
    lib.infinity_host_cache_trim.restype = ctypes.c_longlong
    lib.infinity_host_cache_take_peak.argtypes = ()
    lib.infinity_host_cache_take_peak.restype = ctypes.c_longlong
    lib.infinity_host_cache_stats.argtypes = (ctypes.c_void_p,)
    lib.infinity_host_cache_stats.restype = None
    return lib, None


_LIBRARY = LazyLibrary(_load)


def library_reason() -> str | None:
    """None when the cache's library loads here (built at first ask, then cached), else why not:
    what ``infinity report`` says about the C++ compiler."""
    return None if _LIBRARY.get() is not None else _LIBRARY.reason


def configure(min_bytes: int, cap_bytes: int) -> str | None:
    """Cache freed CPU blocks of at least ``min_bytes``, up to ``cap_bytes`` of them (0: off). Returns
    None when done, else why not (the allocator is then unchanged). Turning it off before it was ever on
    builds nothing."""
    if cap_bytes <= 0 and not _LIBRARY.loaded:
        return None
    lib = _LIBRARY.get()
    if lib is None:
        return _LIBRARY.reason
    if not lib.infinity_host_cache_set(int(min_bytes), max(0, int(cap_bytes))):
        return "torch kept another CPU allocator of higher priority"
    return None


def trim(keep_bytes: int = 0) -> int:
    """Unmap cached blocks until at most ``keep_bytes`` stay cached; the bytes unmapped."""
    lib = _LIBRARY.value
    return 0 if lib is None else int(lib.infinity_host_cache_trim(int(keep_bytes)))


def take_peak_bytes() -> int:
    """The most bytes the cache held at once since the last call (0 where it never ran); the next window
    starts now, from what it holds now."""
    lib = _LIBRARY.value
    return 0 if lib is None else int(lib.infinity_host_cache_take_peak())


def stats() -> dict:
    """The cache's counters since the process began (all 0 where it never ran): ``cached_bytes`` (free
    blocks kept now), ``in_use_bytes``, ``hits`` / ``misses`` (requests served from the cache / mapped
    fresh), ``dropped`` (blocks unmapped to keep the cap), ``peak_cached_bytes`` (since
    :func:`take_peak_bytes` last ran)."""
    out = (ctypes.c_longlong * len(_STATS))()
    lib = _LIBRARY.value
    if lib is not None:
        lib.infinity_host_cache_stats(out)
    return dict(zip(_STATS, (int(v) for v in out)))


def cache_bytes(setting, threshold: int | None) -> int:
    """The cap ``tiers.host_cache_bytes`` = ``setting`` gives, beside the mmap threshold
    :func:`infinity.store.host_malloc.mmap_threshold` fixes (None: none fixed, glibc keeps its heaps)."""
    if setting == "auto":
        return AUTO_CACHE_BYTES if threshold is not None else 0
    return int(setting)


def cap_of(tiers, offloaded: bool) -> int:
    """The cache's cap under a config's ``tiers`` section: ``tiers.host_cache_bytes`` beside the threshold
    ``tiers.malloc_mmap_threshold`` fixes (``offloaded``: whether anything is)."""
    return cache_bytes(tiers.host_cache_bytes, mmap_threshold(tiers.malloc_mmap_threshold, offloaded))
