"""Every test that needs a CUDA device carries the ``cuda`` marker, so ``pytest -m cuda`` (what the GPU
check runs) selects all of them, and each one skips cleanly where there is no device.

A test needs CUDA when a ``skipif`` of it gives CUDA as its reason, or its own body puts tensors on a
CUDA device (``.cuda()``, ``device="cuda"``; a test that only names a CUDA device for stubbed
queries does not). The suite is collected once in a child pytest with ``-m cuda --collect-only``; a plugin
records every collected test before the marker selection and the ones the selection kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PLUGIN = textwrap.dedent('''
    import inspect, json, os, re
    import pytest

    CUDA_BODY = re.compile(r"\\.cuda\\(\\)|device=[\\"']cuda")   # allocates on a device (a stub does not)
    seen = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(session, config, items):
        for it in items:   # before -m deselects anything
            reasons = [m.kwargs.get("reason", "") for m in it.iter_markers("skipif")]
            try:
                body = inspect.getsource(it.function)
            except (OSError, TypeError, AttributeError):
                body = ""
            seen[it.nodeid] = {"cuda_marker": it.get_closest_marker("cuda") is not None,
                               "cuda_skip": any("cuda" in r.lower() for r in reasons),
                               "cuda_body": bool(CUDA_BODY.search(body))}

    def pytest_collection_finish(session):
        with open(os.environ["MARKER_DUMP"], "w") as f:
            json.dump({"all": seen, "selected": [it.nodeid for it in session.items]}, f)
''')


def test_pytest_m_cuda_collects_every_cuda_test_and_each_skips_without_a_device(tmp_path):
    (tmp_path / "marker_dump_plugin.py").write_text(PLUGIN)
    dump = tmp_path / "dump.json"
    env = dict(os.environ, MARKER_DUMP=str(dump),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                          "-p", "marker_dump_plugin", str(TESTS)], cwd=TESTS.parent, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = json.loads(dump.read_text())
    needs_cuda = {nid for nid, m in got["all"].items() if m["cuda_skip"] or m["cuda_body"]}
    assert len(got["all"]) > 100, "the child collected too little of the suite to judge"
    assert any("tests/zero/test_cuda.py::" in nid for nid in needs_cuda)
    assert "tests/store/test_store.py::test_cuda_round_trip_pinned_and_side_stream" in needs_cuda
    unmarked = sorted(nid for nid in needs_cuda if not got["all"][nid]["cuda_marker"])
    assert not unmarked, f"tests that need CUDA without the cuda marker: {unmarked}"
    assert set(got["selected"]) == needs_cuda, (sorted(set(got["selected"]) ^ needs_cuda))
    no_skip = sorted(nid for nid in got["selected"] if not got["all"][nid]["cuda_skip"])
    assert not no_skip, f"cuda tests that would fail rather than skip without a device: {no_skip}"
