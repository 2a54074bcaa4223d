"""Which ranks share a node, as the launcher placed them.

Every rank says which node it is on, once, in an ``all_gather_object`` over
its group, and :class:`NodeLayout` is what they said. A rank's node is:

- ``GROUP_RANK`` under ``torchrun`` (the index of the node's agent among the
  nodes; with ``--node-rank`` it is that number);
- else ``SLURM_NODEID`` under SLURM's ``srun``;
- else this machine's host name (one machine, whatever spawned the ranks).

The host name alone is not enough where nodes are containers or network
namespaces of one machine (they share it), which is why the launcher's word
comes first. ZeRO++'s node groups (hpZ, qgZ) and the intra- / cross-node byte
split are built from this layout, and a node-local checkpoint is written by
each node's ranks into that node's own directory.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

__all__ = ["NodeLayout", "node_key", "gather_node_layout"]


def node_key() -> str:
    """This process's node, as the launcher (or the host) names it."""
    if os.environ.get("GROUP_RANK", "") != "":
        return f"torchrun node {os.environ['GROUP_RANK']}"
    if os.environ.get("SLURM_NODEID", "") != "":
        return f"slurm node {os.environ['SLURM_NODEID']}"
    return f"host {socket.gethostname()}"


@dataclass(frozen=True)
class NodeLayout:
    """``node_of[r]``: the node (0, 1, ... in order of first appearance) of group rank ``r``; ``keys``: each
    node's name; ``addresses``: each node's network addresses (what a peer's socket error names)."""

    node_of: tuple
    keys: tuple
    addresses: tuple = ()

    @property
    def nodes(self) -> list:
        """The group ranks of each node, in node order."""
        out = [[] for _ in self.keys]
        for r, n in enumerate(self.node_of):
            out[n].append(r)
        return out

    @property
    def ranks_per_node(self) -> int | None:
        """Ranks a node when every node holds the same number of consecutive ranks (as torchrun numbers
        them), else None."""
        nodes = self.nodes
        size = len(nodes[0])
        if any(len(n) != size for n in nodes):
            return None
        return size if all(n == list(range(i * size, (i + 1) * size)) for i, n in enumerate(nodes)) else None

    def leader(self, rank: int) -> int:
        """The lowest rank on ``rank``'s node (the one that writes what a node writes once)."""
        return self.nodes[self.node_of[rank]][0]

    def peer_names(self, members: list) -> dict:
        """Each address of a node -> ``"torchrun node 1: ranks 2, 3"`` (``members``: the group's global ranks)."""
        out = {}
        for n, (key, ranks) in enumerate(zip(self.keys, self.nodes)):
            for addr in (self.addresses[n] if n < len(self.addresses) else ()):
                out[addr] = f"{key}: ranks {', '.join(str(members[r]) for r in ranks)}"
        return out

    def describe(self) -> str:
        """One line for errors: each node's name and its ranks."""
        return "; ".join(f"{k}: ranks {', '.join(map(str, ranks))}" for k, ranks in zip(self.keys, self.nodes))


def gather_node_layout(coll) -> NodeLayout:
    """Every member of ``coll`` says its :func:`node_key`; the layout they make (every rank gets the same)."""
    said = coll.all_gather_object((node_key(), _addresses()))
    order: dict = {}
    node_of = tuple(order.setdefault(k, len(order)) for k, _ in said)
    addresses = [set() for _ in order]
    for (_, addrs), n in zip(said, node_of):
        addresses[n].update(addrs)
    return NodeLayout(node_of, tuple(order), tuple(tuple(sorted(a)) for a in addresses))


def _addresses() -> tuple:
    """This machine's (this network namespace's) non-loopback IP addresses; () where they cannot be listed."""
    try:
        import psutil
        listed = psutil.net_if_addrs()
    except Exception:   # noqa: BLE001 - only used to name a peer in an error message
        return ()
    out = set()
    for entries in listed.values():
        for a in entries:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                addr = a.address.split("%")[0]
                try:
                    if not ipaddress.ip_address(addr).is_loopback:
                        out.add(addr)
                except ValueError:
                    pass
    return tuple(sorted(out))
