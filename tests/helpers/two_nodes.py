"""Two "nodes" on one machine: network namespaces joined by a veth link, ``torchrun`` started in each.

:class:`TwoNodes` makes two network namespaces with names unique to this
process (``infn-<pid>-<n>-a`` / ``-b``), a veth pair between them with the
addresses of a private /30 (``10.77.0.1`` and ``10.77.0.2``, which exist only
inside those namespaces: nothing outside them is ever addressed), optionally
a rate (``tc tbf``) and a one-way delay (``tc netem``) on each end, and a
directory per node for its swap files, checkpoints and logs (no file system
is "shared" by convention: each node's command gets its own ``{node_dir}``).

:meth:`TwoNodes.run` starts ``torchrun --nnodes 2 --nproc-per-node N`` once
in each namespace (static rendezvous on node 0's address, or c10d with node 0
hosting the store), waits for both within a bounded time (killing both when it
runs out), and returns each node's exit code and log and the bytes that
crossed the link (the veth's kernel counters, both directions, headers and
the rendezvous included). gloo is pinned to the veth (``GLOO_SOCKET_IFNAME``),
so ranks on one node talk inside their namespace and only cross-node traffic
crosses the link.

Cleanup always runs: on ``close()`` / leaving the ``with`` block, and at
interpreter exit (``atexit``) if neither happened: every process started in
the namespaces is killed, the namespaces (and with them the veth pair and its
qdiscs) are deleted, and the node directories are removed unless
``keep_files`` (a test under pytest's ``tmp_path`` keeps them for pytest).

Needs root and iproute2 (``ip netns``); :func:`unavailable_reason` says why
not in one line, for a test to skip with. ``tools/two_nodes.py`` is the same
harness on the command line.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TwoNodes", "Node", "Job", "JobResult", "HarnessError", "unavailable_reason", "ADDRESSES"]

ADDRESSES = ("10.77.0.1", "10.77.0.2")   # a private /30, used only inside the two namespaces
PREFIX_LEN = 30
_IP_TIMEOUT_S = 20.0          # one `ip` / `tc` call
_KILL_WAIT_S = 10.0           # after SIGKILL, how long a process group may take to go
_SEQ = itertools.count()
REPO = Path(__file__).resolve().parents[2]


class HarnessError(RuntimeError):
    """The namespaces, the link or a launch could not be set up; the message says which command and why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except FileNotFoundError:
        raise HarnessError("`ip` (iproute2) is not installed") from None
    except subprocess.TimeoutExpired:
        raise HarnessError(f"`ip {' '.join(args)}` did not return within {_IP_TIMEOUT_S:g} s") from None
    if check and proc.returncode != 0:
        raise HarnessError(f"`ip {' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def unavailable_reason() -> str | None:
    """None if this process can make network namespaces and veth pairs; else one line saying why not."""
    if shutil.which("ip") is None:
        return "two-node harness: `ip` (iproute2) is not installed"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "two-node harness: needs root for `ip netns` (running as uid %d)" % os.geteuid()
    probe = f"infn-{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except HarnessError as e:
        return f"two-node harness: cannot create a network namespace ({e})"
    try:
        _ip("link", "add", "infnprobe0", "netns", probe, "type", "veth", "peer", "name", "infnprobe1",
            "netns", probe)
    except HarnessError as e:
        return f"two-node harness: cannot create a veth pair ({e})"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _rate_bytes_s(rate: str) -> float:
    """tc's rate syntax (``1gbit``, ``500mbit``, ``100kbit``, ``10mbps``) in bytes per second."""
    r = rate.strip().lower()
    units = [("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("kbit", 1e3 / 8), ("bit", 1 / 8),
             ("gbps", 1e9), ("mbps", 1e6), ("kbps", 1e3), ("bps", 1.0)]
    for suffix, scale in units:
        if r.endswith(suffix):
            try:
                return float(r[:-len(suffix)]) * scale
            except ValueError:
                break
    raise HarnessError(f"rate {rate!r}: not a tc rate (e.g. 1gbit, 500mbit)")


@dataclass
class Node:
    index: int
    netns: str
    dev: str
    addr: str
    dir: Path


@dataclass
class JobResult:
    """What one two-node launch did: per node its exit code (None: killed at the timeout) and log."""

    returncodes: list
    logs: list
    elapsed_s: float
    link_bytes: dict            # {"a_to_b": n, "b_to_a": n, "total": n}: veth tx counters, this run only
    timed_out: bool
    killed_ranks: list = field(default_factory=list)   # (node, pids) the caller killed mid-run

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def describe(self, tail_chars: int = 4000) -> str:
        """For an assertion message: each node's exit code and the tail of its log."""
        parts = [f"two-node run: exit codes {self.returncodes}" + (" (timed out)" if self.timed_out else "")]
        for i, log in enumerate(self.logs):
            parts.append(f"--- node {i} log (last {tail_chars} chars):\n{log[-tail_chars:]}")
        return "\n".join(parts)


class Job:
    """One ``torchrun`` per node, started by :meth:`TwoNodes.launch`; wait on it or kill one node's ranks."""

    def __init__(self, harness: "TwoNodes", procs: list, log_paths: list, before: dict):
        self.harness, self.procs, self.log_paths, self._before = harness, procs, log_paths, before
        self.started = time.monotonic()
        self.killed: list = []

    def rank_pids(self, node: int) -> list:
        """The worker processes (ranks) of node ``node``'s torchrun agent, now."""
        import psutil
        try:
            return [c.pid for c in psutil.Process(self.procs[node].pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []

    def kill_ranks(self, node: int, sig: int = signal.SIGKILL) -> list:
        """Send ``sig`` to node ``node``'s ranks (not to its agent, which may restart them); their pids."""
        pids = self.rank_pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        self.killed.append((node, pids))
        return pids

    def wait(self, timeout_s: float) -> JobResult:
        """Both nodes' exit codes and logs; at ``timeout_s`` (from the launch) both are killed."""
        deadline = self.started + timeout_s
        timed_out = False
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            self.kill()
        elapsed = time.monotonic() - self.started
        after = self.harness.link_counters()
        logs = [Path(p).read_text(errors="replace") if Path(p).exists() else "" for p in self.log_paths]
        codes = [None if timed_out and p.returncode in (None, -signal.SIGKILL) else p.returncode for p in self.procs]
        return JobResult(codes, logs, elapsed, _delta(self._before, after), timed_out, list(self.killed))

    def kill(self) -> None:
        """SIGKILL both nodes' process groups (agents and ranks) and reap them."""
        for p in self.procs:
            _kill_group(p)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)   # its own session (start_new_session): the agent and its ranks
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


def _delta(before: dict, after: dict) -> dict:
    a_to_b = after["a_tx"] - before["a_tx"]
    b_to_a = after["b_tx"] - before["b_tx"]
    return {"a_to_b": a_to_b, "b_to_a": b_to_a, "total": a_to_b + b_to_a}


class TwoNodes:
    """Two network namespaces, a veth link between them, a directory per node; see the module doc.

    ``root``: where the node directories go (a new temporary directory if None, removed at the end).
    ``rate``: tc rate of each direction (``"1gbit"``), None for the veth's own speed.
    ``delay_ms``: one-way delay added on each end (netem), None for none.
    ``keep_files``: leave the node directories under ``root`` (pytest's ``tmp_path`` cleans them).
    """

    def __init__(self, root=None, rate: str | None = None, delay_ms: float | None = None, keep_files: bool = False):
        self.rate, self.delay_ms = rate, delay_ms
        if rate is not None:
            _rate_bytes_s(rate)   # refused before anything is made
        if delay_ms is not None and not delay_ms > 0:
            raise HarnessError(f"delay_ms {delay_ms!r}: give a positive number of milliseconds, or None")
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="infn-two-nodes-")) if root is None else Path(root)
        self.keep_files = keep_files and not self._own_root
        tag = f"{os.getpid()}-{next(_SEQ)}"
        self.nodes = [Node(i, f"infn-{tag}-{side}", f"infn{tag.replace('-', 'x')}{side}"[-15:], ADDRESSES[i],
                           self.root / f"node{i}") for i, side in enumerate("ab")]
        self._made: list = []    # namespaces created so far (deleted by close)
        self._jobs: list = []
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self) -> "TwoNodes":
        atexit.register(self.close)   # a process that never reaches close() still removes what it made
        try:
            for n in self.nodes:
                _ip("netns", "add", n.netns)
                self._made.append(n.netns)
            a, b = self.nodes
            # made inside the namespaces directly: the pair never has a name in this machine's own namespace
            _ip("link", "add", a.dev, "netns", a.netns, "type", "veth", "peer", "name", b.dev, "netns", b.netns)
            for n in self.nodes:
                _ip("-n", n.netns, "addr", "add", f"{n.addr}/{PREFIX_LEN}", "dev", n.dev)
                _ip("-n", n.netns, "link", "set", "lo", "up")
                _ip("-n", n.netns, "link", "set", n.dev, "up")
                self._shape(n)
                n.dir.mkdir(parents=True, exist_ok=True)
        except BaseException:
            self.close()
            raise
        return self

    def _shape(self, n: Node) -> None:
        """Rate and delay on this end's egress: each direction of the link is shaped once."""
        if self.rate is None and self.delay_ms is None:
            return
        tc = ["netns", "exec", n.netns, "tc", "qdisc", "add", "dev", n.dev, "root"]
        if self.delay_ms is not None:
            rate = ["rate", self.rate] if self.rate is not None else []
            proc = _ip(*tc, "netem", "delay", f"{self.delay_ms}ms", *rate, "limit", "100000", check=False)
            if proc.returncode != 0:
                err = (proc.stderr or proc.stdout).strip()
                why = " (this kernel has no netem: CONFIG_NET_SCH_NETEM)" if "unknown" in err.lower() else ""
                raise HarnessError(f"tc netem delay {self.delay_ms} ms on {n.dev}: {err}{why}; run without a delay")
            return
        # burst: at least one jiffy's worth at the rate (tbf needs rate / HZ), and 64 KiB for a GSO packet
        burst = max(64 * 1024, int(_rate_bytes_s(self.rate) / 250))
        _ip(*tc, "tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms")

    def close(self) -> None:
        """Kill every process started in the namespaces, delete them (the link goes with them), remove files."""
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:   # noqa: BLE001 - interpreter shutting down
            pass
        for job in self._jobs:
            job.kill()
        for ns in self._made:
            # anything still running in there (a rank its agent lost track of) holds the namespace
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self._made = []
        if not self.keep_files:
            for n in self.nodes:
                shutil.rmtree(n.dir, ignore_errors=True)
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ the link

    def link_counters(self) -> dict:
        """Bytes each end of the veth has sent so far (kernel counters): ``{"a_tx", "b_tx"}``."""
        out = {}
        for n, key in zip(self.nodes, ("a_tx", "b_tx")):
            stats = json.loads(_ip("-n", n.netns, "-s", "-j", "link", "show", "dev", n.dev).stdout)[0]["stats64"]
            out[key] = int(stats["tx"]["bytes"])
        return out

    def set_link(self, up: bool) -> None:
        """Take the link down (both ends lose carrier: packets are dropped, no connection is reset) or up."""
        _ip("-n", self.nodes[0].netns, "link", "set", "dev", self.nodes[0].dev, "up" if up else "down")

    # ------------------------------------------------------------ launching

    def launch(self, command, nproc_per_node: int = 2, rendezvous: str = "static", max_restarts: int = 0,
               env: dict | None = None, port: int = 29500, python: str = sys.executable) -> Job:
        """Start ``torchrun ... <command>`` in both namespaces; ``command`` is a list (``str.format``-ed per node
        with ``node``, ``node_dir``, ``addr``) or a function of the :class:`Node` returning the list."""
        if self._closed or len(self._made) != 2:
            raise HarnessError("launch: the namespaces are not up (call start() or use `with TwoNodes(...)`)")
        if rendezvous not in ("static", "c10d"):
            raise HarnessError(f"rendezvous {rendezvous!r}: static or c10d")
        master = self.nodes[0].addr
        before = self.link_counters()
        procs, logs = [], []
        run_id = f"infn{os.getpid()}x{len(self._jobs)}"
        try:
            for n in self.nodes:
                argv = command(n) if callable(command) else [str(c).format(node=n.index, node_dir=n.dir, addr=n.addr)
                                                            for c in command]
                launcher = [python, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                            str(nproc_per_node), "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
                            # the address the other node reaches this one at: the hostname need not resolve there
                            "--local-addr", n.addr]
                if rendezvous == "static":
                    launcher += ["--node-rank", str(n.index), "--master-addr", master, "--master-port", str(port)]
                else:   # c10d: node 0 hosts the store; said explicitly, as its hostname need not resolve here
                    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{port}", "--rdzv-id", run_id,
                                 "--rdzv-conf", f"is_host={int(n.index == 0)}"]
                node_env = dict(os.environ, **(env or {}))
                node_env.update(GLOO_SOCKET_IFNAME=n.dev, INFINITY_NODE_DIR=str(n.dir),
                                PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(REPO),
                                                            node_env.get("PYTHONPATH", "")]))
                node_env.setdefault("OMP_NUM_THREADS", "1")
                log = n.dir / f"torchrun-{len(self._jobs)}.log"
                logs.append(log)
                with open(log, "wb") as f:
                    procs.append(subprocess.Popen(["ip", "netns", "exec", n.netns, *launcher, *argv],
                                                  stdout=f, stderr=subprocess.STDOUT, env=node_env,
                                                  cwd=str(n.dir), start_new_session=True))
        except BaseException:
            for p in procs:
                _kill_group(p)
            raise
        job = Job(self, procs, logs, before)
        self._jobs.append(job)
        return job

    def run(self, command, timeout_s: float, **launch_kw) -> JobResult:
        """:meth:`launch` and wait (bounded by ``timeout_s``: both nodes are killed when it runs out)."""
        return self.launch(command, **launch_kw).wait(timeout_s)
