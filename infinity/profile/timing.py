"""Wall times of repeated calls, as the profile's sections take them: each, the shortest, the median."""

from __future__ import annotations

import statistics
import time
from typing import Callable

__all__ = ["_wall_times", "_best_s", "_median_s"]


def _wall_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn``."""
    return max(min(_wall_times(fn, repeats)), 1e-9)


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``."""
    return max(statistics.median(_wall_times(fn, repeats)), 1e-9)

