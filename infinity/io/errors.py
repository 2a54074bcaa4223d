"""The two ways swap I/O fails: the OS said no, or the bytes came back different.

Both carry what a person needs to act: the file, the operation, the byte count
and (for OS errors) the errno, with a hint for the common causes.
"""

from __future__ import annotations

import errno as errno_codes
import os

__all__ = ["SwapIOError", "ChecksumError", "TRUNCATED"]

# How a read that found the file shorter than what was written to it starts its message: that is no
# device error (dmesg shows nothing), something outside the run cut the file
TRUNCATED = "unexpected end of file"
_TRUNCATED_HINT = ("the swap file is shorter than what this run wrote to it: something outside the run truncated "
                   "or replaced it (swap files are private to the run that made them); what it held is lost, "
                   "resume from the last checkpoint")

# What to do about the errors a swap directory typically runs into.
_HINTS = {
    errno_codes.ENOSPC: "the file system is full; free space or point tiers.nvme_path at a bigger disk",
    errno_codes.EDQUOT: "the disk quota is exhausted; free space or point tiers.nvme_path elsewhere",
    errno_codes.ENOENT: "the directory does not exist; create it or fix tiers.nvme_path",
    errno_codes.EACCES: "permission denied; make the directory writable by this user",
    errno_codes.EPERM: "operation not permitted; make the directory writable by this user",
    errno_codes.EROFS: "the file system is mounted read-only; use a writable directory",
    errno_codes.EIO: "the device reported an I/O error; check the disk (dmesg)",
    errno_codes.EINVAL: "the file system rejected the request (O_DIRECT unsupported?); try io.direct: false",
}


class SwapIOError(OSError):
    """An OS call on a swap file failed.

    ``errno``, ``path``, ``op`` (e.g. ``"pwritev"``, ``"fallocate"``) and ``nbytes`` (the
    bytes the operation was moving; 0 where none) are attributes; the message names all
    of them.
    """

    _hinted = True  # ChecksumError turns the errno hint off: its detail says it all

    def __init__(self, errno: int, op: str, path: str, nbytes: int = 0, detail: str = ""):
        what = os.strerror(errno) if errno else "failed"
        hint = _HINTS.get(errno) if self._hinted else None
        if detail.startswith(TRUNCATED):
            hint = _TRUNCATED_HINT
        msg = f"swap I/O {op} of {nbytes} bytes on {path} failed: {what}"
        if detail:
            msg += f" ({detail})"
        if hint:
            msg += f"; {hint}"
        super().__init__(errno, msg)
        self.path = str(path)
        self.op = op
        self.nbytes = nbytes
        self.detail = detail

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return (type(self), (self.errno, self.op, self.path, self.nbytes, self.detail))

    @classmethod
    def from_os_error(cls, e: OSError, op: str, path: str, nbytes: int = 0, detail: str = "") -> "SwapIOError":
        if isinstance(e, SwapIOError):
            return e
        code = e.errno or 0
        if e.strerror and code and e.strerror != os.strerror(code):  # keep what the raiser said
            detail = f"{e.strerror}; {detail}" if detail else e.strerror
        return cls(code, op, path, nbytes, detail)


class ChecksumError(SwapIOError):
    """A stored extent read back with a different CRC-32C than it was written with.

    A subclass of :class:`SwapIOError` (errno ``EIO``, as the kernel reports media
    corruption) so that code treating a failed read as a lost copy handles it too.
    """

    _hinted = False

    def __init__(self, key: str, path: str, offset: int, nbytes: int, expected: int, actual: int):
        self.key = key
        self.offset = offset
        self.expected = expected
        self.actual = actual
        super().__init__(
            errno_codes.EIO, "read", path, nbytes,
            f"checksum mismatch for key {key!r} at offset {offset}: stored crc32c {expected:#010x}, "
            f"read {actual:#010x}; the swap file is corrupt")

    def __reduce__(self):
        return (type(self), (self.key, self.path, self.offset, self.nbytes, self.expected, self.actual))
