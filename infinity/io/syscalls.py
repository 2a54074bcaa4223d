"""The OS calls the engine makes, behind one object so tests can make them fail.

Every file operation of :class:`~infinity.io.IOEngine` and
:class:`~infinity.io.ExtentFile` goes through an engine's ``syscalls``
(a :class:`Syscalls`). ``syscalls.inject("pwritev", errno.EIO, count=2)`` makes
the next two ``pwritev`` calls, from any thread, raise ``OSError(EIO)`` instead
of touching the disk: that is how EIO on a healthy disk is tested.
:func:`probe_direct_io` answers whether a directory's file system takes O_DIRECT.
"""

from __future__ import annotations

import errno as errno_codes
import os
import secrets
import threading

from infinity.io.buffers import ALIGN_BYTES, aligned_empty, tensor_bytes_view
from infinity.io.errors import SwapIOError
from infinity.io.new_files import NEW_FILE_FLAGS

__all__ = ["Syscalls", "probe_direct_io", "O_DIRECT"]

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux only; 0 elsewhere means "never direct"

_OPS = ("open", "close", "preadv", "pwritev", "fdatasync", "fallocate", "ftruncate", "mkdir", "unlink", "rmdir")


class Syscalls:
    """Thin pass-through to ``os`` with a fault-injection switch per operation."""

    def __init__(self):
        self._lock = threading.Lock()
        self._faults: dict[str, list[int]] = {}  # op -> [errno, remaining count]

    def inject(self, op: str, errno: int, count: int = 1) -> None:
        """Make the next ``count`` calls of ``op`` raise ``OSError(errno)``."""
        if op not in _OPS:
            raise ValueError(f"Syscalls.inject: unknown operation {op!r}; valid: {', '.join(_OPS)}")
        if count < 1:
            raise ValueError(f"Syscalls.inject: count must be >= 1, got {count}")
        with self._lock:
            self._faults[op] = [errno, count]

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def _maybe_fail(self, op: str) -> None:
        if not self._faults:  # fast path: no lock when nothing is injected
            return
        with self._lock:
            fault = self._faults.get(op)
            if fault is None:
                return
            fault[1] -= 1
            if fault[1] == 0:
                del self._faults[op]
        raise OSError(fault[0], f"injected {os.strerror(fault[0])}")

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._maybe_fail("open")
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        self._maybe_fail("close")
        os.close(fd)

    def preadv(self, fd: int, buf: memoryview, offset: int) -> int:
        self._maybe_fail("preadv")
        return os.preadv(fd, [buf], offset)

    def pwritev(self, fd: int, buf: memoryview, offset: int) -> int:
        self._maybe_fail("pwritev")
        return os.pwritev(fd, [buf], offset)

    def fdatasync(self, fd: int) -> None:
        self._maybe_fail("fdatasync")
        os.fdatasync(fd)

    def fallocate(self, fd: int, offset: int, nbytes: int) -> None:
        self._maybe_fail("fallocate")
        os.posix_fallocate(fd, offset, nbytes)

    def ftruncate(self, fd: int, nbytes: int) -> None:
        self._maybe_fail("ftruncate")
        os.ftruncate(fd, nbytes)

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        self._maybe_fail("mkdir")
        os.mkdir(path, mode)

    def unlink(self, path: str) -> None:
        self._maybe_fail("unlink")
        os.unlink(path)

    def rmdir(self, path: str) -> None:
        self._maybe_fail("rmdir")
        os.rmdir(path)


def probe_direct_io(directory: str | os.PathLike) -> bool:
    """Whether files in ``directory`` accept O_DIRECT: really writes and reads back 4 KiB.

    False when the file system refuses O_DIRECT (tmpfs, many FUSE and network file
    systems say EINVAL). Any other failure (missing directory, no permission,
    read-only) is a problem with the directory itself and raises :class:`SwapIOError`.
    """
    directory = os.fspath(directory)
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".infinity-direct-probe-{os.getpid()}-{secrets.token_hex(4)}")
    op = "open"
    try:
        # never through a symlink planted at the name: O_EXCL | O_NOFOLLOW refuse one (EEXIST / ELOOP)
        fd = os.open(path, os.O_RDWR | NEW_FILE_FLAGS | O_DIRECT, 0o600)
    except OSError as e:
        if e.errno != errno_codes.EEXIST:   # what is there is not ours: never unlink it
            try:  # the O_DIRECT check comes after O_CREAT made the file (ramfs, older tmpfs)
                os.unlink(path)
            except OSError:
                pass  # not created (the usual case), or the directory is the problem reported below
        if e.errno in (errno_codes.EINVAL, errno_codes.EOPNOTSUPP):
            return False
        raise SwapIOError.from_os_error(e, "open (O_DIRECT probe)", directory) from e
    try:
        block = aligned_empty(ALIGN_BYTES)
        block.fill_(0x5A)
        view = tensor_bytes_view(block)
        op = "pwritev"
        written = os.pwritev(fd, [view], 0)
        op = "preadv"
        block.zero_()
        read = os.preadv(fd, [view], 0)
        return written == ALIGN_BYTES and read == ALIGN_BYTES and bool((block == 0x5A).all())
    except OSError as e:
        if e.errno in (errno_codes.EINVAL, errno_codes.EOPNOTSUPP):
            return False
        raise SwapIOError.from_os_error(e, f"{op} (O_DIRECT probe)", path, ALIGN_BYTES) from e
    finally:
        os.close(fd)
        os.unlink(path)
