"""The device mesh autosp trains on: ``("dp", "sp")``, or ``("sp",)`` alone, and either with a
tensor-parallel ``"tp"`` dimension innermost (``("sp", "tp")``, ``("dp", "sp", "tp")``).

Sequence parallelism runs inside each ``"sp"`` row of the mesh (every rank of a row
holds the same batch and a slice of its tokens); data parallelism runs across rows
(each row its own batch). Where autosp reduces gradients itself (``zero_stage``), the
loss and the token statistics are made global over the *whole* mesh, so a step equals
one process on the concatenated global batch, and parameter gradients are summed over
the whole mesh once, in buckets (:mod:`autosp.transform.zero.grad_reducer`): the SP sum and
the DP sum are one reduction. With a ``"tp"`` dimension, "the whole mesh" is the ranks of one TP
rank (``dp`` x ``sp``): each TP rank holds its own shard of the split weights
(:mod:`autosp.transform.tensor_parallel`), reduced over the ranks that hold the same shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autosp.errors import AutospError



@dataclass
class Mesh:
    sp: dist.ProcessGroup            # this rank's sequence-parallel group
    whole: dist.ProcessGroup         # every rank of the mesh (dp x sp): the loss's and gradients' group
    sp_degree: int
    dp_degree: int
    device_mesh: DeviceMesh | None = None     # the dp x sp part (without "tp")
    tp: dist.ProcessGroup | None = None       # this rank's tensor-parallel group
    tp_degree: int = 1


def mesh_from(mesh: DeviceMesh) -> Mesh:
    """Check a user's mesh and take its groups: 1-D (SP only) or 2-D with an ``"sp"`` dimension,
    each with a ``"tp"`` dimension innermost or without."""
    names = mesh.mesh_dim_names
    if names and names[-1] == "tp" and mesh.ndim > 1:
        if names not in (("sp", "tp"), ("dp", "sp", "tp")):
            raise AutospError(f"mesh dimensions {names}: autosp reads ('dp', 'sp', 'tp') or ('sp', 'tp'), TP "
                              "innermost (its ranks consecutive, inside a node); name them so")
        rest = mesh[names[:-1]] if len(names) > 2 else mesh["sp"]
        inner = mesh_from(rest)
        inner.tp, inner.tp_degree = mesh["tp"].get_group(), mesh["tp"].size()
        return inner
    if names and "tp" in names:
        raise AutospError(f"mesh dimensions {names}: the 'tp' dimension goes innermost, beside 'sp' "
                          "(('dp', 'sp', 'tp') or ('sp', 'tp'))")
    if mesh.ndim == 1:
        if names not in (None, ("sp",)):
            raise AutospError(f"a 1-D mesh is the SP group; name its dimension 'sp', not {names[0]!r}")
        group = mesh.get_group()
        return Mesh(sp=group, whole=group, sp_degree=mesh.size(), dp_degree=1, device_mesh=mesh)
    if mesh.ndim != 2 or names is None or "sp" not in names:
        raise AutospError(f"the mesh has dimensions {names or mesh.ndim}; autosp needs one named 'sp' (and "
                          "'dp' beside it), e.g. init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'sp'))")
    if names != ("dp", "sp"):
        raise AutospError(f"mesh dimensions {names}: autosp reads ('dp', 'sp'), SP innermost (its ranks "
                          "consecutive, so they share a node); name them so")
    return Mesh(sp=mesh["sp"].get_group(), whole=_flat_group(mesh), sp_degree=mesh["sp"].size(),
                dp_degree=mesh["dp"].size(), device_mesh=mesh)


def mesh_for(sp_size: int | None, tp_size: int = 1) -> Mesh:
    """The mesh ``sp_size`` asks for: consecutive groups of ``sp_size`` ranks, data parallel across
    (with ``tp_size`` > 1: TP groups of consecutive ranks innermost, SP across them)."""
    world = dist.get_world_size()
    if tp_size > 1:
        sp = sp_size or world // tp_size
        if world % (sp * tp_size):
            raise AutospError(f"SP {sp} x TP {tp_size} does not divide the world size {world}")
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return mesh_from(init_device_mesh(device, (world // (sp * tp_size), sp, tp_size),
                                          mesh_dim_names=("dp", "sp", "tp")))
    sp = world if sp_size is None else sp_size
    if sp <= 0 or world % sp:
        raise AutospError(f"an SP degree of {sp_size} (mesh={sp_size}) does not divide the world size {world}; "
                          f"pick a divisor of {world}")
    if sp == world:
        return Mesh(sp=dist.group.WORLD, whole=dist.group.WORLD, sp_degree=world, dp_degree=1)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return mesh_from(init_device_mesh(device, (world // sp, sp), mesh_dim_names=("dp", "sp")))


def flat_device_mesh(mesh: Mesh) -> DeviceMesh:
    """The whole mesh as one 1-D device mesh (what FSDP shards over)."""
    if mesh.device_mesh is None or mesh.device_mesh.ndim == 1:
        if mesh.device_mesh is not None:
            return mesh.device_mesh
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh.device_mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("sp",))
        return mesh.device_mesh
    return mesh.device_mesh._flatten("dp_sp")


def _flat_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One group over every rank of the mesh (the world when the mesh spans it)."""
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten("dp_sp").get_group()
