"""What ``infinity profile`` measures and how big (:class:`ProfileOptions`), and the error that names an unusable
option or swap directory (:class:`ProfileError`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from infinity.config import format_size

__all__ = ["ProfileError", "ProfileOptions", "STEADY_BYTES"]

_MiB = 2**20
_MIN_SIZE_BYTES = 16 * _MiB  # a quarter of it is the smallest NVMe point: four 1 MiB blocks
# The smallest base size whose figures are steady-state rates (the package doc): an NVMe point of a quarter
# of it (32 MiB requests), CPU Adam over 32M parameters (512 MiB of state, far past any cache).
STEADY_BYTES = 512 * _MiB


class ProfileError(ValueError):
    """A profile option or the swap directory is unusable; the message names which and why."""


@dataclass(frozen=True)
class ProfileOptions:
    """What ``infinity profile`` measures and how big.

    ``size_bytes``: memcpy buffer and Adam state size; each NVMe sweep point moves a
    quarter of it, the largest collective a sixteenth. Bigger = steadier figures, longer
    run, more host memory (about 2x ``size_bytes`` at peak). Default :data:`STEADY_BYTES` with
    ``quick`` (fewer points, never smaller ones: the package doc), 1 GiB otherwise; below
    :data:`STEADY_BYTES` the figures are marked as lower bounds. ``directory``: parent of the scratch directory for the NVMe sweep
    (None = the current directory; /tmp is often tmpfs, which is not the disk to measure).
    """

    quick: bool = False
    nproc: int = 2
    directory: str | None = None
    size_bytes: int | None = None

    def __post_init__(self):
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise ProfileError(f"--nproc must be an integer >= 1 (ranks for the collectives), got {self.nproc!r}")
        if self.size_bytes is not None and self.size_bytes < _MIN_SIZE_BYTES:
            raise ProfileError(f"--bytes must be at least {format_size(_MIN_SIZE_BYTES)} (each NVMe point "
                               f"moves a quarter of it, in at least four 1 MiB blocks), got {self.size_bytes} bytes")
        if self.directory is not None and not os.path.isdir(self.directory):
            what = "is not a directory" if os.path.exists(self.directory) else "does not exist"
            raise ProfileError(f"--dir {self.directory}: {what}")

    @property
    def base_bytes(self) -> int:
        if self.size_bytes is not None:
            return self.size_bytes
        return STEADY_BYTES if self.quick else 2**30

    @property
    def lower_bound(self) -> bool:
        """Whether the figures are below steady state (a base size under :data:`STEADY_BYTES`)."""
        return self.base_bytes < STEADY_BYTES

    @property
    def repeats(self) -> int:
        return 3 if self.quick else 5

