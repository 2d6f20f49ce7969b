"""Build the SP model ``autosp.compile`` returns, from typed decisions and options.

The front door (:mod:`autosp.front`) turns the user's arguments into
:class:`autosp.decisions.Decisions`, :class:`autosp.options.Zero` and
:class:`autosp.options.Runtime`; here they become a configuration: the mesh (SP groups, data
parallel across), the ZeRO sharding, the graphs' compiler. The module returned,
:class:`autosp.transform.sequence_parallel.SequenceParallel`, does what must happen outside the
graph at each call; the graph rewrite itself lives in :mod:`autosp.transform.sharding`.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autosp.decisions import Decisions, check_zero_stage
from autosp.errors import AutospError
from autosp.options import Runtime, Zero
from autosp.planner.plan import Plan
from autosp.strategies import AUTO, check_spec, resolve
from autosp.transform.backend import SPConfig, check_compiler, default_compiler
from autosp.transform.zero.grad_reducer import GradReducer
from autosp.transform.mesh import Mesh, mesh_for, mesh_from
from autosp.graph.hf_compat import is_hf_model
from autosp.transform.sequence_parallel import SequenceParallel, layer_paths, layout_for
from autosp.transform.tensor_parallel import TPReport, parallelize
from autosp.transform.zero.shard import shard_parameters

__all__ = ["SequenceParallel", "build"]


def build(model: nn.Module, decisions: Decisions, *, mesh: DeviceMesh | dist.ProcessGroup | int | None = None,
          zero: Zero = Zero(), runtime: Runtime = Runtime(), plan: Plan | None = None,
          provider: Callable | None = None, may_step_on_host: bool = False) -> nn.Module:
    """Wrap ``model`` for SP training as ``decisions`` say (``autosp.compile`` is the front door:
    it turns its arguments into these). ``plan``: a saved plan, whose decisions (SP degree, ZeRO
    stage unless ``zero.stage`` is given) apply as they are; ``provider``: plans at the first call
    of each batch shape (:class:`autosp.autoplan.AutoPlanner`), whose plans then run in place of
    ``decisions``; ``may_step_on_host``: whether such a plan may keep the optimizer on the host."""
    sp_size = mesh if isinstance(mesh, int) and not isinstance(mesh, bool) else None
    group = mesh if isinstance(mesh, dist.ProcessGroup) else None
    device_mesh = mesh if isinstance(mesh, DeviceMesh) else None
    if mesh is not None and sp_size is None and group is None and device_mesh is None:
        raise AutospError(f"mesh must be a DeviceMesh, a ProcessGroup or an SP degree (int), not {type(mesh).__name__}")
    if plan is not None:
        if dist.is_available() and dist.is_initialized():
            plan.check(world_size=dist.get_world_size())
            _check_plan_placement(plan)
        decisions = plan.decisions()
        planned_sp = plan.mesh.sp_degree
        sp_size = planned_sp if (planned_sp > 1 or plan.mesh.tp_degree > 1) and device_mesh is None \
            and group is None else sp_size
    # the ZeRO decisions, resolved once: the caller's, else those the decisions (a plan) carry
    zero_stage = zero.stage if zero.stage is not None else decisions.mesh.zero_stage
    zero_shard = (decisions.mesh.zero_shard or "mesh") if zero.shard == "mesh" else zero.shard
    for c in decisions.layers:
        check_spec(c.strategy)
    if not runtime.overlap:
        decisions = without_overlap(decisions)
    check_zero_stage(zero_stage)
    if zero_stage is not None and not runtime.reduce_grads:
        raise AutospError(f"zero={zero_stage} has autosp reduce the gradients over the mesh; "
                          "runtime=autosp.Runtime(reduce_grads=False) "
                          "(the caller reduces them) contradicts it: pass one of the two")
    layout = layout_for([c.strategy for c in decisions.layers], decisions.mesh.layout)
    compiler = check_compiler(runtime.compiler if runtime.compiler is not None else default_compiler())
    if not dist.is_available() or not dist.is_initialized():
        if mesh is not None:
            raise AutospError(f"mesh={mesh!r} needs torch.distributed initialised: call "
                              "torch.distributed.init_process_group() first, e.g. under torchrun")
        return model            # nothing to split (the front door says so)
    planned_tp = decisions.mesh.tp_degree
    if device_mesh is not None:
        the_mesh = mesh_from(device_mesh)
    elif group is not None:
        the_mesh = Mesh(sp=group, whole=group, sp_degree=dist.get_world_size(group), dp_degree=1)
    else:
        the_mesh = mesh_for(sp_size, planned_tp)
    tp_report = _tensor_parallel(model, the_mesh, planned_tp, zero_stage)
    decisions = replace(decisions, mesh=replace(decisions.mesh, layout=layout, sp_degree=the_mesh.sp_degree,
                                                zero_stage=zero_stage, tp_degree=the_mesh.tp_degree))
    reduced_by_us = zero_stage is not None
    if zero_stage in (2, 3):
        if the_mesh.device_mesh is None and the_mesh.sp is not dist.group.WORLD:
            raise AutospError(f"zero={zero_stage} shards parameters over a device mesh; pass mesh= "
                              "(init_device_mesh(..., mesh_dim_names=('dp', 'sp'))) instead of a process group")
        param_groups = shard_parameters(model, the_mesh, zero_stage, _shard_ranks(zero_shard))
    elif zero_shard != "mesh":
        raise AutospError(f"Zero(shard={zero_shard!r}) shards ZeRO 3's parameters by node (HSDP); it needs stage=3")
    # what every compiled variant shares; each plan's decisions replace the base's (SequenceParallel)
    base = SPConfig(the_mesh.sp, decisions, runtime.gather_outputs,
                    reduce_grads=runtime.reduce_grads and not reduced_by_us, compiler=compiler,
                    layer_paths=tuple(layer_paths(model)),
                    loss_group=the_mesh.whole if reduced_by_us or not runtime.reduce_grads else the_mesh.sp,
                    # eager checkpointing splits the graph per layer: a prefetch would cross the split
                    prefetch_params=runtime.overlap and not (compiler == "eager" and
                                                             decisions.any_layer(lambda c: c.checkpoint != "none")))
    reducer = GradReducer(list(model.parameters()), the_mesh.whole, zero.bucket_mb) if zero_stage in (0, 1) else None
    sp = SequenceParallel(model, base, mesh=the_mesh, zero_stage=zero_stage, reducer=reducer,
                          param_groups=param_groups if zero_stage in (2, 3) else [], plan=plan, provider=provider,
                          may_step_on_host=may_step_on_host or decisions.mesh.host_optimizer)
    sp.tp_report = tp_report
    return sp


def _tensor_parallel(model: nn.Module, mesh: Mesh, planned: int, zero_stage: int | None) -> TPReport:
    """Split the model's linear layers over the mesh's TP group (:mod:`autosp.transform.tensor_parallel`),
    as the mesh says and the plan agrees; a Hugging Face model's pairs are read from one forward of a
    few tokens, another model's must be split by the caller first."""
    if planned > 1 and planned != mesh.tp_degree:
        raise AutospError(f"the plan splits each layer's weights over TP {planned} but the mesh has TP "
                          f"{mesh.tp_degree}; pass mesh=init_device_mesh(device, (dp, sp, {planned}), "
                          "mesh_dim_names=('dp', 'sp', 'tp')), or leave mesh out")
    if mesh.tp_degree == 1:
        return TPReport(1)
    if zero_stage in (2, 3):
        raise AutospError(f"ZeRO {zero_stage} does not compose with tensor parallelism in autosp yet; use "
                          "zero=1 (optimizer states sharded) or zero=0 with a 'tp' mesh, or drop 'tp'")
    if not is_hf_model(model):
        raise AutospError("autosp reads a Hugging Face model's linear pairs from one forward of a few tokens; for "
                          f"{type(model).__name__} split them first with autosp.tensor_parallel(model, "
                          "mesh['tp'].get_group(), example_batch) and pass mesh without 'tp'")
    param = next(model.parameters())
    probe = {"input_ids": torch.zeros(1, 8, dtype=torch.long, device=param.device), "use_cache": False}
    return parallelize(model, mesh.tp, probe)


def without_overlap(decisions: Decisions) -> Decisions:
    """The decisions with every named strategy's unpipelined variant (``Runtime(overlap=False)``)."""
    return replace(decisions, layers=tuple(replace(c, strategy=c.strategy if c.strategy == AUTO else
                                                   resolve(c.strategy).without_overlap().spec)
                                           for c in decisions.layers))


def _shard_ranks(zero_shard: int | str) -> int:
    """0: shard over the whole mesh; k: over each k consecutive ranks (a node), replicated across."""
    if zero_shard == "mesh":
        return 0
    if zero_shard == "node":
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if not local:
            raise AutospError("zero_shard='node' reads the devices per node from the launch (LOCAL_WORLD_SIZE, set by "
                              "torchrun); give their number instead, e.g. zero_shard=8")
        return int(local)
    if isinstance(zero_shard, int) and not isinstance(zero_shard, bool) and zero_shard >= 1:
        return zero_shard
    raise AutospError(f"zero_shard must be 'mesh', 'node' or a number of ranks per shard group, got {zero_shard!r}")


def _check_plan_placement(plan: Any) -> None:
    """A plan that keeps Ulysses inside nodes of N devices runs as planned only where nodes have N."""
    launched = os.environ.get("LOCAL_WORLD_SIZE")
    split = any(layer.ulysses_degree > 1 and layer.ring_degree > 1 for layer in plan.layers)
    if launched and split and int(launched) != plan.devices_per_node:
        raise AutospError(f"this plan keeps each Ulysses group inside a node of {plan.devices_per_node} devices, but "
                          f"the launch has {launched} per node (LOCAL_WORLD_SIZE); re-plan with --devices-per-node "
                          f"{launched}")
