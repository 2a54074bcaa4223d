"""Which collective a rank is stuck in, and which ranks it waits for.

Without this, a rank that hangs (SIGSTOP, a stuck driver, swapping) leaves
the others blocked in a collective in silence until torch's timeout, and
the error then names a socket, not the collective. Every blocking
collective runs inside :func:`watch` (``Collectives`` does it for the
engine's; the training loop for its own). A daemon thread looks at what
this rank waits in:

- past half of ``dist.warn_after_s`` it publishes "rank r waits in
  collective #n" to the process group's key-value store; past all of it, it
  reads the other ranks' entries and logs one line: the collective, how long,
  and the ranks that are not waiting in it (they have not arrived; a rank
  that came less than half the threshold before is counted as arrived);
- the process group's own timeout (``dist.timeout_s``, given to
  ``init_process_group``) makes the blocked call raise; :func:`watch` turns
  that into :class:`CollectiveTimeout`, one line naming the collective and
  the ranks that had not arrived, so every waiting rank fails with the same
  kind of message instead of a socket error;
- a backend that never raises (NCCL can hang for good) is ended by the
  thread itself at twice the timeout: it prints that line and exits the
  process (exit code 124), which the launcher reports.

A rank that fails on its own (ENOSPC or EIO on its disk only) would leave
the others waiting for it the same way. :func:`failures_told_to_peers`
(around a rank's whole run) publishes its error to the store; when the
failed rank's process exits (a job's rank does, on its error) its sockets
close and the others' pending collective fails at once; :func:`watch` then
finds the published error and raises it there too, as :class:`PeerFailed`
with the failed rank's own message: every rank stops within seconds, each
with the same cause. (Destroying the failed rank's process group instead of
waiting for its exit would not do: gloo keeps a group's sockets open while
anything still references the group.) A failed rank that lingers is named
by the watchdog's warning line.

Collectives are counted per process in call order, which is the same on
every rank for the collectives every rank joins, so "#n" names the same call
everywhere (where sub-groups' members issue different numbers of calls the
counts can drift apart, and "not arrived" is then approximate; the
collective named is always this rank's own).
Publishing goes to the store only once a wait is already long: a healthy
step never touches it. When the store itself does not answer (it lives in
rank 0, which may be the stuck one, or on torchrun's first node, which a
downed link cuts off) the line says the ranks are unknown: every question to
the store is bounded, so a rank cut off from it still raises its error and
still reaches the hard exit.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["CollectiveTimeout", "PeerFailed", "install", "uninstall", "watch", "installed",
           "failures_told_to_peers", "set_peer_names"]

_KEY = "infinity/collective_wait/{rank}"
_FAILED_KEY = "infinity/failed/{rank}"
_HARD_EXIT_CODE = 124


class CollectiveTimeout(RuntimeError):
    """A collective waited past ``dist.timeout_s``; the message names it and the ranks that had not arrived."""


class PeerFailed(RuntimeError):
    """Another rank failed (its message is this one's) while this one waited for it in a collective."""


@dataclass
class _Wait:
    seq: int
    what: str
    since: float
    published: bool = False
    warned: bool = False
    missing: str = "unknown"   # the ranks not waiting in it, as the watchdog last saw them


class _Watchdog:
    def __init__(self, rank: int, world_size: int, timeout_s: float, warn_after_s: float, store=None,
                 log=None, hard_exit: bool = True):
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.warn_after_s = timeout_s, warn_after_s
        self.store = store
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.hard_exit = hard_exit
        self.seq = 0
        self.current: _Wait | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="infinity-collective-watchdog")
        self._thread.start()

    # ---------------------------------------------------------------- the blocked thread's side

    def enter(self, what: str) -> _Wait:
        with self._lock:
            self.seq += 1
            self.current = _Wait(self.seq, what, time.monotonic())
            return self.current

    def leave(self, wait: _Wait) -> None:
        with self._lock:
            if self.current is wait:
                self.current = None

    def describe(self, wait: _Wait, waited_s: float) -> str:
        return (f"{wait.what} (collective #{wait.seq}) waited {waited_s:.0f} s for the other "
                f"ranks (dist.timeout_s {self.timeout_s:g}); not arrived: {wait.missing}. A rank is stopped, hung "
                "or dead; its own log says why")

    # ---------------------------------------------------------------- the watchdog thread

    def _run(self) -> None:
        tick_s = max(0.05, min(1.0, self.warn_after_s / 4))
        while not self._closed.wait(tick_s):
            with self._lock:
                wait = self.current
            if wait is None:
                continue
            waited = time.monotonic() - wait.since
            if waited >= self.warn_after_s / 2 and not wait.published:
                wait.published = True
                self._publish(wait)
            if waited >= self.warn_after_s and not wait.warned:
                wait.warned = True
                wait.missing = self._not_arrived(wait)
                told = self.peer_failure()
                self.log(f"infinity: rank {self.rank} has waited {waited:.0f} s in {wait.what} "
                         f"(collective #{wait.seq}); not arrived: {wait.missing}" + (f"; {told}" if told else ""))
            if self.hard_exit and waited >= 2 * self.timeout_s:
                self.log(f"infinity: rank {self.rank}: {self.describe(wait, waited)}; exiting (the backend did not "
                         "time out)")
                os._exit(_HARD_EXIT_CODE)

    def _publish(self, wait: _Wait) -> None:
        if self.store is not None and self.world_size > 1:
            # a store that does not answer is reported when reading
            _ask_store(lambda: self.store.set(_KEY.format(rank=self.rank), str(wait.seq)))

    def _not_arrived(self, wait: _Wait) -> str:
        """Ranks that are not waiting in this collective, from the store; 'unknown' if it does not answer."""
        if self.store is None or self.world_size == 1:
            return "unknown"

        def read():
            keys = [_KEY.format(rank=r) for r in range(self.world_size)]
            present = [r for r, k in enumerate(keys) if r != self.rank and self.store.check([k])]
            return dict(zip(present, (int(self.store.get(keys[r])) for r in present)))
        seqs = _ask_store(read)
        if seqs is None:   # the store lives with rank 0 (or torchrun's first node): stuck, or out of reach
            return ("unknown (the process group's store does not answer: rank 0, or the link to the node that "
                    "holds the store, may be the problem)")
        missing = [r for r in range(self.world_size) if r != self.rank and seqs.get(r, 0) < wait.seq]
        return "ranks " + ", ".join(map(str, missing)) if missing else "none (every rank waits: a backend stall)"

    def announce(self, message: str) -> None:
        """Tell the other ranks why this one fails (best effort: the store may be gone too)."""
        if self.store is not None and self.world_size > 1:
            # the peers then see the collective fail, without the why
            _ask_store(lambda: self.store.set(_FAILED_KEY.format(rank=self.rank), message))

    def peer_failure(self) -> str | None:
        """The lowest failed rank's published message, ``"rank r failed: ..."``; None if none was published
        (or the store does not answer)."""
        if self.store is None or self.world_size == 1:
            return None

        def read():
            for r in range(self.world_size):
                key = _FAILED_KEY.format(rank=r)
                if r != self.rank and self.store.check([key]):
                    return f"rank {r} failed: {self.store.get(key).decode()}"
            return None
        return _ask_store(read)

    def close(self) -> None:
        self._closed.set()


# How long one question to the store may take. A healthy store answers in milliseconds; one that has not
# answered in this long is unreachable (its node lost, the link down) or stuck, and a rank waiting on it would
# never reach its error or the hard exit below. Giving up early costs only a less informative message.
_STORE_ANSWER_S = 5.0


def _ask_store(question):
    """``question()`` (store calls), on a helper thread so a store that never answers cannot hold this one;
    its answer, or None when it raised or did not answer within :data:`_STORE_ANSWER_S`."""
    answer: list = []

    def ask():
        try:
            answer.append(question())
        except Exception:   # noqa: BLE001 - no store, no answer
            pass
    helper = threading.Thread(target=ask, daemon=True, name="infinity-store-question")
    helper.start()
    helper.join(_STORE_ANSWER_S)   # a helper still blocked is left behind: a daemon, it ends with the process
    return answer[0] if answer else None


_WATCHDOG: _Watchdog | None = None
# a peer's network address -> its node and ranks (infinity.comm.node_layout): names the peer a socket error
# gives only as an address
_PEER_NAMES: dict = {}


def set_peer_names(names: dict) -> None:
    """``{address: "torchrun node 1: ranks 2, 3"}``, for naming a rank whose connection closed."""
    _PEER_NAMES.update(names)


def _peer_named(text: str) -> str:
    """The peer gloo's error names (``[10.77.0.2]:41235``), with its node and ranks when known."""
    m = re.search(r"\[([0-9A-Fa-f:.]+)\]:(\d+)", text)
    if m is None:
        return "a rank"
    addr = m.group(1)
    known = _PEER_NAMES.get(addr)
    return f"the rank at {addr}:{m.group(2)}" + (f" ({known})" if known else "")


def install(rank: int, world_size: int, timeout_s: float, warn_after_s: float, store=None, log=None,
            hard_exit: bool = True) -> None:
    """Watch this process's collectives from now on (replacing an earlier watchdog)."""
    global _WATCHDOG
    uninstall()
    _WATCHDOG = _Watchdog(rank, world_size, timeout_s, warn_after_s, store, log, hard_exit)


def uninstall() -> None:
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.close()
        _WATCHDOG = None


def installed() -> bool:
    return _WATCHDOG is not None


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _is_peer_gone(e: BaseException) -> bool:
    """gloo's words for a peer whose process exited (or was killed) under a collective."""
    text = str(e).lower()
    return any(w in text for w in ("connection closed by peer", "connection reset by peer", "broken pipe"))


@contextmanager
def watch(what: str) -> Iterator[None]:
    """Run a blocking collective named ``what``; a timeout in it raises :class:`CollectiveTimeout`."""
    dog = _WATCHDOG
    if dog is None:
        yield
        return
    wait = dog.enter(what)
    try:
        yield
    except RuntimeError as e:   # DistBackendError is a RuntimeError
        if isinstance(e, (CollectiveTimeout, PeerFailed)):
            raise
        told = dog.peer_failure()   # a peer that failed alone closed its sockets: say why it did
        if told is not None:
            raise PeerFailed(f"{told} (this rank, {dog.rank}, was waiting for it in {what})") from e
        if _is_peer_gone(e):
            raise PeerFailed(f"{_peer_named(str(e))} exited while this one ({dog.rank}) waited for it in {what} "
                             f"(collective #{wait.seq}): it was killed or died without a word (the OOM killer, "
                             "a lost node?); the launcher or that rank's own log says which") from e
        if not _is_timeout(e):
            raise
        waited = time.monotonic() - wait.since
        # (the store is not asked from here: it may be in the stuck rank, and would block this one as long again)
        raise CollectiveTimeout(dog.describe(wait, waited)) from e
    finally:
        dog.leave(wait)


@contextmanager
def failures_told_to_peers() -> Iterator[None]:
    """Around a rank's run: if it raises, the other ranks learn why (see the module doc)."""
    try:
        yield
    except BaseException as e:
        dog = _WATCHDOG
        if dog is not None and not isinstance(e, PeerFailed):   # a PeerFailed is theirs, already told
            line = (str(e).strip().splitlines() or [""])[0]
            dog.announce(f"{type(e).__name__}: {line}" if line else type(e).__name__)
        raise
