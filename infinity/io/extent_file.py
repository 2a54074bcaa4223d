"""One preallocated swap file per rank, holding many tensors as extents.

An :class:`ExtentFile` keeps an in-memory table ``key -> Extent(offset,
capacity_bytes, nbytes, crc32c)``; extents start on 4096-byte boundaries and take
``round_up(nbytes, 4096)`` bytes, so every one can be moved with O_DIRECT. The
file grows with ``posix_fallocate`` when no free run fits (space is reserved up
front, so a full disk shows up as ENOSPC at ``write`` time, not as a torn
extent), and freed extents are reused first-fit.

Consistency rules (what the store above relies on):

- A key is readable (``contains``) only after its write future succeeded; the
  table is updated in the completion callback, before the future resolves.
- A rewrite invalidates the old version the moment ``write`` is called: the key
  reads as absent while the new write is in flight, and if that write fails the
  key is gone (no rollback to the old bytes - its extent may be half
  overwritten). The store treats a failed write as a lost copy.
- One operation per key at a time: writing or freeing a key with a read or write
  in flight, or reading one being written, raises ``RuntimeError`` - the caller's
  residency state machine must order them.
- With ``checksum`` on, every read is verified against the CRC-32C recorded at
  write time; a mismatch fails the future with :class:`ChecksumError`. The
  destination tensor then holds the corrupt bytes.
"""

from __future__ import annotations

import enum
import errno as errno_codes
import os
import secrets
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from infinity.io.allocator import ExtentAllocator
from infinity.io.buffers import round_up
from infinity.io.engine import IOEngine, IOOp
from infinity.io.errors import ChecksumError, SwapIOError
from infinity.io.syscalls import O_DIRECT, probe_direct_io
from infinity.transitions import Transitions

__all__ = ["ExtentFile", "Extent", "ExtentState"]

_MIN_GROWTH_BYTES = 64 * 2**20  # smaller growth steps just mean more fallocate calls
_MAX_GROWTH_BYTES = 2**30       # doubling stops here so a near-full disk is not over-reserved


class ExtentState(enum.Enum):
    WRITING = "writing"  # space allocated, write in flight; not readable (any old version is gone)
    STORED = "stored"    # write completed; readable, reads counted in Extent.readers


_MOVES = Transitions("swap-file extent", {ExtentState.WRITING: {ExtentState.STORED}, ExtentState.STORED: set()})


class _FileState(enum.Enum):
    OPEN = "open"        # the swap file is open: extents may be written and read
    CLOSED = "closed"    # closed (and removed): every operation raises


# CLOSED -> OPEN: the constructor's first move (a file object starts closed until it is opened)
_FILE_MOVES = Transitions("swap file", {_FileState.CLOSED: {_FileState.OPEN, _FileState.CLOSED},
                                        _FileState.OPEN: {_FileState.CLOSED}})


@dataclass
class Extent:
    offset: int
    capacity_bytes: int  # round_up(nbytes, 4096): what the extent occupies in the file
    nbytes: int
    crc32c: int | None
    state: ExtentState
    readers: int = 0

    def move_to(self, state: ExtentState) -> None:
        self.state = _MOVES.check(self.state, state, f"extent at {self.offset}", error=AssertionError)


class ExtentFile:
    """Tensors stored by key in one swap file, moved by a shared :class:`IOEngine`.

    ``path``: a directory (which must exist) - a private ``0700`` subdirectory is
    made in it holding ``extents.swap``; or a file path ending in ``.swap`` (its
    directory must exist). The file is ``0600``. ``close(remove=True)`` deletes the
    file and the private directory.

    ``direct``: ``"auto"`` probes the file system and uses O_DIRECT where it works
    (no page-cache copy, no host memory spent on cache), buffered I/O otherwise;
    ``True`` requires O_DIRECT and raises :class:`SwapIOError` where it is refused;
    ``False`` is buffered I/O with ``fdatasync`` on :meth:`flush`. ``mode`` says
    which is in effect. ``checksum``: CRC-32C per extent, verified on read
    (~15 GB/s per core here, computed in the worker threads).
    """

    def __init__(self, path: str | os.PathLike, engine: IOEngine, direct="auto", checksum: bool = True,
                 initial_bytes: int = 0):
        if direct not in ("auto", True, False):
            raise ValueError(f"ExtentFile: direct must be 'auto', True or False, got {direct!r}")
        if not isinstance(engine, IOEngine):
            raise TypeError(f"ExtentFile: expected an IOEngine, got {type(engine).__name__}")
        self.engine = engine
        self.checksum = bool(checksum)
        self._sys = engine.syscalls
        self._lock = threading.Lock()
        self._table: dict[str, Extent] = {}
        self._alloc = ExtentAllocator()
        self._file_bytes = 0
        self._pending: set[Future] = set()
        self._counters = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0, "failed": 0}

        path = os.fspath(path)
        if path.endswith(".swap") and not os.path.isdir(path):   # a file name; a directory may end in .swap too
            directory, self.path, self._private_dir = os.path.dirname(path) or ".", path, None
            self._check_directory(directory)
        else:
            self._check_directory(path)
            directory = os.path.join(path, f"infinity-swap-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                self._sys.mkdir(directory, 0o700)
                os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask; make it exact
            except OSError as e:
                raise SwapIOError.from_os_error(e, "mkdir", directory) from e
            self._private_dir = directory
            self.path = os.path.join(directory, "extents.swap")
        try:
            self.direct = self._choose_direct(direct, directory)
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (O_DIRECT if self.direct else 0)
            # a symlink at the swap file's name is refused (ELOOP), never followed to truncate its target;
            # in our own fresh directory the file must also be new
            flags |= getattr(os, "O_NOFOLLOW", 0) | (os.O_EXCL if self._private_dir is not None else 0)
            try:
                self._fd = self._sys.open(self.path, flags, 0o600)
            except OSError as e:
                raise SwapIOError.from_os_error(e, "open", self.path) from e
            os.fchmod(self._fd, 0o600)  # O_TRUNC on an existing file keeps its old mode
            self._state = _FILE_MOVES.check(_FileState.CLOSED, _FileState.OPEN, str(self.path))
            if initial_bytes:
                self._grow(round_up(initial_bytes))
        except BaseException:
            self._state = _FileState.CLOSED
            if getattr(self, "_fd", None) is not None:
                os.close(self._fd)
            self._remove_files(quiet=True)
            raise

    @property
    def mode(self) -> str:
        return "direct" if self.direct else "buffered"

    def fileno(self) -> int:
        """The swap file's descriptor (opened with O_DIRECT in direct mode)."""
        return self._fd

    # ------------------------------------------------------------ public operations

    def write(self, key: str, src: torch.Tensor) -> Future:
        """Store ``src``'s bytes under ``key``. ``src`` must stay unchanged until the future is done."""
        nbytes = self._check_tensor("write", key, src)
        capacity = round_up(nbytes)
        with self._lock:
            self._check_open("write", key)
            old = self._table.get(key)
            if old is not None:
                self._check_idle(old, "write", key)
                del self._table[key]  # the old version is invalid from here on, whatever happens next
                self._release(old)
            entry = Extent(0, capacity, nbytes, None, ExtentState.WRITING)
            self._table[key] = entry
            try:
                if capacity:
                    entry.offset = self._allocate(capacity)
            except SwapIOError as e:
                del self._table[key]
                self._counters["failed"] += 1
                done: Future = Future()
                done.set_exception(e)
                return done
            self._counters["writes"] += 1
            user = self._track(Future())
        return self._submit(IOOp.WRITE, key, entry, src, user, self._write_done)

    def read(self, key: str, dst: torch.Tensor) -> Future:
        """Fill ``dst`` (same number of bytes as stored) with ``key``'s bytes."""
        nbytes = self._check_tensor("read", key, dst)
        with self._lock:
            self._check_open("read", key)
            entry = self._stored(key, "read")
            if nbytes != entry.nbytes:
                raise ValueError(f"ExtentFile.read: key {key!r} in {self.path} holds {entry.nbytes} bytes, "
                                 f"destination tensor has {nbytes} bytes ({tuple(dst.shape)} {dst.dtype})")
            entry.readers += 1
            self._counters["reads"] += 1
            user = self._track(Future())
        return self._submit(IOOp.READ, key, entry, dst, user, self._read_done)

    def contains(self, key: str) -> bool:
        with self._lock:
            entry = self._table.get(key)
            return entry is not None and entry.state is ExtentState.STORED

    def nbytes(self, key: str) -> int:
        with self._lock:
            return self._stored(key, "nbytes").nbytes

    def keys(self) -> list[str]:
        """Keys that are stored (readable) now."""
        with self._lock:
            return [k for k, e in self._table.items() if e.state is ExtentState.STORED]

    def free(self, key: str) -> None:
        """Forget ``key`` and make its space reusable."""
        with self._lock:
            entry = self._stored(key, "free")
            self._check_idle(entry, "free", key)
            del self._table[key]
            self._release(entry)

    def flush(self) -> None:
        """Wait for every write in flight, then ``fdatasync`` so stored extents survive a crash of the OS."""
        self._check_open("flush", None)
        with self._lock:
            pending = list(self._pending)
        wait(pending)  # their errors are reported through their own futures
        try:
            self._sys.fdatasync(self._fd)
        except OSError as e:
            raise SwapIOError.from_os_error(e, "fdatasync", self.path, self._file_bytes) from e

    def close(self, remove: bool = True) -> None:
        """Wait for operations in flight, close the file, and (``remove``) delete it. Idempotent."""
        with self._lock:
            if getattr(self, "_state", _FileState.CLOSED) is _FileState.CLOSED:
                return
            # under the lock: no operation can start after this
            self._state = _FILE_MOVES.check(self._state, _FileState.CLOSED, str(self.path))
            pending = list(self._pending)
        wait(pending)  # the engine may still be writing into / reading from the file: close the fd after
        try:
            self._sys.close(self._fd)
        except OSError as e:
            raise SwapIOError.from_os_error(e, "close", self.path) from e
        finally:
            if remove:
                self._remove_files(quiet=False)

    def stats(self) -> dict:
        with self._lock:
            stored = [e for e in self._table.values() if e.state is ExtentState.STORED]
            out = dict(self._counters)
            out.update(
                mode=self.mode, checksum=self.checksum, path=self.path, file_bytes=self._file_bytes,
                keys=len(stored), stored_bytes=sum(e.nbytes for e in stored),
                free_bytes=self._alloc.free_bytes(),
                state=getattr(self, "_state", _FileState.CLOSED).value)
        return out

    def __enter__(self) -> "ExtentFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ExtentFile({self.path!r}, mode={self.mode}, keys={len(self._table)})"

    # ------------------------------------------------------------ completion

    def _track(self, user: Future) -> Future:
        """Count ``user`` as in flight (caller holds the lock) so flush and close wait for it."""
        self._pending.add(user)
        return user

    def _submit(self, op: IOOp, key: str, entry: Extent, tensor: torch.Tensor, user: Future, on_done) -> Future:
        try:
            inner = self.engine.submit(op, self._fd, self.path, entry.offset, tensor,
                                       direct=self.direct, checksum=self.checksum)
        except BaseException as e:
            on_done(key, entry, user, None, e)
            return user

        def finish(done: Future) -> None:
            error = done.exception()
            try:
                on_done(key, entry, user, None if error else done.result(), error)
            except BaseException as e:  # noqa: BLE001 - a Future swallows callback errors; the caller would hang
                if not user.done():
                    user.set_exception(e)

        inner.add_done_callback(finish)
        return user

    def _write_done(self, key: str, entry: Extent, user: Future, crc, error) -> None:
        with self._lock:
            self._pending.discard(user)
            if error is None:
                entry.crc32c = crc
                entry.move_to(ExtentState.STORED)  # only now does the key become readable
                self._counters["bytes_written"] += entry.nbytes
            else:
                self._counters["failed"] += 1
                if self._table.get(key) is entry:
                    del self._table[key]
                self._release(entry)
        if error is None:
            user.set_result(None)
        else:
            user.set_exception(error)

    def _read_done(self, key: str, entry: Extent, user: Future, crc, error) -> None:
        if error is None and self.checksum and crc != entry.crc32c:
            error = ChecksumError(key, self.path, entry.offset, entry.nbytes, entry.crc32c, crc)
        with self._lock:
            self._pending.discard(user)
            entry.readers -= 1
            if error is None:
                self._counters["bytes_read"] += entry.nbytes
            else:
                self._counters["failed"] += 1
        if error is None:
            user.set_result(None)
        else:
            user.set_exception(error)

    # ------------------------------------------------------------ space

    def _allocate(self, capacity: int) -> int:
        offset = self._alloc.allocate(capacity)
        if offset is None:
            self._grow(capacity)
            offset = self._alloc.allocate(capacity)
            assert offset is not None, "grown file has no run for the extent it was grown for"
        return offset

    def _grow(self, needed_bytes: int) -> None:
        """Extend the file by at least ``needed_bytes``; double up to 1 GiB steps so growth is rare."""
        old = self._file_bytes
        step = round_up(max(needed_bytes, min(max(old, _MIN_GROWTH_BYTES), _MAX_GROWTH_BYTES)))
        try:
            self._extend(old, step)
        except OSError as e:
            if e.errno not in (errno_codes.ENOSPC, errno_codes.EDQUOT) or step == needed_bytes:
                raise SwapIOError.from_os_error(e, "fallocate", self.path, step,
                                                f"growing the file from {old} bytes") from e
            try:  # the generous step did not fit; the extent itself may
                self._extend(old, needed_bytes)
            except OSError as e2:
                raise SwapIOError.from_os_error(e2, "fallocate", self.path, needed_bytes,
                                                f"growing the file from {old} bytes") from e2
            step = needed_bytes
        self._file_bytes = old + step
        self._alloc.release(old, step)

    def _extend(self, offset: int, nbytes: int) -> None:
        try:
            self._sys.fallocate(self._fd, offset, nbytes)
        except OSError as e:
            if e.errno not in (errno_codes.EOPNOTSUPP, errno_codes.EINVAL):
                raise
            self._sys.ftruncate(self._fd, offset + nbytes)  # no fallocate here: a sparse file will do

    def _release(self, entry: Extent) -> None:
        if entry.capacity_bytes:
            self._alloc.release(entry.offset, entry.capacity_bytes)

    # ------------------------------------------------------------ checks

    def _stored(self, key: str, op: str) -> Extent:
        entry = self._table.get(key)
        if entry is None:
            raise KeyError(f"ExtentFile.{op}: key {key!r} is not stored in {self.path}")
        if entry.state is not ExtentState.STORED:
            raise RuntimeError(f"ExtentFile.{op}: key {key!r} in {self.path} is still being written; "
                               "wait for its write future first")
        return entry

    def _check_idle(self, entry: Extent, op: str, key: str) -> None:
        if entry.state is ExtentState.WRITING or entry.readers:
            busy = "being written" if entry.state is ExtentState.WRITING else f"being read ({entry.readers} reads)"
            raise RuntimeError(f"ExtentFile.{op}: key {key!r} in {self.path} is {busy}; "
                               "wait for its futures before changing it")

    def _check_open(self, op: str, key) -> None:
        if getattr(self, "_state", _FileState.CLOSED) is not _FileState.OPEN:
            raise RuntimeError(f"ExtentFile.{op}{'' if key is None else f' of key {key!r}'}: {self.path} is closed")

    def _check_tensor(self, op: str, key: str, tensor) -> int:
        if not isinstance(key, str):
            raise TypeError(f"ExtentFile.{op}: key must be a str, got {type(key).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"ExtentFile.{op}: key {key!r} needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"ExtentFile.{op}: key {key!r} needs a contiguous CPU tensor, got device "
                             f"{tensor.device}, contiguous={tensor.is_contiguous()}")
        return tensor.numel() * tensor.element_size()

    def _choose_direct(self, direct, directory: str) -> bool:
        if direct is False:
            return False
        works = probe_direct_io(directory)
        if direct is True and not works:
            raise SwapIOError(errno_codes.EINVAL, "open (O_DIRECT)", directory, 0,
                              "io.direct is true but this file system rejects O_DIRECT")
        return works

    @staticmethod
    def _check_directory(directory: str) -> None:
        if not os.path.exists(directory):
            raise SwapIOError(errno_codes.ENOENT, "open", directory, 0, "swap directory does not exist")
        if not os.path.isdir(directory):
            raise SwapIOError(errno_codes.ENOTDIR, "open", directory, 0, "swap path is not a directory")

    def _remove_files(self, quiet: bool) -> None:
        opened = getattr(self, "_fd", None) is not None  # never delete a file this object did not open
        for op, target in (("unlink", self.path if opened else None), ("rmdir", self._private_dir)):
            if target is None or not os.path.lexists(target):
                continue
            try:
                (self._sys.unlink if op == "unlink" else self._sys.rmdir)(target)
            except OSError as e:
                if not quiet:
                    raise SwapIOError.from_os_error(e, op, target) from e
