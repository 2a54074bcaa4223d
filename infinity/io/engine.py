"""The asynchronous file engine: requests split into pieces over worker threads.

A request (read or write of one contiguous CPU tensor at one file offset) is cut
into ``block_bytes`` pieces. ``threads`` workers take pieces in submission order
and move each with ``os.preadv``/``os.pwritev`` (both release the GIL, so pieces
of one request go to the disk in parallel), looping over short transfers. A
semaphore caps pieces inside a system call at ``queue_depth``; since a worker
blocks in its call, the depth the disk sees is ``min(threads, queue_depth)``.

Phases (``io.phase_bytes`` > 0): reads and writes wait in two queues and the
workers serve one kind at a time - each queue in submission order - switching to
the other kind once ``phase_bytes`` of this one were taken while the other waited,
or when none of this one is left. On a disk where reads and writes at once slow
each other down (this one, one day: 1.21 GB/s read and 2.10 GB/s written alone, 0.91
+ 0.63 at once; another day mixing cost nothing and phases lost 4-6%, so the default
is 0; ``tools/bench_io.py --mixed`` tells) the disk then mostly reads alone or writes
alone. A switch does not
wait for the other kind's pieces still in a system call (at most ``threads``).
With 0, one queue in submission order: reads and writes mixed as they come.

In direct mode (the fd was opened with O_DIRECT) a piece whose memory address or
length is not 4096-aligned goes through the worker's own aligned staging block
(a copy, padded with zeros to 4096 on write); aligned pieces go straight from the
caller's memory. Memory cost: one ``block_bytes`` staging buffer per worker.

With ``checksum`` on, each worker CRC-32Cs its piece (:mod:`infinity.io.checksum`:
the CPU's CRC instruction, GIL released) and the request's CRC is combined from
the pieces' in order. The request's :class:`~concurrent.futures.Future` resolves only after every piece has finished,
so the caller's tensor is never touched after its future is done.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import errno as errno_codes
import threading
import time
from concurrent.futures import Future

import torch

from infinity.config import IOConfig
from infinity.io.buffers import ALIGN_BYTES, aligned_empty, round_up, tensor_bytes_view
from infinity.io.checksum import crc32c, crc32c_combine
from infinity.io.errors import TRUNCATED, SwapIOError
from infinity.io.syscalls import Syscalls

from infinity.transitions import Transitions

__all__ = ["IOEngine", "IOOp"]


class IOOp(enum.Enum):
    READ = "read"    # file -> tensor
    WRITE = "write"  # tensor -> file


class _EngineState(enum.Enum):
    RUNNING = "running"  # accepting requests
    CLOSED = "closed"    # workers drained and joined; submit raises


_ENGINE_MOVES = Transitions("io engine", {_EngineState.RUNNING: {_EngineState.CLOSED}, _EngineState.CLOSED: set()})


class _Request:
    """One submitted read or write and the bookkeeping of its pieces."""

    __slots__ = ("op", "fd", "path", "file_offset", "tensor", "addr", "nbytes", "direct", "checksum",
                 "future", "remaining", "crcs", "error", "lock")

    def __init__(self, op, fd, path, file_offset, tensor, nbytes, direct, checksum, pieces):
        self.op = op
        self.fd = fd
        self.path = path
        self.file_offset = file_offset
        self.tensor = tensor  # holds the caller's memory alive until the last piece is done
        self.addr = tensor.data_ptr()
        self.nbytes = nbytes
        self.direct = direct
        self.checksum = checksum
        self.future: Future = Future()
        self.remaining = pieces
        self.crcs = [0] * pieces
        self.error: BaseException | None = None
        self.lock = threading.Lock()


class IOEngine:
    """Worker threads that move tensors to and from files; shared by every :class:`ExtentFile`.

    Knobs (from :class:`~infinity.config.IOConfig`): ``block_bytes`` (bigger pieces =
    fewer calls and larger staging buffers; smaller = more parallelism within one
    request), ``threads`` (parallel system calls; each costs a thread and a staging
    block), ``queue_depth`` (cap on pieces in system calls at once). ``direct`` and
    ``checksum`` are per-file choices made by :class:`ExtentFile`.

    ``syscalls`` is the :class:`Syscalls` every OS call goes through (tests inject
    faults there). Use as a context manager or call :meth:`close`.
    """

    def __init__(self, config: IOConfig | None = None, syscalls: Syscalls | None = None):
        config = IOConfig() if config is None else config
        if not isinstance(config, IOConfig):
            raise TypeError(f"IOEngine: expected an infinity.config.IOConfig, got {type(config).__name__}")
        if config.block_bytes <= 0 or config.block_bytes % ALIGN_BYTES:
            raise ValueError(f"io.block_bytes: must be a positive multiple of {ALIGN_BYTES}, got {config.block_bytes}")
        if config.threads < 1 or config.queue_depth < 1:
            raise ValueError(f"io.threads and io.queue_depth must be >= 1, got {config.threads} and {config.queue_depth}")
        self.config = config
        self.block_bytes = config.block_bytes
        self.syscalls = syscalls if syscalls is not None else Syscalls()
        self._state = _EngineState.RUNNING
        self._queue = _PieceQueue(config.phase_bytes, config.block_bytes)
        self._depth = threading.BoundedSemaphore(config.queue_depth)
        self._local = threading.local()  # per-worker staging block
        self._stats_lock = threading.Lock()
        self._counters = {"bytes_read": 0, "bytes_written": 0, "read_requests": 0, "write_requests": 0,
                          "failed_requests": 0, "checksum_s": 0.0, "busy_s": 0.0}
        self._inflight = 0
        self._busy_since = 0.0
        self._workers = [threading.Thread(target=self._work, name=f"infinity-io-{i}", daemon=True)
                         for i in range(config.threads)]
        for w in self._workers:
            w.start()

    # ------------------------------------------------------------ submitting

    def submit(self, op: IOOp, fd: int, path: str, file_offset: int, tensor: torch.Tensor,
               *, direct: bool, checksum: bool) -> Future:
        """Move all of ``tensor``'s bytes to/from ``fd`` at ``file_offset``.

        Returns a Future of the CRC-32C of those bytes (None when ``checksum`` is off);
        it fails with :class:`SwapIOError` on any OS error. In direct mode
        ``file_offset`` must be 4096-aligned and the file must extend to
        ``round_up(nbytes, 4096)`` past it (the tail is read and written padded).
        """
        if self._state is not _EngineState.RUNNING:
            raise RuntimeError(f"IOEngine is {self._state.value}; cannot {op.value} {path}")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"IOEngine.submit: {op.value} on {path} needs a contiguous CPU tensor")
        if direct and file_offset % ALIGN_BYTES:
            raise ValueError(f"IOEngine.submit: direct {op.value} on {path} at unaligned offset {file_offset}")
        nbytes = tensor.numel() * tensor.element_size()
        pieces = -(-nbytes // self.block_bytes)
        req = _Request(op, fd, path, file_offset, tensor, nbytes, direct, checksum, pieces)
        with self._stats_lock:
            self._counters["read_requests" if op is IOOp.READ else "write_requests"] += 1
        if pieces == 0:
            req.future.set_result(0 if checksum else None)  # CRC-32C of no bytes is 0
            return req.future
        self._begin_busy()
        self._queue.put(req, pieces)
        return req.future

    # ------------------------------------------------------------ workers

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            req, index = item
            crc = 0
            if req.error is None:  # a failed request skips its remaining pieces
                try:
                    with self._depth:
                        crc = self._move_piece(req, index)
                except OSError as e:
                    start = index * self.block_bytes
                    err = SwapIOError.from_os_error(
                        e, "pread" if req.op is IOOp.READ else "pwrite", req.path, req.nbytes,
                        f"piece of {min(self.block_bytes, req.nbytes - start)} bytes at file offset "
                        f"{req.file_offset + start}")
                    self._fail(req, err)
                except BaseException as e:  # noqa: BLE001 - delivered through the future, never lost
                    self._fail(req, e)
            self._piece_done(req, index, crc)

    def _move_piece(self, req: _Request, index: int) -> int:
        start = index * self.block_bytes
        nbytes = min(self.block_bytes, req.nbytes - start)
        addr = req.addr + start
        file_offset = req.file_offset + start
        staged = req.direct and (addr % ALIGN_BYTES or nbytes % ALIGN_BYTES)
        if staged:
            stage_addr, stage_view = self._staging()
            padded = round_up(nbytes)
            if req.op is IOOp.WRITE:
                ctypes.memmove(stage_addr, addr, nbytes)  # releases the GIL
                if padded > nbytes:  # O_DIRECT writes whole 4 KiB blocks; pad with zeros, not stale bytes
                    ctypes.memset(stage_addr + nbytes, 0, padded - nbytes)
                crc = self._crc(req, stage_view[:nbytes])
                self._write_all(req.fd, stage_view[:padded], file_offset)
            else:
                self._read_all(req.fd, stage_view[:padded], file_offset)
                crc = self._crc(req, stage_view[:nbytes])
                ctypes.memmove(addr, stage_addr, nbytes)
            return crc
        view = memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")
        if req.op is IOOp.WRITE:
            crc = self._crc(req, view)
            self._write_all(req.fd, view, file_offset)
        else:
            self._read_all(req.fd, view, file_offset)
            crc = self._crc(req, view)
        return crc

    def _crc(self, req: _Request, view: memoryview) -> int:
        if not req.checksum:
            return 0
        t0 = time.perf_counter()
        crc = crc32c(view)
        dt = time.perf_counter() - t0
        with self._stats_lock:
            self._counters["checksum_s"] += dt
        return crc

    def _staging(self) -> tuple[int, memoryview]:
        local = self._local
        if not hasattr(local, "block"):
            local.block = aligned_empty(self.block_bytes)
            local.view = tensor_bytes_view(local.block)
        return local.block.data_ptr(), local.view

    def _write_all(self, fd: int, view: memoryview, file_offset: int) -> None:
        done = 0
        while done < len(view):  # pwritev may write less than asked (signals, quotas): loop
            n = self.syscalls.pwritev(fd, view[done:], file_offset + done)
            if n <= 0:
                raise OSError(errno_codes.ENOSPC, "pwritev made no progress")  # ENOSPC is the only sane reading of 0
            done += n

    def _read_all(self, fd: int, view: memoryview, file_offset: int) -> None:
        done = 0
        while done < len(view):  # preadv may return less than asked: loop
            n = self.syscalls.preadv(fd, view[done:], file_offset + done)
            if n <= 0:
                raise OSError(errno_codes.EIO, f"{TRUNCATED} at offset {file_offset + done}")
            done += n

    def _fail(self, req: _Request, error: BaseException) -> None:
        with req.lock:
            if req.error is None:
                req.error = error

    def _piece_done(self, req: _Request, index: int, crc: int) -> None:
        start = index * self.block_bytes
        nbytes = min(self.block_bytes, req.nbytes - start)
        with req.lock:
            req.crcs[index] = crc
            req.remaining -= 1
            last = req.remaining == 0
        if req.error is None:
            with self._stats_lock:
                self._counters["bytes_read" if req.op is IOOp.READ else "bytes_written"] += nbytes
        if not last:
            return
        req.tensor = None  # the last piece is done: the caller's memory is theirs again
        self._end_busy()
        if req.error is not None:
            with self._stats_lock:
                self._counters["failed_requests"] += 1
            req.future.set_exception(req.error)
            return
        result = None
        if req.checksum:
            result = req.crcs[0]
            for i in range(1, len(req.crcs)):
                result = crc32c_combine(result, req.crcs[i], min(self.block_bytes, req.nbytes - i * self.block_bytes))
        req.future.set_result(result)

    # ------------------------------------------------------------ accounting

    def _begin_busy(self) -> None:
        with self._stats_lock:
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1

    def _end_busy(self) -> None:
        with self._stats_lock:
            self._inflight -= 1
            if self._inflight == 0:
                self._counters["busy_s"] += time.perf_counter() - self._busy_since

    def stats(self) -> dict:
        """Totals since start: bytes_read, bytes_written, read_requests, write_requests,
        failed_requests, busy_s (wall seconds with at least one request in flight),
        checksum_s (worker seconds spent in CRC-32C, summed over threads), and the knobs."""
        with self._stats_lock:
            out = dict(self._counters)
            if self._inflight:
                out["busy_s"] += time.perf_counter() - self._busy_since
        out.update(block_bytes=self.block_bytes, threads=self.config.threads,
                   queue_depth=self.config.queue_depth, state=self._state.value,
                   phase_bytes=self.config.phase_bytes, phase_switches=self._queue.switches)
        return out

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish every submitted piece, then stop the workers. Idempotent."""
        if self._state is _EngineState.CLOSED:
            return
        self._state = _ENGINE_MOVES.check(self._state, _EngineState.CLOSED, "IOEngine")
        self._queue.stop()   # the workers finish every queued piece first, then return
        for w in self._workers:
            w.join()

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _PieceQueue:
    """The pieces waiting for a worker: one queue in submission order (``phase_bytes`` 0), or one per
    kind served in phases (the module doc). :meth:`get` blocks; it returns None once :meth:`stop` was
    called and nothing is left."""

    def __init__(self, phase_bytes: int, block_bytes: int):
        self.phase_bytes = phase_bytes
        self.block_bytes = block_bytes
        self.switches = 0   # phase changes with the other kind waiting (the phases the disk saw, less one)
        self._cond = threading.Condition()
        # mixed: every piece in the READ queue; phased: by kind. Entries: (request, first piece, end piece)
        self._queues = {IOOp.READ: collections.deque(), IOOp.WRITE: collections.deque()}
        self._phase = IOOp.READ
        self._served = 0   # bytes taken in this phase
        self._stopping = False

    def put(self, req, pieces: int) -> None:
        with self._cond:
            kind = req.op if self.phase_bytes else IOOp.READ
            self._queues[kind].append([req, 0, pieces])
            self._cond.notify(pieces)

    def get(self):
        with self._cond:
            while True:
                kind = self._pick()
                if kind is not None:
                    return self._take(kind)
                if self._stopping:
                    return None
                self._cond.wait()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _pick(self):
        here, other = self._queues[self._phase], self._queues[_OTHER[self._phase]]
        if not here and not other:
            return None
        if here and (not other or not self.phase_bytes or self._served < self.phase_bytes):
            return self._phase
        if other and here:
            self.switches += 1   # the phase is spent and the other kind has waited
        self._phase, self._served = _OTHER[self._phase], 0
        return self._phase

    def _take(self, kind):
        entry = self._queues[kind][0]
        req, index = entry[0], entry[1]
        entry[1] += 1
        if entry[1] == entry[2]:
            self._queues[kind].popleft()
        self._served += min(self.block_bytes, req.nbytes - index * self.block_bytes)
        return req, index


_OTHER = {IOOp.READ: IOOp.WRITE, IOOp.WRITE: IOOp.READ}

