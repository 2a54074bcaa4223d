"""One rank of a two-process job whose rank 1 finds its disk full at step 1 (see tests/comm/test_peer_failure.py).

Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set and the swap root as argv[1]. Trains with every
shard on NVMe; prints one JSON line (the error it stopped with, and seconds since rank 1's disk filled) and
exits, as a job's rank does on an error.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402

import infinity  # noqa: E402
from failure_cases import build_net, local_ids, make_config, wait_store_idle  # noqa: E402
from infinity.comm.watchdog import failures_told_to_peers, watch  # noqa: E402


def main() -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])   # initialize makes the group
    model, opt = infinity.initialize(build_net(), make_config("nvme", sys.argv[1], world=world, rank=rank))
    engine = infinity.engine_of(model)
    filled_at = None
    try:
        with failures_told_to_peers():
            for step in range(3):
                ids = local_ids(step)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                if step == 1:
                    filled_at = time.time()
                    if rank == 1:   # every write from now on: the disk is full (this rank's only)
                        wait_store_idle(engine.store, engine.grads)
                        engine.store._engine.syscalls.inject("pwritev", errno.ENOSPC, count=10**6)
                opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                with watch("the loss all_reduce"):
                    dist.all_reduce(total)
        return {"rank": rank, "error": None}
    except Exception as e:   # noqa: BLE001 - what each rank stopped with is the result
        return {"rank": rank, "error": type(e).__name__, "message": (str(e).splitlines() or [""])[0],
                "filled_at": filled_at, "stopped_at": time.time()}
    finally:
        engine.close()


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
    os._exit(0)   # at once, as a failed job's rank: its sockets close, the peers' waits end
