"""A rank whose disk fails alone does not leave the others waiting: every rank stops with its error, in
seconds (not after dist.timeout_s)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
REPO = HELPERS.parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_enospc_on_one_rank_stops_every_rank_with_its_error(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HELPERS / "peer_failure_script.py"), str(tmp_path / "swap")],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                                       PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    waiting, failed = got
    assert failed["error"] is not None and "No space left on device" in failed["message"], (got, outs[1][1])
    assert waiting["error"] == "PeerFailed", (got, outs[0][1])
    assert waiting["message"].startswith(f"rank 1 failed: {failed['error']}: {failed['message']}"), got
    assert "(this rank, 0, was waiting for it in " in waiting["message"], got
    for r in got:   # seconds after the disk filled, not the 10-minute dist.timeout_s
        assert r["stopped_at"] - r["filled_at"] < 30, got
