"""Build a small native library from one source file at first use, cache it, load it with ctypes.

Used by the int8-moment AdamW kernel (:mod:`infinity.optim.native`) and the host block cache
(:mod:`infinity.store.host_cache`). The library goes into ``$INFINITY_CACHE``, else the user cache
(``$XDG_CACHE_HOME/infinity``, else ``~/.cache/infinity``), under a name that hashes the source, the
command and whatever else the caller says the build depends on (the CPU's flags for ``-march=native``,
torch's version for a library linked against it), so a cache shared between machines keeps one build
per kind. Ranks that start together may build at once: each writes its own temporary file and renames
it into place, so the library loaded is always whole. A cached library that does not load (truncated,
say) is built again once.

A leaf module: it imports nothing of infinity.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

__all__ = ["LazyLibrary", "load_library", "cache_dir", "cpu_flags"]


class LazyLibrary:
    """What ``load()`` returns (``(value, None)`` or ``(None, why not)``), asked for once, at first
    :meth:`get`, by one thread while the others wait; ``INFINITY_NATIVE=0`` loads nothing (the reason
    says so). ``on_missing(why)`` is called once when the load gives None."""

    def __init__(self, load: Callable[[], tuple], on_missing: Callable[[str], None] | None = None):
        self._load, self._on_missing = load, on_missing
        self._lock = threading.Lock()
        self.loaded = False    # whether the load has been tried
        self.value = None      # what it gave (None until then, or when it failed)
        self.reason = None     # why value is None after the load

    def get(self):
        if not self.loaded:
            with self._lock:
                if not self.loaded:
                    if os.environ.get("INFINITY_NATIVE", "1") == "0":
                        value, reason = None, "INFINITY_NATIVE=0"
                    else:
                        value, reason = self._load()
                    self.value, self.reason, self.loaded = value, reason, True
                    if value is None and self._on_missing is not None:
                        self._on_missing(reason)
        return self.value


def cache_dir() -> Path:
    """Where built libraries are kept."""
    return Path(os.environ.get("INFINITY_CACHE") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infinity")


def load_library(source: Path, command: list, libs: tuple = (), depends: bytes = b"",
                 symbols: tuple = (), compiler: str = "C compiler", env: str = "CC") -> tuple:
    """``(library, None)``, or ``(None, why not)``: ``source`` built with ``command`` (the compiler and its
    flags; ``-o OUT SOURCE`` and then ``libs`` are appended), loaded, and holding every name in
    ``symbols``. ``compiler`` / ``env``: what a missing compiler is called and the variable that sets it."""
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join([*command, *libs]).encode(), depends])).hexdigest()
    library = cache_dir() / f"{source.stem}-{key[:16]}.so"
    for attempt in range(2):
        if not library.exists():
            why = _build(source, command, libs, library, f"{compiler} {command[0]!r} (set {env})")
            if why is not None:
                return None, why
        try:
            lib = ctypes.CDLL(str(library))
            for name in symbols:
                getattr(lib, name)
            return lib, None
        except (OSError, AttributeError) as e:
            if attempt == 0:   # a damaged cached build: build it again, once
                library.unlink(missing_ok=True)
                continue
            return None, f"cannot load {library}: {e}"


def _build(source: Path, command: list, libs: tuple, library: Path, missing: str) -> str | None:
    """Compile ``source`` into ``library`` (through a temporary file renamed into place); why not, or None."""
    cache = library.parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=library.stem, suffix=".tmp")
        os.close(fd)
    except OSError as e:
        return f"cannot build {source.name} in {cache}: {e}"
    try:
        done = subprocess.run([*command, "-o", tmp, str(source), *libs], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            return f"{command[0]} failed to build {source.name}: {first}"
        os.replace(tmp, library)
        return None
    except FileNotFoundError:
        return f"no {missing}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot build {source.name} in {cache}: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cpu_flags() -> bytes:
    """The CPU's feature flags (what ``-march=native`` builds for), or b"" where not on Linux."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return b""
