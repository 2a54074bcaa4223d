"""The two-node harness (tests/helpers/two_nodes.py): it removes what it made, bounds every run, counts the link.

Skips, saying why, where network namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from two_nodes import TwoNodes, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.slow
def test_a_run_past_its_timeout_is_killed_and_everything_is_removed(tmp_path):
    """A job that outlives its timeout is killed on both nodes (exit codes None, timed_out); leaving the
    harness deletes both namespaces (and with them the link) and the node directories."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent("""
        import socket, sys, time
        # node 1 sends node 0 a known number of bytes over the link, then both hang
        if sys.argv[1] == "1":
            for _ in range(300):   # until node 0 listens
                try:
                    s = socket.create_connection(("10.77.0.1", 29600), timeout=30)
                    break
                except ConnectionRefusedError:
                    time.sleep(0.1)
            s.sendall(b"x" * 3_000_000)
            s.close()
        else:
            srv = socket.create_server(("10.77.0.1", 29600))
            conn, _ = srv.accept()
            while conn.recv(1 << 20):
                pass
        print("ready", flush=True)
        time.sleep(600)
    """))
    with TwoNodes(tmp_path / "nodes") as nodes:
        names = [n.netns for n in nodes.nodes]
        assert all(n in _namespaces() for n in names)
        node_dirs = [n.dir for n in nodes.nodes]
        # plain python instead of a training script: torchrun starts one "rank" per node running it
        result = nodes.run([str(script), "{node}"], timeout_s=10, nproc_per_node=1)
        assert result.timed_out and result.returncodes == [None, None], result.describe()
        assert all("ready" in log for log in result.logs), result.describe()
        # 3 MB of payload from node 1, plus TCP/IP headers and the rendezvous in both directions
        assert 3_000_000 < result.link_bytes["b_to_a"] < 3_600_000, result.link_bytes
        assert not nodes.launch([str(script), "{node}"], nproc_per_node=1).wait(0.5).ok
    assert not any(n in _namespaces() for n in names)
    assert not any(d.exists() for d in node_dirs)


def test_the_tool_refuses_a_missing_command():
    proc = subprocess.run([sys.executable, "tools/two_nodes.py"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give the command after --" in proc.stderr
