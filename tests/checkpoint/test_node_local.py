"""Node-local checkpoints (``save_checkpoint(..., node_local=True)``) on one machine: two ranks told by
``GROUP_RANK`` that they are on two nodes, each saving into its own directory. tests/test_two_nodes.py
does the same across two network namespaces."""

from __future__ import annotations

import json

import pytest

import node_local_cases
from infinity.checkpoint import CheckpointError, consolidate
from infinity.cli import main
from zero_cases import FP32_TOL

# cross_tied has a buffer and a frozen parameter: the extras, which node 1 keeps a copy of
SPEC = dict(model="cross_tied", stage=3, groups=True, extras=True, batch=8, lr=1e-2, save_at=2, steps=4)


def test_each_node_saves_its_own_ranks_and_loads_alone_or_with_the_others(worlds, tmp_path):
    """Each directory holds the same manifest and its own rank's files (node 1 a copy of the extras); at the
    same world each rank resumes from its own directory alone, bitwise; at world 1 from both directories;
    one directory alone is refused by name where another node's ranks are needed."""
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    saved = worlds(2).run(node_local_cases.save_case, SPEC, dirs)
    steps = [tmp_path / "node0" / "step_00000002", tmp_path / "node1" / "step_00000002"]
    assert [saved[r]["path"] for r in (0, 1)] == [str(s) for s in steps]
    assert sorted(p.name for p in steps[0].iterdir()) == ["extras.safetensors", "manifest.json", "rank00000"]
    assert sorted(p.name for p in steps[1].iterdir()) == ["manifest.json", "rank00001"]
    assert (steps[1] / "rank00001" / "extras.safetensors").is_file()
    assert (steps[0] / "manifest.json").read_bytes() == (steps[1] / "manifest.json").read_bytes()
    manifest = json.loads((steps[0] / "manifest.json").read_text())
    assert manifest["node_local"] is True and manifest["nodes"] == [[0], [1]] and manifest["extras_copies"] == [0, 1]

    resumed = worlds(2).run(node_local_cases.load_case, SPEC, dirs, own=True)
    assert resumed[0]["losses"] == saved[0]["losses"]   # same world, same layout: bitwise
    one = node_local_cases.load_case(SPEC, dirs)
    for a, b in zip(one["losses"], saved[0]["losses"]):
        assert abs(a - b) <= FP32_TOL["loss_rtol"] * abs(b)
    with pytest.raises(CheckpointError, match=r"rank 1 is not here: the checkpoint was saved node-local .* pass "
                                              r"every node's directory"):
        node_local_cases.load_case(SPEC, dirs[0])
    out = consolidate(dirs, tmp_path / "out")
    assert out["files"] == ["model.safetensors"] and out["step"] == 2


def test_node_local_into_one_shared_directory_is_refused(worlds, tmp_path):
    """Two "nodes" that pass the same directory share a file system: refused on every rank, nothing left."""
    results = worlds(2).run(node_local_cases.save_case, SPEC, [str(tmp_path / "ck")], shared=True)
    for res in results:
        assert "the nodes' directories are one shared file system; save without node_local" in res["error"], res
    assert [p.name for p in (tmp_path / "ck").iterdir()] == []


def test_resume_if_saved_starts_fresh_then_resumes(tmp_path, monkeypatch, capsys):
    """The one command torchrun --max-restarts runs again: fresh when the save dir is empty, resumed after."""
    monkeypatch.chdir(tmp_path)
    tiny = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--no-progress", "--eval-every", "0",
            "--save-dir", "ck", "--resume", "if-saved"]
    assert main([*tiny, "--steps", "2"]) == 0
    out, _ = capsys.readouterr()
    assert "resumed" not in out and "saved checkpoint ck/step_00000002" in out
    assert main([*tiny, "--steps", "3"]) == 0
    out, _ = capsys.readouterr()
    assert "(resumed at step 2)" in out and "saved checkpoint ck/step_00000003" in out
    assert main(tiny[:-4] + ["--resume", "if-saved", "--steps", "3"]) == 2
    assert "--resume if-saved: give --save-dir" in capsys.readouterr().err
