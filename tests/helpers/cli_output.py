"""Reading what ``infinity train`` printed on stderr."""

from __future__ import annotations

PRECISION_LINE = "infinity: precision auto -> "


def error_lines(err: str) -> list[str]:
    """stderr's lines without the one line a run with ``precision.param_dtype: auto`` prints to say what it
    measured (rank 0's, at most once: a second would be a rank announcing its own)."""
    lines = err.strip().splitlines()
    assert sum(ln.startswith(PRECISION_LINE) for ln in lines) <= 1, err
    return [ln for ln in lines if not ln.startswith(PRECISION_LINE)]
