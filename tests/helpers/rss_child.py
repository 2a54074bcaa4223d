"""Run ``rss_script.py`` in a child process (its RSS is its own) and return its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("rss_script.py")


def run_child(*args) -> dict:
    # a fixed threshold keeps unit-sized buffers mmap-backed, returned to the OS when freed (the bound's
    # stated assumption; see infinity.estimate.peak_rss.predict_peak_rss)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result
