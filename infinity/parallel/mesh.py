"""The 2-D device mesh ``("dp", "tp")`` that ZeRO x tensor parallelism runs on.

``parallel.tensor = T`` cuts a world of ``W`` ranks into ``W / T`` data-parallel
rows of ``T`` adjacent ranks (global rank ``g = dp_rank * T + tp_rank``), as
torchrun numbers the ranks of one node consecutively: tensor parallelism, whose
activation all-reduces sit on the critical path of every layer, stays on the
fast intra-node links, and ZeRO's collectives (the ``dp`` sub-group) are the
only ones that cross nodes. The mesh is PyTorch's own
:class:`~torch.distributed.device_mesh.DeviceMesh`; its sub-groups are what the
engine's collectives and the tensor-parallel layers run on.

Creating a mesh creates process groups (a collective over the whole world), so
meshes are kept per (default group, shape) and reused: a process that builds
many engines (tests, notebooks) does not leak a pair of groups per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ParallelMesh", "build_mesh"]

_MESHES: dict = {}


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's place in the ``(dp, tp)`` mesh and its two sub-groups (None at tp = 1)."""

    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    world_rank: int
    device_mesh: object = None     # torch.distributed.device_mesh.DeviceMesh, or None when not distributed
    tp_group: object = None
    dp_group: object = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size


def build_mesh(tensor: int, device_type: str = "cpu") -> ParallelMesh:
    """The mesh for ``parallel.tensor = tensor`` in the current world (raises naming the fix if impossible)."""
    up = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if up else 1
    if tensor < 1:
        raise ValueError(f"parallel.tensor: expected an integer >= 1, got {tensor}")
    if world % tensor:
        raise ValueError(
            f"parallel.tensor: {tensor} does not divide the world size {world} (data parallel = world / tensor); "
            f"start a multiple of {tensor} ranks, or set parallel.tensor to a divisor of {world}")
    rank = dist.get_rank() if up else 0
    if tensor == 1 or not up:
        return ParallelMesh(tp_size=1, dp_size=world, tp_rank=0, dp_rank=rank, world_rank=rank)
    key = (id(dist.group.WORLD), world, tensor, device_type)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh
        _MESHES[key] = init_device_mesh(device_type, (world // tensor, tensor), mesh_dim_names=("dp", "tp"))
    mesh = _MESHES[key]
    tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp")
    if rank != dp_rank * tensor + tp_rank:   # the layout every other part (checkpoints, estimate) assumes
        raise RuntimeError(f"device mesh: rank {rank} is at dp {dp_rank}, tp {tp_rank}; expected tensor-parallel "
                           "ranks to be adjacent (rank = dp * tensor + tp)")
    return ParallelMesh(tp_size=tensor, dp_size=world // tensor, tp_rank=tp_rank, dp_rank=dp_rank, world_rank=rank,
                        device_mesh=mesh, tp_group=mesh.get_group("tp"), dp_group=mesh.get_group("dp"))

