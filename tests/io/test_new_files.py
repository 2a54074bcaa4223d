"""Files infinity creates in shared directories never write through a symlink planted at their name.

Each case plants a symlink (at the name the code would pick, made guessable by
fixing the random part) pointing at a victim file, runs the code, and checks
the victim's bytes are what they were.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

import infinity
from infinity.io import ExtentFile, IOEngine, SwapIOError, probe_direct_io
from infinity.io.new_files import create_new, make_private_dir, replaced

VICTIM_BYTES = b"precious, not to be truncated\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_bytes(VICTIM_BYTES)
    return path


@pytest.fixture
def fixed_token(monkeypatch):
    """The random part of every temp / probe name is '0000': a planted symlink can sit exactly there."""
    import secrets
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "0000")
    return "0000"


def _plant(link, target) -> None:
    os.symlink(target, link)


def test_create_new_refuses_a_symlink_and_an_existing_file(tmp_path, victim):
    _plant(tmp_path / "link", victim)
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "link")
    with pytest.raises(FileExistsError):
        create_new(victim)
    _plant(tmp_path / "dangling", tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "dangling")
    assert not (tmp_path / "nowhere").exists()      # a dangling link is not followed to create its target
    assert victim.read_bytes() == VICTIM_BYTES


def test_replaced_swaps_the_link_not_its_target(tmp_path, victim, fixed_token):
    _plant(tmp_path / "out.json", victim)
    _plant(tmp_path / ".out.json.tmp-0000", victim)   # the temp name too: refused, nothing written
    with pytest.raises(FileExistsError):
        with replaced(tmp_path / "out.json", "w") as f:
            f.write("new")
    os.unlink(tmp_path / ".out.json.tmp-0000")
    with replaced(tmp_path / "out.json", "w") as f:
        f.write("new")
    assert not (tmp_path / "out.json").is_symlink() and (tmp_path / "out.json").read_text() == "new"
    assert victim.read_bytes() == VICTIM_BYTES


def test_private_dir_is_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        assert make_private_dir(tmp_path / "d")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o700
    assert not make_private_dir(tmp_path / "d", exist_ok=True)   # an existing one is accepted as it is


def test_direct_io_probe_never_writes_through_a_planted_link(tmp_path, victim, fixed_token):
    swap = tmp_path / "swap"
    swap.mkdir()
    link = swap / f".infinity-direct-probe-{os.getpid()}-{fixed_token}"
    _plant(link, victim)
    try:
        probe_direct_io(swap)
    except SwapIOError as e:
        assert "exists" in str(e).lower()
    assert victim.read_bytes() == VICTIM_BYTES
    assert link.is_symlink()          # what was there is not ours: left, not unlinked


def test_swap_file_path_never_truncates_a_planted_link(tmp_path, victim):
    _plant(tmp_path / "x.swap", victim)
    with IOEngine() as engine:
        with pytest.raises(SwapIOError):
            ExtentFile(str(tmp_path / "x.swap"), engine, direct=False)
    assert victim.read_bytes() == VICTIM_BYTES


def test_nvme_path_may_be_a_directory_ending_in_swap(tmp_path):
    """A swap directory whose name ends in .swap is a directory, not a file name."""
    swap = tmp_path / "fast.swap"
    swap.mkdir()
    with IOEngine() as engine:
        f = ExtentFile(str(swap), engine, direct=False)
        try:
            f.write("k", torch.arange(1024, dtype=torch.float32)).result()
            out = torch.empty(1024, dtype=torch.float32)
            f.read("k", out).result()
            assert torch.equal(out, torch.arange(1024, dtype=torch.float32))
            assert os.path.dirname(f.path) != str(tmp_path)   # its own private directory inside fast.swap
        finally:
            f.close()


def test_train_swap_probe_never_writes_through_a_planted_link(tmp_path, victim, fixed_token):
    from infinity.train import TrainError
    from infinity.train.resolve import prepare_swap_dir

    swap = tmp_path / "swap"
    swap.mkdir()
    for name in (f".infinity-probe-{os.getpid()}", f".infinity-probe-{os.getpid()}-{fixed_token}"):
        _plant(swap / name, victim)
    try:
        prepare_swap_dir(str(swap))
    except TrainError as e:
        assert f"swap directory {swap}" in str(e)
    assert victim.read_bytes() == VICTIM_BYTES


def test_train_swap_dir_is_created_private(tmp_path):
    from infinity.train.resolve import prepare_swap_dir

    old = os.umask(0o022)
    try:
        prepare_swap_dir(str(tmp_path / "new" / "swap"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "swap").st_mode) == 0o700
    assert list((tmp_path / "new" / "swap").iterdir()) == []      # the probe is gone


def _saved_checkpoint(tmp_path):
    model, optimizer = infinity.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8)), {"zero": {"stage": 3}})
    try:
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        return infinity.save_checkpoint(tmp_path / "ckpt", model, optimizer), model, optimizer
    finally:
        infinity.engine_of(model).close()


def test_consolidate_and_latest_never_write_through_planted_links(tmp_path, victim, fixed_token):
    from safetensors.torch import load_file

    from infinity.checkpoint import consolidate

    (tmp_path / "ckpt").mkdir()
    _plant(tmp_path / "ckpt" / "latest", victim)
    step_dir, _, _ = _saved_checkpoint(tmp_path)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == step_dir.name   # the link itself was replaced
    out = tmp_path / "out"
    out.mkdir()
    _plant(out / "model.safetensors", victim)
    consolidate(step_dir, out)
    assert victim.read_bytes() == VICTIM_BYTES
    assert not (out / "model.safetensors").is_symlink()
    assert set(load_file(out / "model.safetensors")) == {"0.weight", "0.bias"}
    consolidate(step_dir, out)          # again into the same directory: the files are replaced whole
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_consolidate_into_an_impossible_directory_is_one_error(tmp_path):
    from infinity.checkpoint import CheckpointError, consolidate

    step_dir, _, _ = _saved_checkpoint(tmp_path)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match=r"consolidate: cannot create the output directory .*a_file/out"):
        consolidate(step_dir, tmp_path / "a_file" / "out")


def test_trace_dump_never_writes_through_a_planted_link(tmp_path, victim, fixed_token):
    from infinity.trace import Tracer

    _plant(tmp_path / "trace.json.tmp", victim)     # the old fixed temp name
    Tracer().dump(tmp_path / "trace.json")
    assert victim.read_bytes() == VICTIM_BYTES
    assert "traceEvents" in (tmp_path / "trace.json").read_text()
