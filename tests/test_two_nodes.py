"""Two nodes for real: torchrun in two network namespaces joined by a veth link, each node with its own disk.

One two-node job (2 nodes x 2 ranks, gloo over the veth, tests/helpers/two_node_script.py) runs every
training case of this module; each matches single-process torch AdamW to the fp32 tolerance the one-node
tests use (tests/helpers/zero_cases.py). A second job of 2 nodes x 1 rank resumes the node-local
checkpoint the first one saved, each node from its own directory. Skips, saying why, where network
namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from two_nodes import TwoNodes, unavailable_reason
from zero_cases import FP32_TOL, compare, reference_run

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

HELPERS = Path(__file__).resolve().parent / "helpers"
BASE = dict(model="gpt", stage=3, steps=3, batch=8, lr=1e-2)
NVME = {"params": "nvme", "optimizer": "nvme"}
CASES = {
    "nvme": ("nvme", dict(BASE, offload=NVME)),
    "hpz": ("hpz", dict(BASE, pp={"hierarchical_partition": True}, ranks_per_node="auto")),
    "tp": ("tp", dict(BASE, tp=2)),
    "checkpoint": ("checkpoint", dict(BASE, steps=4, save_at=2, offload=NVME)),
    "spans_nodes": ("error", dict(BASE, pp={"hierarchical_partition": True}, ranks_per_node=4)),
}
RESUME = dict(CASES["checkpoint"][1])
JOB_TIMEOUT_S = 240   # a few seconds of work per case; the bound is for a machine under load


def _results(node_dirs, name: str, ranks) -> list:
    out = []
    for r in ranks:
        path = Path(node_dirs[r // (len(ranks) // 2)]) / "results" / f"{name}-rank{r}.pt"
        res = torch.load(path, weights_only=False)
        assert "error" not in res, f"{name} rank {r}:\n{res['error']}"
        out.append(res)
    return out


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Both jobs, run once for the module: {"nodes": [node dirs], "first": JobResult, "resume": JobResult}."""
    root = tmp_path_factory.mktemp("two_nodes")
    cases = root / "cases.json"
    cases.write_text(json.dumps([{"name": n, "kind": k, "spec": s} for n, (k, s) in CASES.items()]))
    script = str(HELPERS / "two_node_script.py")
    with TwoNodes(root, keep_files=True) as nodes:
        # the 2x1 job reads every node's directory (as if copied to each node): its shards of the old world
        # need not be its own node's, as shard padding differs with the world size
        resume = root / "resume.json"
        spec = dict(RESUME, checkpoint=[str(n.dir / "ckpt") for n in nodes.nodes])
        resume.write_text(json.dumps([{"name": "resume_2x1", "kind": "resume_on_nodes", "spec": spec}]))
        first = nodes.run([script, str(cases)], timeout_s=JOB_TIMEOUT_S, nproc_per_node=2)
        assert first.ok, first.describe()
        second = nodes.run([script, str(resume)], timeout_s=JOB_TIMEOUT_S, nproc_per_node=1)
        yield {"nodes": [n.dir for n in nodes.nodes], "first": first, "resume": second}


def test_stage3_on_nvme_with_a_swap_dir_per_node_matches_adamw(two_nodes):
    """Stage 3, parameters and optimizer states on NVMe, each node's ranks swapping into their own node's
    directory; losses and final parameters within fp32 rounding of torch AdamW. Bytes did cross the link."""
    results = _results(two_nodes["nodes"], "nvme", range(4))
    compare(results[0], reference_run(CASES["nvme"][1]), **FP32_TOL)
    for r, res in enumerate(results):
        node_dir = str(two_nodes["nodes"][r // 2])
        assert res["node"] == {"group_rank": r // 2, "local_rank": r % 2, "local_world_size": 2}
        assert res["swap_files"] and all(f.startswith(node_dir + "/swap/") for f in res["swap_files"]), res
    assert two_nodes["first"].link_bytes["a_to_b"] > 0 and two_nodes["first"].link_bytes["b_to_a"] > 0


def test_hpz_node_groups_come_from_the_launcher_and_match_adamw(two_nodes):
    """ZeRO++ hpZ with ranks_per_node auto: 2, torchrun's ranks on each node, as the backward all-gather's
    group; within fp32 rounding of AdamW (hpZ is exact)."""
    results = _results(two_nodes["nodes"], "hpz", range(4))
    compare(results[0], reference_run(CASES["hpz"][1]), **FP32_TOL)
    for r, res in enumerate(results):
        assert res["ranks_per_node"] == 2
        assert res["node_group"] == [2 * (r // 2), 2 * (r // 2) + 1], res["node_group"]


def test_tensor_parallel_within_a_node_matches_adamw(two_nodes):
    """ZeRO-3 x TP2: each node's two ranks split the matrices, the two nodes shard over dp."""
    results = _results(two_nodes["nodes"], "tp", range(4))
    compare(results[0], reference_run(CASES["tp"][1]), **FP32_TOL)


def test_a_node_group_spanning_two_nodes_is_refused(two_nodes):
    results = _results(two_nodes["nodes"], "spans_nodes", range(4))
    for res in results:
        assert res["error_message"] is not None and "ranks_per_node: 4, but the launcher put 2 ranks on each node" \
            in res["error_message"], res["error_message"]
        assert "torchrun node 0: ranks 0, 1; torchrun node 1: ranks 2, 3" in res["error_message"]


def test_node_local_checkpoint_holds_each_nodes_own_ranks(two_nodes):
    """Each node's directory has the step with the same manifest and only its own ranks' files (node 1's lowest
    rank with a copy of the extras); alone, a directory is refused where other ranks' files are needed."""
    from infinity.checkpoint import CheckpointError
    from infinity.checkpoint.manifest import Checkpoint

    steps = [Path(d) / "ckpt" / "step_00000002" for d in two_nodes["nodes"]]
    assert sorted(p.name for p in steps[0].glob("rank*")) == ["rank00000", "rank00001"]
    assert sorted(p.name for p in steps[1].glob("rank*")) == ["rank00002", "rank00003"]
    assert (steps[1] / "rank00002" / "extras.safetensors").is_file() and not (steps[1] / "extras.safetensors").exists()
    assert (steps[0] / "manifest.json").read_bytes() == (steps[1] / "manifest.json").read_bytes()
    assert all((Path(d) / "ckpt" / "latest").read_text().strip() == "step_00000002" for d in two_nodes["nodes"])
    assert Checkpoint(steps[1]).absent_ranks == [0, 1]
    out = Path(two_nodes["nodes"][0]).parent / "alone"
    with pytest.raises(CheckpointError, match=r"rank 2 is not here: the checkpoint was saved node-local"):
        from infinity.checkpoint import consolidate
        consolidate(steps[0], out)


def test_node_local_checkpoint_resumes_at_2x1_and_1x2_and_consolidates(two_nodes, worlds, tmp_path):
    """Saved at 2 nodes x 2 ranks after step 2. Resumed at 2 nodes x 1 rank given both nodes' directories,
    and at 1 x 2 and 1 x 1 from the directories brought together into one: the next steps' losses equal the
    2x2 run's. `infinity consolidate` takes both directories."""
    import two_node_script

    saved = _results(two_nodes["nodes"], "checkpoint", range(4))[0]
    expected = saved["losses"][RESUME["save_at"]:]
    assert two_nodes["resume"].ok, two_nodes["resume"].describe()
    got_2x1 = _results(two_nodes["nodes"], "resume_2x1", range(2))[0]
    assert got_2x1["step"] == 2 and got_2x1["saved_world_size"] == 4
    compare({"losses": got_2x1["losses"], "norms": [], "params": {}}, {"losses": expected, "norms": [],
                                                                        "params": {}}, FP32_TOL["loss_rtol"])

    merged = tmp_path / "merged"
    for d in two_nodes["nodes"]:
        shutil.copytree(Path(d) / "ckpt", merged, dirs_exist_ok=True)
    got_1x2 = worlds(2).run(two_node_script.resume_case, RESUME, str(merged), str(tmp_path / "swap2"))[0]
    got_1x1 = two_node_script.resume_case(RESUME, str(merged), str(tmp_path / "swap1"))
    for got in (got_1x2, got_1x1):
        for a, b in zip(got["losses"], expected):
            assert abs(a - b) <= FP32_TOL["loss_rtol"] * abs(b), (got["losses"], expected)

    steps = [str(Path(d) / "ckpt" / "step_00000002") for d in two_nodes["nodes"]]
    proc = subprocess.run([sys.executable, "-m", "infinity.cli", "consolidate", *steps, str(tmp_path / "out"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    ref = reference_run(dict(RESUME, steps=RESUME["save_at"]))
    from zero_cases import assert_within_rounding
    assert_within_rounding(state, ref)


TRAIN = ["-m", "infinity.cli", "train", "--model", "tiny", "--steps", "16", "--batch-size", "8", "--seq-len", "64",
         "--no-progress", "--eval-every", "0", "--swap-dir", "{node_dir}/swap", "--save-dir", "{node_dir}/ckpt",
         "--save-node-local", "--save-every", "4", "--resume", "if-saved", "--metrics", "{node_dir}/metrics.jsonl"]


def _wait_for(job, predicate, timeout_s: float, what: str) -> None:
    """Until ``predicate()``; fails at once, with both logs, if the job ends first."""
    import time
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if not job.running():
            raise AssertionError(f"the job ended before {what}:\n" + job.wait(0).describe())
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def test_a_lost_nodes_ranks_restart_from_the_last_checkpoint(tmp_path):
    """`infinity train` on 2 x 2 under torchrun --max-restarts 1 (c10d, node 0 hosting the store), saving
    node-local every 4 steps. Node 1's ranks are SIGKILLed two steps after a checkpoint: node 0's ranks fail
    at once (a PeerFailed naming node 1's address and ranks, not a timeout), torchrun restarts every rank, the
    same command resumes from the checkpoint on each node, the killed ranks' swap files are removed, and the
    steps done twice have bitwise the same losses."""
    with TwoNodes(tmp_path, keep_files=True) as nodes:
        metrics = nodes.nodes[0].dir / "metrics.jsonl"
        latest = nodes.nodes[1].dir / "ckpt" / "latest"
        # a restarted attempt must not read the last attempt's addresses from torchrun's shared store
        job = nodes.launch(TRAIN, rendezvous="c10d", max_restarts=1, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        try:
            _wait_for(job, lambda: latest.exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 6,
                      JOB_TIMEOUT_S, "a checkpoint and two more steps")
            assert len(job.kill_ranks(1)) == 2
            before_kill = [json.loads(line) for line in metrics.read_text().splitlines()]
            result = job.wait(JOB_TIMEOUT_S)
        finally:
            job.kill()
    assert result.ok, result.describe()
    log0, log1 = result.logs
    assert "PeerFailed: the rank at 10.77.0.2:" in log0 and "(torchrun node 1: ranks 2, 3) exited while this one" in log0, \
        result.describe()
    assert "CollectiveTimeout" not in log0
    assert "removed 2 swap run directories of dead runs" in log1, result.describe()
    # the resumed run rewrites the metrics from its first step: the file has each step once
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(16))
    resumed_at = int(log0.split("(resumed at step ")[1].split(")")[0])
    assert resumed_at % 4 == 0 and resumed_at < len(before_kill), (resumed_at, len(before_kill))
    redone = [(r["step"], r["loss"], before_kill[r["step"]]["loss"]) for r in records[resumed_at:len(before_kill)]]
    assert redone and all(a == b for _, a, b in redone), redone
    for n in nodes.nodes:
        assert not [p for p in (n.dir / "swap").rglob("*") if p.is_file()], f"swap files left on node {n.index}"
        assert (n.dir / "ckpt" / f"step_{resumed_at:08d}" / "manifest.json").is_file()


def test_a_link_that_goes_down_ends_both_nodes_within_the_timeout(tmp_path):
    """The link goes down mid-run (no connection is reset: packets are dropped). Every rank on both nodes
    stops with a CollectiveTimeout after dist.timeout_s (plus the bounded question to the store, for the node
    cut off from it) naming the collective, node 0's ranks naming node 1's ranks as not arrived; each node's
    last checkpoint is whole."""
    from infinity.checkpoint.manifest import Checkpoint

    config = tmp_path / "config.yaml"
    config.write_text("dist: {timeout_s: 6, warn_after_s: 2}\noffload: {optimizer: nvme, params: nvme}\n"
                      "tiers: {nvme_path: swap}\n")   # --swap-dir puts it in each node's directory
    cmd = [a for a in TRAIN if a not in ("--resume", "if-saved")] + ["--config", str(config), "--steps", "400"]
    with TwoNodes(tmp_path, keep_files=True) as nodes:
        metrics = nodes.nodes[0].dir / "metrics.jsonl"
        job = nodes.launch(cmd)
        try:
            _wait_for(job, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 6, JOB_TIMEOUT_S,
                      "six steps")
            nodes.set_link(False)
            result = job.wait(JOB_TIMEOUT_S)
        finally:
            job.kill()
    assert not result.timed_out and all(rc not in (0, None) for rc in result.returncodes), result.describe()
    log0, log1 = result.logs
    # node 0's ranks name node 1's as not arrived; the one that times out first may also name its node-0
    # peer, when that one reached the collective later (a slow disk under load), before it heard of the failure
    assert re.search(r"\(dist\.timeout_s 6\); not arrived: ranks (?:[01], )?2, 3\. A rank is stopped, hung or dead",
                     log0), result.describe()
    assert "(dist.timeout_s 6); not arrived: unknown (the process group's store does not answer" in log1, \
        result.describe()
    latest = [(n.dir / "ckpt" / "latest").read_text().strip() for n in nodes.nodes]
    assert latest[0] == latest[1]
    Checkpoint([n.dir / "ckpt" / latest[0] for n in nodes.nodes])   # every rank's files, checksums checked
