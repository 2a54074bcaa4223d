"""Where the ranks come from, and how they stop.

- ``nproc == 1``: this process is the only rank (no ``torch.distributed``);
- ``nproc > 1``: that many local ranks are spawned (gloo on CPU, NCCL on CUDA,
  a free TCP port on localhost) and waited for; the first to fail ends the run
  and the others are killed rather than left in a collective;
- under ``torchrun`` (``WORLD_SIZE`` and ``RANK`` set): this process is one rank
  of the launcher's group; multi-node is torchrun's job. Each rank keeps its
  swap files in a run directory of its own under its node's swap directory,
  and first removes those of ranks that died there (a lost node's ranks that
  torchrun restarts find and remove their predecessors' files).

Stopping: the first SIGINT (Ctrl-C) or SIGTERM (a scheduler, ``kill``, a
container stop) asks every rank to stop after the step it is in: the launcher
forwards it to its ranks through a shared stop event (a rank sent the signal
itself sets the same event), and the ranks agree on it in the per-step
all-reduce that averages the loss (see :mod:`infinity.train.loop`), so none is
left waiting in a collective. Each rank then saves (when there is a save
directory) and closes its engine, and the launcher removes the run's swap
directory; the exit code is 128 + the signal (130, 143). A second signal stops
at once (spawned ranks are killed; the swap directory is still removed).
Spawned ranks die with their launcher (:mod:`infinity.train.parent_watch`),
so a launcher killed with SIGKILL leaves no rank training unsupervised.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from infinity.comm.watchdog import PeerFailed
from infinity.store.run_lock import RunLock, remove_stale_runs
from infinity.train.errors import RankError, StoppedAtOnce, TrainError
from infinity.train.loop import run_rank
from infinity.train.options import TrainOptions, TrainResult
from infinity.train.parent_watch import die_with_parent
from infinity.train.resolve import TrainRun, check_int, prepare_swap_dir, resolve, under_torchrun, with_swap_dir

__all__ = ["train", "launch"]

# How long spawned ranks get to finish their step and close after a stop before they are killed.
_STOP_GRACE_S = 60.0
# After a rank died without a word, how long a report it queued just before dying may take to arrive.
_FAILURE_GRACE_S = 2.0


def train(options: TrainOptions | None = None) -> TrainResult:
    """Validate ``options``, start the ranks, train, clean up; rank 0's :class:`TrainResult`.

    Raises :class:`TrainError` for bad input (before anything starts) and
    :class:`RankError` when a rank fails. ``result.interrupted`` is True when a
    SIGINT or SIGTERM stopped the run early (``result.stop_signal`` says which).
    """
    options = options or TrainOptions()
    if under_torchrun():
        if options.nproc != 1:
            raise TrainError(f"--nproc {options.nproc}: under torchrun the ranks are torchrun's "
                             "(--nproc_per_node); drop --nproc")
        world_size = int(os.environ["WORLD_SIZE"])
        run = resolve(options, world_size)
        run_lock = None
        if run.swap_dir is not None:
            prepare_swap_dir(run.swap_dir)   # every rank checks its own node's disk
            # ranks killed on this node before (a lost node's, ones torchrun restarts) left their swap files in
            # run directories whose locks died with them: removed here, by the ranks that start next on this
            # node; each rank keeps its own files in a run directory of its own, removed when it ends
            _say_removed(remove_stale_runs(run.swap_dir)[0], run.swap_dir)
            run_lock = RunLock(run.swap_dir)
            run = with_swap_dir(run, str(run_lock.path))
        try:
            # torchrun answers its own SIGINT by sending the workers SIGTERM: both mean "stop after this step"
            stopper = _StopOnSignal(threading.Event())
            with stopper as stop:
                return stopper.stamp(run_rank(run, int(os.environ["RANK"]), world_size, stop))
        finally:
            if run_lock is not None:
                run_lock.release()
    nproc = check_int("--nproc", options.nproc, 1)
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():   # CUDA-only: one device per rank
        raise TrainError(f"--nproc {nproc}: only {torch.cuda.device_count()} CUDA device(s) here, one per rank")
    return launch(resolve(options, nproc), nproc)


def launch(run: TrainRun, nproc: int) -> TrainResult:
    """Run ``run`` on ``nproc`` local ranks in a swap directory of its own, removed afterwards."""
    run_lock = None
    if run.swap_dir is not None:
        prepare_swap_dir(run.swap_dir)
        removed, _ = remove_stale_runs(run.swap_dir)   # those of live owners (other jobs) are left alone
        _say_removed(removed, run.swap_dir)
        # a directory per run: two runs sharing a swap dir must not meet in each other's files
        run_lock = RunLock(run.swap_dir)
        run = with_swap_dir(run, str(run_lock.path))
    try:
        if nproc == 1:
            threads = torch.get_num_threads()
            torch.set_num_threads(_threads_per_rank(1))
            try:
                stopper = _StopOnSignal(threading.Event())
                with stopper as stop:
                    return stopper.stamp(run_rank(run, 0, 1, stop))
            finally:
                torch.set_num_threads(threads)
        return _spawn(run, nproc)
    finally:
        if run_lock is not None:
            # the engine closes its own files; this also covers ranks that were killed mid-write
            run_lock.release()


def _say_removed(removed: list, swap_dir: str) -> None:
    if removed:
        print(f"infinity train: removed {len(removed)} swap run director{'y' if len(removed) == 1 else 'ies'} "
              f"of dead runs under {swap_dir}", file=sys.stderr)


def _threads_per_rank(nproc: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nproc)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _StopOnSignal:
    """While active, the first of ``signals`` sets ``event`` (stop after this step); the next raises
    :class:`StoppedAtOnce` (stop now). ``signum`` is the first signal that came."""

    def __init__(self, event, signals=_STOP_SIGNALS):
        self.event, self.signals = event, signals
        self.signum: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise StoppedAtOnce(signum)
        self.signum = signum
        self.event.set()

    def stamp(self, result: TrainResult) -> TrainResult:
        """``result`` with the signal that stopped it (when one did and the result does not say)."""
        if result.stop_signal is None and result.interrupted:
            result.stop_signal = self.signum
        return result

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():   # signal handlers live on the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self.event

    def __exit__(self, *exc):
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        return False


# ---------------------------------------------------------------- spawned ranks

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank_fn, run: TrainRun, rank: int, world_size: int, port: int, stop, reports,
                launcher_pid: int) -> None:
    die_with_parent(launcher_pid)   # a killed launcher must not leave this rank training unsupervised
    _name_process(f"infinity-rank{rank}")
    # The terminal's Ctrl-C reaches the whole process group; the parent turns it into `stop`,
    # which every rank honours at the same step. A rank interrupted alone would hang the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM sent to the rank itself (a whole process group stopped) means the same: stop after this step.
    # The handler only sets a local flag: setting the shared event takes a lock the interrupted main thread
    # may hold (in stop.is_set()), which would deadlock
    signalled = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: signalled.set())
    stop = _EitherStop(stop, signalled)
    torch.set_num_threads(_threads_per_rank(world_size))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        result = rank_fn(run, rank, world_size, stop)
        reports.put(("done", rank, result))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent, or it waits for nothing
        import traceback
        line = (str(e).strip().splitlines() or [""])[0]
        if not isinstance(e, (RankError, PeerFailed)):   # these already say what went wrong, and where
            line = f"rank {rank} failed: {type(e).__name__}" + (f": {line}" if line else "")
        reports.put(("error", rank, line, traceback.format_exc()))
        # flush the report before the process group goes down below: the other ranks fail once our
        # sockets close, and their (secondary) errors must not reach the parent ahead of this one
        reports.close()
        reports.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _name_process(name: str) -> None:
    """What ``ps``/``top`` show for this process (Linux: PR_SET_NAME, 15 bytes): which rank is which."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):
            pass


class _EitherStop:
    """A stop request from the launcher (shared) or from a signal this rank got (local)."""

    def __init__(self, shared, local):
        self.shared, self.local = shared, local

    def is_set(self) -> bool:
        return self.local.is_set() or self.shared.is_set()


def _spawn(run: TrainRun, nproc: int, rank_fn=None) -> TrainResult:
    """Start ``nproc`` ranks running ``rank_fn`` (default: the training loop); rank 0's result.

    The first rank to fail (or to die without a report) ends the run: the
    others are killed rather than left waiting for it in a collective.
    """
    ctx = mp.get_context("spawn")   # fork would copy this process's torch threads and locks
    stop, reports = ctx.Event(), ctx.Queue()
    port = _free_port()
    rank_fn = rank_fn or run_rank
    procs = [ctx.Process(target=_rank_entry, args=(rank_fn, run, r, nproc, port, stop, reports, os.getpid()),
                         daemon=True, name=f"infinity-rank{r}") for r in range(nproc)]
    results: dict = {}
    failure = None
    deadline = None
    # the handler sets a local event; the loop forwards it to the ranks' shared one (setting that from a
    # handler could deadlock on the lock the interrupted stop.is_set() holds)
    stopper = _StopOnSignal(threading.Event())
    try:
        with stopper as signalled:
            for p in procs:
                p.start()
            while len(results) < nproc and failure is None:
                if signalled.is_set() and not stop.is_set():
                    stop.set()
                if stop.is_set() and deadline is None:
                    deadline = time.monotonic() + _STOP_GRACE_S
                if deadline is not None and time.monotonic() > deadline:
                    raise KeyboardInterrupt
                msg = _get_or_none(reports, 0.2)
                if msg is None:
                    dead = next((r for r, p in enumerate(procs)
                                 if r not in results and p.exitcode not in (None, 0)), None)
                    if dead is None:
                        continue
                    # a report the dead rank queued just before it exited may still be in the pipe
                    msg = _get_or_none(reports, _FAILURE_GRACE_S)
                    if msg is None:
                        failure = RankError(f"rank {dead} exited with code {procs[dead].exitcode} "
                                            "before reporting (killed, or out of memory?)")
                        break
                kind, rank = msg[0], msg[1]
                if kind == "done":
                    results[rank] = msg[2]
                else:
                    failure = RankError(f"{msg[2]}{_killed_note(procs, rank)}", msg[3])
    except KeyboardInterrupt as e:
        _kill(procs)
        return TrainResult(0, nproc, True, {"steps": None, "killed": True},
                           stop_signal=getattr(e, "signum", None) or stopper.signum or signal.SIGINT)
    finally:
        _kill(procs)   # after a failure the others may sit in a collective the failed rank will never join
    if failure is not None:
        raise failure
    if results[0].interrupted and results[0].stop_signal is None:   # a rank signalled alone says SIGTERM
        results[0].stop_signal = stopper.signum or signal.SIGTERM
    return results[0]


def _killed_note(procs, reporting_rank: int) -> str:
    """Ranks a signal took (the OOM killer, say) while another reported the collective they broke."""
    killed = [f"rank {r} was killed by signal {-p.exitcode}" for r, p in enumerate(procs)
              if r != reporting_rank and p.exitcode is not None and p.exitcode < 0]
    return f" ({', '.join(killed)} first)" if killed else ""


def _get_or_none(q, timeout_s: float):
    try:
        return q.get(timeout=timeout_s)
    except queue.Empty:
        return None


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
