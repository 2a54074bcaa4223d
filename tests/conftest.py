"""Shared fixtures."""

import pytest

from world import World


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
