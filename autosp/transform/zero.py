"""ZeRO stages 2 and 3 through FSDP2 (``fully_shard``) over the whole dp x sp mesh.

* stage 2: parameters are gathered when the step's forward begins and stay gathered through
  the backward (``reshard_after_forward=False``); gradients are reduce-scattered and the
  optimizer states live on each rank's shard: between steps a rank holds 1/N of parameters,
  gradients and optimizer states.
* stage 3: the same, but parameters are freed after the forward and gathered again for the
  backward (``reshard_after_forward=True``).

One FSDP unit, the root, for both. FSDP's hooks are hidden from torch.compile
(``torch._dynamo.disable``), so a unit per transformer block would cut the compiled graph
at every block; the break sits inside the model's loop over its layers, so torch.compile
would run that loop eagerly and compile each layer's pieces apart (7 graphs for a 2-layer
Llama, its MLPs unsharded on every rank). Per-block units therefore wait for FSDP hooks
that compile; with one unit the whole model stays one sharded graph.

Inside autosp's graphs each rank back-propagates its own tokens and, with data parallelism,
its own batch, against a loss normalised by the global token count: each gradient is a
partial sum. FSDP's reduce-scatter over the whole mesh therefore has to *sum*, not average:
its divide factor is 1, with plain sum reductions (gloo has no pre-scaled sum). The SP sum
and the DP sum are that one reduce-scatter.
"""
from __future__ import annotations

import torch.nn as nn

from autosp.transform.mesh import Mesh, flat_device_mesh


def shard_parameters(model: nn.Module, mesh: Mesh, stage: int) -> None:
    """Apply FSDP2 to ``model`` in place for ZeRO ``stage`` (2 or 3), summing gradients."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    fully_shard(model, mesh=flat_device_mesh(mesh), reshard_after_forward=stage == 3)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
