"""Streamed safetensors files: write tensors chunk by chunk, read element ranges with pread.

The format is safetensors' own (an 8-byte little-endian header length, a JSON
header of ``{name: {dtype, shape, data_offsets}}`` plus ``__metadata__``, then
the raw little-endian data), so ``safetensors.safe_open`` and
``from_pretrained`` read our files. We write and read it ourselves because
both directions must be bounded and streamed: the writer takes the declared
tensors' bytes in order, in chunks of any size, computing a CRC-32 of the
header and of each tensor as it goes, so neither a whole tensor nor a second
copy of it is ever needed (and a reader needing one tensor verifies only that
one: consolidation reads the fp32 masters, not the moments); the reader
parses and bounds-checks the header (never executing anything) and
``pread``s exactly the element range asked for into the caller's buffer
(no mmap, so page-cache pages are not charged to this process).
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import torch

from infinity.io.buffers import tensor_bytes_view
from infinity.io.new_files import open_new

__all__ = ["CheckpointError", "TensorFileWriter", "TensorFileReader", "crc32_file", "DTYPE_CODES",
           "dtype_from_code", "fsync_dir"]

DTYPE_CODES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
# A header is names, shapes and offsets; anything near this size is a damaged or hostile file.
_MAX_HEADER_BYTES = 64 * 2**20
_CRC_CHUNK_BYTES = 2**20  # small: verifying must not break consolidate's memory bound


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file (and rank) and the cause."""


def dtype_from_code(code: str, what: str) -> torch.dtype:
    try:
        return _CODE_DTYPES[code]
    except KeyError:
        raise CheckpointError(f"{what}: unknown dtype {code!r}; known: {', '.join(_CODE_DTYPES)}") from None


def fsync_dir(path) -> None:
    """Make a directory's entries (new files, renames) durable; without it a crash can lose them."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_file(path, start: int = 0, end: int | None = None, chunk_bytes: int = _CRC_CHUNK_BYTES) -> tuple:
    """(bytes, CRC-32) of a file's bytes [start, end) (end None: to the end), read in bounded chunks."""
    crc, total = 0, 0
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = start
        while end is None or pos < end:
            want = len(buf) if end is None else min(len(buf), end - pos)
            n = os.preadv(fd, [view[:want]], pos)
            if n <= 0:
                break
            crc = zlib.crc32(view[:n], crc)
            total += n
            pos += n
    finally:
        os.close(fd)
    return total, crc


class TensorFileWriter:
    """Write ``specs`` = [(name, dtype, shape)] as one safetensors file; data arrives via :meth:`write`.

    ``path`` must not exist: it is created ``O_EXCL | O_NOFOLLOW``, so a file or
    a symlink planted there is refused, never written through (write under a
    new name and rename to replace a file). Bytes must arrive in declared order
    (tensor after tensor, each in one or more chunks). :meth:`close` checks every declared byte came, flushes and
    fsyncs, and returns ``{"bytes", "header_crc32", "tensors": {name: crc32}}``.
    Any OS error (a full disk) becomes a :class:`CheckpointError` naming the
    file and bytes written.
    """

    def __init__(self, path, specs: list, metadata: dict | None = None):
        self.path = str(path)
        header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}}
        offset = 0
        self._ends: list = []   # (name, data end offset, dtype) in write order
        for name, dtype, shape in specs:
            if name in header:
                raise CheckpointError(f"{self.path}: tensor name {name!r} declared twice")
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self._ends.append((name, offset, dtype))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
        self.data_bytes = offset
        self.written_bytes = 0
        self._file = None
        head = struct.pack("<Q", len(raw)) + raw
        self._header_bytes, self._header_crc = len(head), zlib.crc32(head)
        self._crcs: dict = {name: 0 for name, _, _ in self._ends}
        self._current = 0   # index into _ends of the tensor being written
        try:
            self._file = open_new(self.path, "wb", 0o644)   # new: a planted symlink is refused, never followed
            self._file.write(head)
        except OSError as e:
            self._fail(e)

    def write(self, tensor: torch.Tensor) -> None:
        """Append a tensor's bytes; its dtype must be the declared dtype of the tensor being written."""
        if tensor.device.type != "cpu":  # CUDA-only: stage through host memory, one chunk at a time
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self.written_bytes + nbytes > self.data_bytes:
            raise CheckpointError(f"{self.path}: {self.written_bytes + nbytes} data bytes written, "
                                  f"header declares {self.data_bytes}")
        view, done = tensor_bytes_view(tensor), 0
        while done < nbytes:  # a chunk may end one tensor and start the next: split it there
            name, end, dtype = self._ends[self._current]
            if self.written_bytes + done == end:
                self._current += 1
                continue
            if dtype != tensor.dtype:
                raise CheckpointError(f"{self.path}: tensor {name!r} is declared {dtype}, got {tensor.dtype} data")
            n = min(nbytes - done, end - self.written_bytes - done)
            self._crcs[name] = zlib.crc32(view[done:done + n], self._crcs[name])
            done += n
        try:
            self._file.write(view)
        except OSError as e:
            self._fail(e)
        self.written_bytes += nbytes

    def close(self) -> dict:
        if self.written_bytes != self.data_bytes:
            self.abort()
            raise CheckpointError(f"{self.path}: {self.written_bytes} data bytes written, header declares "
                                  f"{self.data_bytes}")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())  # the rename that publishes the checkpoint must not outrun the data
            self._file.close()
        except OSError as e:
            self._fail(e)
        return {"bytes": self._header_bytes + self.data_bytes, "header_crc32": self._header_crc,
                "tensors": dict(self._crcs)}

    def abort(self) -> None:
        if self._file is not None and not self._file.closed:
            try:
                self._file.close()
            except OSError:
                pass

    def _fail(self, e: OSError):
        self.abort()
        raise CheckpointError(f"writing {self.path} failed after {self.written_bytes} data bytes: "
                              f"{e.strerror or e} (errno {e.errno})") from e


class TensorFileReader:
    """Read element ranges of a safetensors file's tensors without loading the file."""

    def __init__(self, path, what: str):
        self.path, self.what = str(path), what
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{what}: {self.path} is missing") from None
        try:
            self.file_bytes = os.fstat(self._fd).st_size
            self.entries = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _bad(self, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.what}: {self.path} is not a valid tensor file ({detail})")

    def _parse_header(self) -> dict:
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad(f"{self.file_bytes} bytes, too short for a header")
        (header_bytes,) = struct.unpack("<Q", head)
        if header_bytes > min(_MAX_HEADER_BYTES, self.file_bytes - 8):
            raise self._bad(f"header length {header_bytes} does not fit the file's {self.file_bytes} bytes")
        raw = os.pread(self._fd, header_bytes, 8)
        self.header_crc32 = zlib.crc32(raw, zlib.crc32(head))
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        data_start, data_bytes = 8 + header_bytes, self.file_bytes - 8 - header_bytes
        entries = {}
        for name, e in header.items():
            try:
                dtype = dtype_from_code(e["dtype"], f"{self.what}: {self.path} tensor {name!r}")
                shape = tuple(int(d) for d in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} entry {e!r} lacks dtype/shape/data_offsets") from None
            itemsize = torch.empty((), dtype=dtype).element_size()
            if not 0 <= begin <= end <= data_bytes or end - begin != _numel(shape) * itemsize:
                raise self._bad(f"tensor {name!r} offsets [{begin}, {end}) disagree with shape {list(shape)} "
                                f"or the {data_bytes} data bytes")
            entries[name] = (dtype, shape, data_start + begin, itemsize)
        return entries

    def entry(self, name: str) -> tuple:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.what}: {self.path} holds no tensor {name!r} "
                                  f"(has: {', '.join(self.entries) or 'none'})") from None

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of the flattened tensor ``name`` into contiguous CPU ``out`` (same dtype)."""
        dtype, shape, start, itemsize = self.entry(name)
        if out.dtype != dtype or out.numel() != hi - lo or not 0 <= lo <= hi <= _numel(shape) or \
                not out.is_contiguous() or out.device.type != "cpu":
            raise CheckpointError(f"{self.what}: {self.path} {name!r}: cannot read elements [{lo}, {hi}) of "
                                  f"{dtype} {list(shape)} into {out.dtype} x {out.numel()} on {out.device}")
        view, offset, done = tensor_bytes_view(out), start + lo * itemsize, 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise self._bad(f"ends early at byte {offset + done} reading {name!r}")
            done += n

    def tensor_crc32(self, name: str) -> int:
        """CRC-32 of one tensor's bytes, read in bounded chunks."""
        dtype, shape, start, itemsize = self.entry(name)
        return crc32_file(self.path, start, start + _numel(shape) * itemsize)[1]

    def read(self, name: str) -> torch.Tensor:
        """A whole (small) tensor, e.g. a buffer."""
        dtype, shape, _, _ = self.entry(name)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, 0, out.numel(), out.view(-1))
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
