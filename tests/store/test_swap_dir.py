"""``tiers.nvme_path`` is created (0700) when missing, and refused in words when it cannot be."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import infinity
from infinity.store import StoreError


def _config(path):
    # nothing kept host-resident: the shards must reach the swap directory
    return {"zero": {"stage": 3}, "offload": {"optimizer": "nvme", "params": "nvme", "host_resident_bytes": 0},
            "tiers": {"nvme_path": str(path)}}


def test_missing_swap_dir_is_created_private(tmp_path):
    swap = tmp_path / "not" / "yet"
    model, optimizer = infinity.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8)), _config(swap))
    try:
        assert swap.is_dir() and stat.S_IMODE(os.stat(swap).st_mode) == 0o700
        assert any(swap.iterdir())      # the store's swap file lives there
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
    finally:
        infinity.engine_of(model).close()


def test_swap_dir_that_cannot_be_made_names_path_and_cause(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")    # a path under a regular file fails even as root
    with pytest.raises(StoreError, match=rf"tiers.nvme_path {blocker}/swap: cannot create the swap directory: "
                                         "Not a directory"):
        infinity.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8)), _config(blocker / "swap"))
    with pytest.raises(StoreError, match=rf"tiers.nvme_path {blocker}: exists but is not a directory"):
        infinity.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8)), _config(blocker))


def test_ranks_racing_to_make_one_swap_dir_all_succeed(tmp_path):
    """Ranks sharing tiers.nvme_path create it at once: none may see the others' fresh directory as an error."""
    import threading

    from infinity.store.swap_dir import make_swap_dir

    for trial in range(50):
        path = tmp_path / f"race{trial}" / "swap"
        barrier, errors = threading.Barrier(4), []

        def rank():
            barrier.wait()
            try:
                make_swap_dir(path)
            except Exception as e:   # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=rank) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert path.is_dir()
