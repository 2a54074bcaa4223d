"""The collective watchdog: a long wait is logged with the collective and the ranks that have not arrived;
the process group's timeout becomes one error naming the collective; a wait the backend never ends ends
the process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infinity.comm import watchdog
from infinity.comm.watchdog import CollectiveTimeout, watch

REPO = Path(__file__).resolve().parents[2]


class DictStore:
    """The store API the watchdog uses (set / check / get), in memory."""

    def __init__(self):
        self.data, self.lock = {}, threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = str(value).encode()

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)

    def get(self, key):
        with self.lock:
            return self.data[key]


@pytest.fixture
def lines():
    out = []
    yield out
    watchdog.uninstall()


def _wait_for(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_long_wait_names_the_collective_and_the_missing_rank(lines):
    store = DictStore()
    watchdog.install(0, 3, timeout_s=60, warn_after_s=0.3, store=store, log=lines.append)
    store.set("infinity/collective_wait/2", 1)     # rank 2 waits in the same collective (#1); rank 1 never came
    with watch("all_gather of 64 bytes over ranks [0, 1, 2]"):
        _wait_for(lambda: lines)
    assert len(lines) == 1
    assert lines[0].startswith("infinity: rank 0 has waited 0 s in all_gather of 64 bytes over ranks [0, 1, 2] "
                               "(collective #1); not arrived: ranks 1"), lines
    assert store.get("infinity/collective_wait/0") == b"1"   # this rank said where it waits


def test_short_waits_say_nothing_and_touch_no_store(lines):
    store = DictStore()
    watchdog.install(0, 2, timeout_s=60, warn_after_s=5, store=store, log=lines.append)
    for _ in range(100):
        with watch("all_reduce"):
            pass
    time.sleep(0.3)
    assert lines == [] and store.data == {}


def test_backend_timeout_becomes_one_error_naming_the_collective(lines):
    watchdog.install(1, 2, timeout_s=5, warn_after_s=1, store=None, log=lines.append)
    with pytest.raises(CollectiveTimeout) as info:
        with watch("reduce_scatter of 8 bytes over ranks [0, 1]"):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    msg = str(info.value)
    assert msg.startswith("reduce_scatter of 8 bytes over ranks [0, 1] (collective #1) waited 0 s for the other "
                          "ranks (dist.timeout_s 5); not arrived: unknown") and "\n" not in msg
    with pytest.raises(ValueError):    # other errors pass through unchanged
        with watch("all_reduce"):
            raise ValueError("not a timeout")


def test_a_wait_the_backend_never_ends_ends_the_process(tmp_path):
    code = ("import time; from infinity.comm import watchdog\n"
            "watchdog.install(0, 2, timeout_s=0.3, warn_after_s=0.1)\n"
            "with watchdog.watch('all_reduce over ranks [0, 1]'):\n    time.sleep(30)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 124, out.stderr
    assert time.monotonic() - t0 < 25
    assert "infinity: rank 0: all_reduce over ranks [0, 1] (collective #1) waited 1 s" in out.stderr or \
        "infinity: rank 0: all_reduce over ranks [0, 1] (collective #1) waited 0 s" in out.stderr, out.stderr
    assert "exiting (the backend did not time out)" in out.stderr


def test_a_peer_that_vanished_is_named_as_such(lines, monkeypatch):
    """By the address gloo's error gives, and by its node and ranks where the node layout knows that address."""
    watchdog.install(0, 2, timeout_s=60, warn_after_s=30, store=DictStore(), log=lines.append)
    error = ("[gloo/transport/tcp/pair.cc:537] Read error [10.77.0.2]:58798: Connection reset by peer. This is "
             "typically caused by a remote worker hanging")
    with pytest.raises(watchdog.PeerFailed, match=r"^the rank at 10\.77\.0\.2:58798 exited while this one \(0\) "
                                                  r"waited for it in all_gather over ranks \[0, 1\] \(collective #1\): "
                                                  r"it was killed or died"):
        with watch("all_gather over ranks [0, 1]"):
            raise RuntimeError(error)
    monkeypatch.setattr(watchdog, "_PEER_NAMES", {})
    watchdog.set_peer_names({"10.77.0.2": "torchrun node 1: ranks 2, 3"})
    with pytest.raises(watchdog.PeerFailed, match=r"^the rank at 10\.77\.0\.2:58798 \(torchrun node 1: ranks 2, 3\) "
                                                  r"exited while this one \(0\)"):
        with watch("all_gather over ranks [0, 1]"):
            raise RuntimeError(error)


def test_a_peer_that_published_its_error_is_quoted(lines):
    store = DictStore()
    watchdog.install(0, 2, timeout_s=60, warn_after_s=30, store=store, log=lines.append)
    store.set("infinity/failed/1", "OSError: [Errno 28] No space left on device")
    with pytest.raises(watchdog.PeerFailed, match=r"^rank 1 failed: OSError: \[Errno 28\] No space left on device "
                                                  r"\(this rank, 0, was waiting for it in all_reduce\)"):
        with watch("all_reduce"):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
