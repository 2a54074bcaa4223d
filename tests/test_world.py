"""The multi-rank harness: results in rank order, a rank's exception comes back with its traceback,
a hung rank is killed after the timeout, and the world restarts for the next case."""

from __future__ import annotations

import time

import pytest

from world import RankFailure, World


def rank_and_size():
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size(), __import__("torch").get_num_threads()


def fail_on_rank_one():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise KeyError("boom from rank one")
    return "fine"


def hang_on_rank_one():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(3600)
    return "fine"


def test_world_runs_cases_and_reports_failures(tmp_path):
    with World(2, tmp_path, timeout_s=60) as world:
        assert world.run(rank_and_size) == [(0, 2, 1), (1, 2, 1)]
        with pytest.raises(RankFailure, match=r"(?s)rank 1 raised:.*KeyError: 'boom from rank one'"):
            world.run(fail_on_rank_one)
        assert world.run(rank_and_size) == [(0, 2, 1), (1, 2, 1)]  # restarted
        with pytest.raises(RankFailure, match="rank 1 gave no answer within 3s"):
            world.run(hang_on_rank_one, timeout_s=3)
        assert world.run(rank_and_size)[1] == (1, 2, 1)
