"""The asynchronous NVMe I/O engine: the bottom layer (DESIGN §2, ``infinity/io/``).

``IOEngine`` owns the worker threads; ``ExtentFile`` is one rank's swap file of
keyed, checksummed, 4096-aligned extents moved by that engine; reads and writes
return ``concurrent.futures.Future``. Imports nothing from ``infinity`` but the
config.
"""

from infinity.io.buffers import ALIGN_BYTES, aligned_empty
from infinity.io.engine import IOEngine, IOOp
from infinity.io.errors import ChecksumError, SwapIOError
from infinity.io.extent_file import ExtentFile
from infinity.io.syscalls import Syscalls, probe_direct_io

__all__ = [
    "ALIGN_BYTES",
    "aligned_empty",
    "probe_direct_io",
    "IOEngine",
    "IOOp",
    "ExtentFile",
    "Syscalls",
    "SwapIOError",
    "ChecksumError",
]
