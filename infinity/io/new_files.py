"""Creating files and directories where someone else may have planted a symlink.

A swap directory, a save directory or an output directory is shared with
whoever else can write there. A plain ``open(path, "w")`` follows a symlink
planted at ``path`` and truncates its target; so every file infinity creates
in such a directory is made here: ``O_CREAT | O_EXCL | O_NOFOLLOW`` (it must be
new, and a symlink in its place is refused, dangling or not). A file that has
to appear under a known name (``latest``, ``model.safetensors``,
``trace.json``) is written under an unguessable temporary name first and then
renamed onto the name: ``rename`` replaces a symlink itself, never its target,
and a reader never sees the file half-written. Directories made here are
private (0700, whatever the umask).
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from typing import IO, Iterator

__all__ = ["NEW_FILE_FLAGS", "create_new", "open_new", "temp_name", "replaced", "make_private_dir"]

# O_NOFOLLOW is implied by O_EXCL for the last component; spelled out so no flag change can lose it
NEW_FILE_FLAGS = os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC


def create_new(path: str | os.PathLike, flags: int = os.O_WRONLY, mode: int = 0o600) -> int:
    """A descriptor of a file that did not exist before this call (``FileExistsError`` otherwise)."""
    # the umask can only take bits away from ``mode``: a private 0600 stays private
    return os.open(path, flags | NEW_FILE_FLAGS, mode)


def open_new(path: str | os.PathLike, how: str = "wb", mode: int = 0o600) -> IO:
    """:func:`create_new` as a file object (``how``: ``"wb"`` or ``"w"``)."""
    if how not in ("wb", "w"):
        raise ValueError(f"open_new: how must be 'wb' or 'w', got {how!r}")
    return os.fdopen(create_new(path, os.O_WRONLY, mode), how)


def temp_name(path: str | os.PathLike) -> str:
    """``DIR/.NAME.tmp-<random>``: beside ``path`` (same file system, so a rename is atomic), unguessable."""
    path = os.fspath(path)
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{secrets.token_hex(6)}")


@contextmanager
def replaced(path: str | os.PathLike, how: str = "wb", mode: int = 0o644) -> Iterator[IO]:
    """Write a file that replaces ``path`` as a whole when the block ends without an error.

    Written to a new temporary file beside ``path``, fsynced, then renamed onto
    ``path``; on an error the temporary file is removed and ``path`` is untouched.
    """
    tmp = temp_name(path)
    f = open_new(tmp, how, mode)
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())   # the rename must not become durable before the data it publishes
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def make_private_dir(path: str | os.PathLike, exist_ok: bool = False) -> bool:
    """``mkdir path`` with mode 0700 (exactly); True when this call made it.

    With ``exist_ok`` an existing directory (one a user named may be a symlink
    to one) is accepted and keeps its mode: it is its owner's. Anything else in
    its place raises ``FileExistsError``.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if exist_ok and os.path.isdir(path):
            return False
        raise
    os.chmod(path, 0o700)   # mkdir's mode is filtered by the umask
    return True
