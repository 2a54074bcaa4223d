"""A world of N real processes (gloo), started once and reused for many cases.

Starting a rank costs seconds (importing torch), so ranks are forked from one
fork server that imported torch once for the session, and a :class:`World` keeps
its ranks alive and runs one case after another in them: ``world.run(fn, *args)``
sends the picklable top-level function ``fn`` to every rank, runs it there
(with ``torch.distributed`` initialized, one thread: ``torch.set_num_threads(1)``,
``OMP_NUM_THREADS=1``) and
returns the list of per-rank results. A rank that raises comes back as a
:class:`RankFailure` carrying that rank's traceback; a rank that does not answer
within the timeout is killed, and the whole world is restarted on the next
``run`` (a failed collective leaves the process group unusable).

Use it through a module-scoped fixture, one world per size::

    @pytest.fixture(scope="module")
    def world2(tmp_path_factory):
        with World(2, tmp_path_factory.mktemp("world2")) as w:
            yield w
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

__all__ = ["World", "RankFailure"]

# After one rank fails, how long the others get to report before they are
# presumed stuck in a collective the failed rank will never join.
_GRACE_AFTER_FAILURE_S = 10.0


class RankFailure(AssertionError):
    """One or more ranks raised or hung; the message holds each rank's traceback."""


def _rank_main(rank: int, world_size: int, init_file: str, sys_path: list, conn) -> None:
    sys.path[:] = sys_path  # so the parent's test modules (tests/) import by the same names
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # and OMP_NUM_THREADS says so to libraries that set torch's threads from it (accelerate sets 2 when it
    # is unset): ranks sharing a small machine's cores then do not spin against each other
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


# What the fork server imports once, so that no rank imports it again: torch, and the transformers
# modules the Hugging Face cases use (seconds each, in every rank of every world that builds one).
_PRELOAD = ["torch", "torch.distributed", "world", "transformers", "transformers.trainer",
            "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"]


def _context():
    """The start method for ranks: a fork server that has imported torch (and ``_PRELOAD``) once.

    Each spawned rank would import torch afresh (seconds on a small machine, for every rank of
    every world); the fork server imports it once for the whole test session and forks each rank
    from there, so a rank still starts as a fresh process with nothing of the parent's state.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class World:
    def __init__(self, world_size: int, tmp_dir, timeout_s: float = 120.0):
        self.world_size = world_size
        self.tmp_dir = Path(tmp_dir)
        self.timeout_s = timeout_s
        self._procs: list = []
        self._conns: list = []
        self._generation = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.close()
        self._generation += 1
        init_file = self.tmp_dir / f"init-{self._generation}"
        ctx = _context()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, self.world_size, str(init_file), list(sys.path), child),
                            name=f"world{self.world_size}-rank{rank}", daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._collect("start the process group")

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ running cases

    def run(self, fn, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; the per-rank return values, in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.start()
        for c in self._conns:
            c.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", repr(fn)), timeout_s or self.timeout_s)

    def _collect(self, what: str, timeout_s: float | None = None) -> list:
        timeout_s = timeout_s or self.timeout_s
        results: dict = {}
        errors: dict = {}
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < self.world_size and time.monotonic() < deadline:
            for rank, c in enumerate(self._conns):
                if rank in results or rank in errors:
                    continue
                if c.poll(0.02):
                    try:
                        kind, value = c.recv()
                    except EOFError:
                        kind, value = "error", f"rank {rank} exited (code {self._procs[rank].exitcode})"
                    if kind == "error":
                        errors[rank] = value
                        deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
                    else:
                        results[rank] = value
                elif not self._procs[rank].is_alive() and not c.poll(0):
                    errors[rank] = f"rank {rank} died (exit code {self._procs[rank].exitcode})"
        if errors or len(results) < self.world_size:
            hung = [r for r in range(self.world_size) if r not in results and r not in errors]
            for r in hung:   # it reads no message, so close() would wait its 5 s for nothing
                self._procs[r].kill()
            self.close()  # the process group is unusable now; the next run() starts a fresh world
            parts = [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
            parts += [f"--- rank {r} gave no answer within {timeout_s:.0f}s (killed)" for r in hung]
            raise RankFailure(f"{what} failed in a world of {self.world_size}:\n" + "\n".join(parts))
        return [results[r] for r in range(self.world_size)]
