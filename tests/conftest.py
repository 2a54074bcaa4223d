"""Shared fixtures. The helpers (rank-side cases, the multi-rank harness, child scripts) live in
``tests/helpers/`` and import by their module names, in pytest and in the ranks it spawns."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).with_name("helpers")))

import pytest  # noqa: E402

from world import World  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory):
    """The compiled int8 kernel (infinity/optim/native.py) is built into this session's temporary
    directory, not the user's cache; ranks spawned later inherit it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("INFINITY_CACHE", str(tmp_path_factory.mktemp("kernels")))
    yield
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def _temp_files(tmp_path_factory):
    """Temporary files of this process and of every process it starts (torchrun's agents make a log
    directory each) go to this session's temporary directory, which pytest prunes, not the system's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
    mp.setattr(tempfile, "tempdir", None)   # looked up again from TMPDIR on next use
    yield
    mp.undo()


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
