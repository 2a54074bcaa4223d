"""The NVMe tier's swap directory (``tiers.nvme_path``): made when missing, refused in words when it cannot be."""

from __future__ import annotations

import os

from infinity.store.residency import StoreError

__all__ = ["make_swap_dir"]


def make_swap_dir(path: str | os.PathLike) -> None:
    """Create ``path`` (and its parents) with mode 0700 if it does not exist, as DeepSpeed does.

    Only a directory this call creates gets its mode set (an existing one is
    the user's and keeps its mode). Raises :class:`StoreError` naming the path
    and the cause (a file in the way, permission denied, read-only file system).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return
    # no look-before-leap: ranks sharing a path race to make it, and only mkdir's own answer is current
    try:
        os.makedirs(path, mode=0o700)
        os.chmod(path, 0o700)   # makedirs' mode is filtered by the umask; the swap files are private
    except FileExistsError:
        if not os.path.isdir(path):   # another rank made it first: fine only if it is a directory
            raise StoreError(f"tiers.nvme_path {path}: exists but is not a directory; point tiers.nvme_path at a "
                             "directory on a fast local disk") from None
    except OSError as e:
        where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != path else ""
        raise StoreError(f"tiers.nvme_path {path}: cannot create the swap directory: {e.strerror or e}{where}; "
                         "point tiers.nvme_path at a writable directory on a local disk") from None
