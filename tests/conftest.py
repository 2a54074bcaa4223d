"""Shared fixtures. The helpers (rank-side cases, the multi-rank harness, child scripts) live in
``tests/helpers/`` and import by their module names, in pytest and in the ranks it spawns."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).with_name("helpers")))

import pytest  # noqa: E402

from world import World  # noqa: E402


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """``worlds(n)``: a gloo world of n ranks, started on first use and kept for the module."""
    opened = {}

    def get(n):
        if n not in opened:
            opened[n] = World(n, tmp_path_factory.mktemp(f"world{n}"))
            opened[n].start()
        return opened[n]

    yield get
    for w in opened.values():
        w.close()
