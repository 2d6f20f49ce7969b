"""ZeRO stage 2 through FSDP2 (``fully_shard``) over the whole dp x sp mesh; stage 3 inside
the compiled graph (:mod:`autosp.transform.zero.gather`).

* stage 2: parameters are gathered when the step's forward begins and stay gathered through
  the backward (``reshard_after_forward=False``); gradients are reduce-scattered and the
  optimizer states live on each rank's shard: between steps a rank holds 1/N of parameters,
  gradients and optimizer states.
* stage 3: parameters are gathered per transformer block inside the graph, where they are
  read, and gathered again for the backward (:mod:`autosp.transform.zero.gather`).

One FSDP unit, the root, for stage 2: it holds every parameter gathered through the step
anyway, and FSDP's hooks are hidden from torch.compile (``torch._dynamo.disable``), so a unit
per transformer block would cut the compiled graph at every block (7 graphs for a 2-layer
Llama, its MLPs unsharded on every rank).

Inside autosp's graphs each rank back-propagates its own tokens and, with data parallelism,
its own batch, against a loss normalised by the global token count: each gradient is a
partial sum. FSDP's reduce-scatter over the whole mesh therefore has to *sum*, not average:
its divide factor is 1, with plain sum reductions (gloo has no pre-scaled sum). The SP sum
and the DP sum are that one reduce-scatter.
"""
from __future__ import annotations

import torch.nn as nn

from autosp.errors import AutospError
from autosp.transform.mesh import Mesh, flat_device_mesh
from autosp.transform.zero.gather import shard_in_graph


def shard_parameters(model: nn.Module, mesh: Mesh, stage: int, shard_ranks: int = 0) -> list[str]:
    """Shard ``model`` in place for ZeRO ``stage`` (2: FSDP2, 3: in the graph), summing gradients.
    ``shard_ranks`` (stage 3): 0 shards over the whole mesh; k shards over each k consecutive ranks
    (a node) and replicates across them (HSDP). Returns the groups stage 3's collectives use."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if stage == 3:
        flat = flat_device_mesh(mesh)
        if shard_ranks and shard_ranks != flat.size():
            if shard_ranks < 1 or flat.size() % shard_ranks:
                raise AutospError(f"zero_shard={shard_ranks} does not divide the mesh's {flat.size()} ranks; shard "
                                  f"over a divisor of {flat.size()} (a node's devices), or zero_shard='mesh'")
            flat = DeviceMesh(flat.device_type, flat.mesh.reshape(-1, shard_ranks),
                              mesh_dim_names=("replicate", "shard"))
        shard_in_graph(model, flat)
        if flat.ndim == 2:
            return [flat["shard"].get_group().group_name, flat["replicate"].get_group().group_name]
        return [flat.get_group().group_name]
    if shard_ranks:
        raise AutospError(f"Zero(shard=...) applies to stage 3 (HSDP); stage {stage} shards over the whole mesh")
    fully_shard(model, mesh=flat_device_mesh(mesh), reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return []
