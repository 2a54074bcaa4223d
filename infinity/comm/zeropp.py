"""ZeRO++ (Wang et al. 2023): less stage-3 traffic across nodes, three independent switches.

ZeRO-3 moves about 3Ψ a step (forward all-gather, backward all-gather,
gradient reduce-scatter), most of it across the slow links between nodes.
:class:`ZeroPlusPlus` is how the one gather path (:mod:`infinity.zero.gathers`)
and the one reduction path (:mod:`infinity.zero.grads`) move a unit when
``zeropp`` asks for it:

- **qwZ** (``quantize_weights``): a parameter all-gather sends each rank's
  shard as int8 with an fp32 scale per block (:mod:`infinity.comm.quantize`)
  and every rank dequantizes the rows into the unit's full buffer in the
  compute dtype. Only the gathered copy is approximate: the stored shard, the
  fp32 master and Adam's moments are never quantized (so it works the same
  with host or NVMe offload).
- **hpZ** (``hierarchical_partition``): when a unit is released after its
  forward, this rank keeps its slice of the gathered buffer, one of
  ``ranks_per_node`` (the *secondary shard*), until the end of backward; the
  backward all-gather then runs inside the node, over the mesh's ``local``
  group, from those slices. The forward's values are reused, so with qwZ the
  backward sees exactly the weights the forward did. Cost: Ψ·bytes/ranks_per_node
  per rank from forward to the end of backward (``resident_bytes()["secondary_params"]``);
  it is not under ``prefetch.max_live_bytes``, which caps full buffers.
- **qgZ** (``quantize_grads``): a unit's gradient reduce-scatter becomes two
  all-to-alls of block-quantized rows (int8 or int4): inside the node first
  (each rank receives, for the chunks its ``local`` index will carry across
  nodes, every node-mate's values; it dequantizes and sums them in fp32), then
  across nodes between ranks of equal local index (the node sums, quantized
  again, dequantized and summed). Every value is quantized exactly twice, so
  the error does not grow with the number of ranks, as it would if partial
  sums were re-quantized at every hop of a ring; across nodes only the node
  sums travel, ``1/ranks_per_node`` of a flat reduce-scatter's cross-node bytes
  before quantization. The result is averaged and folded into the gradient
  shard in ``precision.reduce_dtype`` as before.

A non-finite value (a diverged loss) is not an error here: one rank raising
while the others wait in the collective would hang them all. Its block
travels with a NaN scale and comes back NaN on every rank, as an unquantized
collective would spread it.

The groups come from a 2-D :class:`torch.distributed.device_mesh.DeviceMesh`
``(node, local)`` = (world / ranks_per_node, ranks_per_node); consecutive
ranks share a node, as torchrun numbers them. Where each rank really is comes
from the launcher (:mod:`infinity.comm.node_layout`: torchrun's
``GROUP_RANK``, SLURM's node id, else the host name): ``ranks_per_node: auto``
is a node's rank count there, and a number that would make a group span two
nodes is refused. On one machine 4 ranks with ``ranks_per_node: 2`` run as 2
"nodes" x 2, and the byte counters say which bytes would have crossed a node
(:mod:`infinity.comm.collectives`).
"""

from __future__ import annotations

import contextlib

import torch

from infinity.config import ConfigError, ZeroPPConfig
from infinity.comm import watchdog
from infinity.comm.node_layout import NodeLayout, gather_node_layout
from infinity.comm.quantize import BlockQuantizer
from infinity.comm.unit_collectives import UnitCollectives

__all__ = ["ZeroPlusPlus", "resolve_ranks_per_node", "set_node_layout"]


def resolve_ranks_per_node(value, world_size: int, layout: NodeLayout | None = None) -> int:
    """``zeropp.ranks_per_node`` for this world, checked against where the launcher put the ranks.

    ``layout``: every rank's node (:func:`~infinity.comm.node_layout.gather_node_layout`); None at world
    size 1. auto = the ranks a node holds there. A number must divide them: ranks of one group then always
    share a node, and a smaller number splits a node into several (one machine standing in for several
    nodes). A group that would span two nodes, or nodes that do not hold equal runs of consecutive ranks
    (what ZeRO++'s ``(node, local)`` mesh needs), is refused naming the layout.
    """
    if world_size == 1 or layout is None:
        return 1 if world_size == 1 else (world_size if value == "auto" else value)
    real = layout.ranks_per_node
    if real is None:
        raise ConfigError(f"zeropp: the launcher did not give every node the same number of consecutive ranks "
                          f"({layout.describe()}); ZeRO++'s node groups need equal blocks of consecutive ranks "
                          "(torchrun with the same --nproc-per-node on every node)")
    if value == "auto":
        return real
    if world_size % value:
        raise ConfigError(f"zeropp.ranks_per_node: {value} does not divide the world size {world_size}; "
                          "every node must hold the same number of ranks")
    if real % value:
        raise ConfigError(f"zeropp.ranks_per_node: {value}, but the launcher put {real} ranks on each node "
                          f"({layout.describe()}); a group of {value} would span nodes. Use auto, or a divisor "
                          f"of {real}")
    return value


def set_node_layout(cfg: ZeroPPConfig, coll) -> int:
    """Give ``coll``'s byte counters the node layout, whether or not a ZeRO++ switch is on; returns the ranks
    per node (``zeropp.ranks_per_node`` resolved against the launcher's layout).

    An explicit number smaller than a real node's rank count counts its blocks as nodes (one machine
    standing in for several); otherwise the counters follow the real layout, whatever its shape."""
    if coll.world_size == 1:
        return 1
    layout = gather_node_layout(coll)
    watchdog.set_peer_names(layout.peer_names(coll.members))   # a lost peer is then named by node and ranks
    node_of = {coll.members[r]: n for r, n in enumerate(layout.node_of)}
    if layout.ranks_per_node is None and not (cfg.hierarchical_partition or cfg.quantize_grads):
        coll.set_nodes(node_of, None)   # uneven nodes: counted as they are; no node groups are built
        return coll.world_size if cfg.ranks_per_node == "auto" else cfg.ranks_per_node
    ranks_per_node = resolve_ranks_per_node(cfg.ranks_per_node, coll.world_size, layout)
    if ranks_per_node == layout.ranks_per_node:
        coll.set_nodes(node_of, ranks_per_node)
    else:
        coll.set_ranks_per_node(ranks_per_node)
    return ranks_per_node


class ZeroPlusPlus(UnitCollectives):
    """ZeRO++'s per-unit collectives: the quantizers, the node mesh groups and the secondary shards.

    The same interface as the plain :class:`~infinity.comm.unit_collectives.UnitCollectives`; the
    engine builds this one when a ``zeropp`` switch is on. ``shard_params``: stage 3 (qwZ and hpZ
    act on parameter gathers); ``sharded``: stages 1-3 (qgZ acts on the reduce-scatter).
    """

    def __init__(self, cfg: ZeroPPConfig, coll, shard_params: bool, sharded: bool):
        super().__init__(coll)
        self.cfg = cfg
        self.world_size = coll.world_size
        self.ranks_per_node = set_node_layout(cfg, coll)
        self.nodes = self.world_size // self.ranks_per_node
        self.local_rank = coll.rank % self.ranks_per_node
        self.quantize_weights = cfg.quantize_weights and shard_params
        self.hierarchical = cfg.hierarchical_partition and shard_params
        self.quantize_grads = cfg.quantize_grads and sharded and self.world_size > 1
        self.weights_q = BlockQuantizer(8, cfg.block_numel) if self.quantize_weights else None
        self.grads_q = BlockQuantizer(cfg.grad_bits, cfg.block_numel) if self.quantize_grads else None
        self.intra = self.cross = None
        if (self.hierarchical or self.quantize_grads) and self.world_size > 1:
            if coll.members != list(range(self.world_size)):
                raise ConfigError("zeropp.hierarchical_partition / quantize_grads: the data-parallel group is not "
                                  "the whole world (tensor parallelism?); ZeRO++'s node mesh is built over the "
                                  "world only, so turn these off with tensor parallelism")
            self.intra, self.cross = _mesh_groups(coll, self.nodes, self.ranks_per_node)
        self._secondary: dict = {}   # unit index -> this rank's 1/ranks_per_node slice of its gathered params
        self._exact = False          # inside exact_gathers(): no quantization

    # ------------------------------------------------------------ the parameter all-gather (qwZ, hpZ)

    def all_gather(self, unit, full: torch.Tensor, src: torch.Tensor):
        """Launch ``unit``'s all-gather into ``full`` (its storage allocated); a Pending. From the secondary
        shard inside the node if there is one (hpZ, backward), else from ``src`` across the world, quantized
        with qwZ, plain otherwise."""
        secondary = self._secondary.get(unit.index) if self.has_secondary(unit.index) else None
        if secondary is not None:
            # the all-gather writes the buffer behind autograd's back (see UnitCollectives.all_gather)
            with torch.autograd._unsafe_preserve_version_counter(full):
                return self.intra.all_gather(full, secondary, async_op=True)
        if not self.quantize_weights or self._exact:
            return super().all_gather(unit, full, src)
        q, n, numel = self.weights_q, self.world_size, src.numel()
        row = q.quantize(src, what=f"parameter shard of unit {unit.name}", nonfinite="propagate")
        rows = torch.empty(n, row.numel(), dtype=torch.uint8, device=row.device)

        def dequantize(rows=rows, row=row):   # `row` held until the send is done
            with torch.autograd._unsafe_preserve_version_counter(full):
                q.dequantize(rows, numel, out=full.view(n, numel))
        return self.coll.all_gather(rows.view(-1), row, async_op=True, then=dequantize)

    @contextlib.contextmanager
    def exact_gathers(self):
        """Gathers started inside are not quantized (``engine.gathered()``: weights for a user's eyes)."""
        self._exact, before = True, self._exact
        try:
            yield
        finally:
            self._exact = before

    def keep_secondary(self, unit) -> None:
        """hpZ: ``unit``'s forward is done and it is about to be released: keep this rank's slice of the
        gathered buffer for the backward all-gather (the root unit is never released, so never kept)."""
        if not self.hierarchical or self.intra is None:
            return
        slice_numel = unit.padded_numel // self.ranks_per_node
        lo = self.local_rank * slice_numel
        self._secondary[unit.index] = unit.full_param[lo:lo + slice_numel].clone()

    def has_secondary(self, unit_index: int) -> bool:
        """hpZ: the unit's next gather runs inside the node (its stored shard need not be read); not
        inside :meth:`exact_gathers` (with qwZ the secondary shards hold the forward's quantized values)."""
        return not self._exact and unit_index in self._secondary

    def drop_secondaries(self) -> None:
        """The backward is over (or abandoned): the next step's weights differ, the slices are stale."""
        self._secondary.clear()

    def resident_bytes(self) -> dict:
        """With hpZ: ``{"secondary_params": bytes}`` held now; else nothing."""
        if not self.hierarchical:
            return {}
        return {"secondary_params": sum(t.numel() * t.element_size() for t in self._secondary.values())}

    # ------------------------------------------------------------ the gradient reduce-scatter (qgZ)

    def reduce_scatter(self, unit, out: torch.Tensor, full: torch.Tensor, then):
        """``out`` <- this rank's shard of the mean over ranks of ``full`` (qgZ, see the module doc); a
        Pending-like object whose ``wait`` finishes both levels and then runs ``then``. Plain without qgZ."""
        if not self.quantize_grads:
            return super().reduce_scatter(unit, out, full, then)
        return _HierarchicalReduce(self, unit.name, out, full, then)

    @property
    def reduces_in_place(self) -> bool:
        return super().reduces_in_place and not self.quantize_grads

    @property
    def gathers_in_place(self) -> bool:
        return super().gathers_in_place and not self.quantize_weights


class _HierarchicalReduce:
    """qgZ's two all-to-alls for one unit: the intra-node one is launched now, the cross-node one when
    this is waited on (it needs the node sums); every rank waits in the same order, so every rank
    issues the same sequence of collectives on each group."""

    def __init__(self, pp: ZeroPlusPlus, name: str, out: torch.Tensor, full: torch.Tensor, then):
        self.pp, self.name, self.out, self.then = pp, name, out, then
        m, k, shard = pp.nodes, pp.ranks_per_node, out.numel()
        # chunk c of the flat gradient belongs to rank c = node * k + local; this rank's local index
        # carries the chunks (node', local) of every node' across: group them by local index
        self.by_local = full.view(m, k, shard).transpose(0, 1).reshape(k, m * shard)
        self.pending = None
        if k > 1:
            send = pp.grads_q.quantize(self.by_local, what=f"gradient of unit {name}", nonfinite="propagate")
            self.recv = torch.empty_like(send)
            self.send = send   # held until the all-to-all is done
            self.pending = pp.intra.all_to_all(self.recv, send, async_op=True)
            self.by_local = None   # quantized: the copy is not needed any more

    def wait(self) -> None:
        if self.pp is None:
            return
        pp, out = self.pp, self.out
        m, shard = pp.nodes, out.numel()
        if self.pending is not None:
            self.pending.wait()
            node_sum = pp.grads_q.dequantize(self.recv, m * shard).sum(dim=0)   # fp32 [m * shard]
        else:
            node_sum = self.by_local[0].float()
        if m > 1:
            send = pp.grads_q.quantize(node_sum.view(m, shard), what=f"node-summed gradient of unit {self.name}",
                                       nonfinite="propagate")
            recv = torch.empty_like(send)
            pp.cross.all_to_all(recv, send)
            total = pp.grads_q.dequantize(recv, shard).sum(dim=0)
        else:
            total = node_sum
        out.copy_(total.div_(pp.world_size))
        self.pp = self.by_local = self.send = self.recv = None
        then = self.then
        if then is not None:
            then()


def _mesh_groups(coll, nodes: int, ranks_per_node: int):
    """(intra-node, cross-node) collectives from a (node, local) DeviceMesh over the world."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if coll.backend == "nccl" else "cpu"   # CUDA-only: NCCL meshes live on cuda
    mesh = init_device_mesh(device_type, (nodes, ranks_per_node), mesh_dim_names=("node", "local"))
    return coll.subgroup(mesh.get_group("local")), coll.subgroup(mesh.get_group("node"))
