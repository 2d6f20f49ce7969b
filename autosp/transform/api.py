"""``autosp.compile``: one line turns a single-device model into an SP model.

    model = autosp.compile(model)
    loss = model(input_ids=ids, labels=ids).loss   # every rank passes the same full batch
    loss.backward()                                # grads == single-device grads

Here the arguments become a configuration: the mesh (SP groups, data parallel across),
the ZeRO stage, a plan's choices; the module it returns,
:class:`autosp.transform.sequence_parallel.SequenceParallel`, does what must happen
outside the graph at each call. The graph rewrite itself lives in
:mod:`autosp.transform.sharding`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autosp.errors import AutospError
from autosp.strategies import AUTO, check_spec, resolve
from autosp.transform.backend import SPConfig, check_compiler, default_compiler
from autosp.transform.checkpointing import check_modes
from autosp.transform.grad_reducer import GradReducer
from autosp.transform.mesh import Mesh, check_zero_stage, mesh_for, mesh_from
from autosp.transform.sequence_parallel import SequenceParallel, layer_paths, layout_for, set_up
from autosp.transform.zero import shard_parameters

__all__ = ["SequenceParallel", "compile"]


def compile(model: nn.Module, *, strategy: str | Sequence[str] = "auto", layout: str | None = None,
            sp_size: int | None = None, group: dist.ProcessGroup | None = None, reduce_grads: bool = True,
            gather_outputs: bool | None = None, plan: Any = None, compiler: str | None = None,
            checkpoint: str | Sequence[str] = "none", loss_chunks: int = 1, mlp_chunks: int | Sequence[int] = 1,
            mesh: DeviceMesh | None = None,
            zero_stage: int | None = None, bucket_mb: float = 25.0, overlap: bool = True,
            zero_shard: int | str = "mesh") -> nn.Module:
    """Wrap ``model`` for sequence-parallel training over ``group`` (default: the whole world).

    ``strategy``: ``"auto"`` (Ulysses when the heads split, else ring), ``"ulysses"``,
    ``"ring"``, ``"zigzag_ring"``, ``"allgather_kv"``, ``"hybrid:UxR"`` (Ulysses degree U
    inside groups of consecutive ranks, ring degree R across), any strategy registered
    with :func:`autosp.strategies.register`, or a list with one per attention layer.
    ``layout``: ``"contiguous"``, ``"zigzag"`` or ``"balanced"`` token layout for every sharded
    tensor (default: the layout a named strategy needs, e.g. zigzag for ``zigzag_ring``, else
    contiguous). ``"balanced"`` deals chunks per batch so that packed documents' causal work is
    even across ranks (see :mod:`autosp.strategies.layout`).
    ``sp_size`` splits the world into consecutive groups of that many ranks (SP inside,
    data parallel across). ``reduce_grads=True``: every rank's parameter gradients are the
    single-device ones of its row's batch (the SP sum happens inside the graphs' backward, see
    :mod:`autosp.transform.replicated`); ``False``: the loss is global over the whole mesh
    (every row's tokens) and gradients are this rank's partial sums, whose *sum* over the
    whole mesh is the global batch's gradient: for the caller's DeepSpeed/FSDP to reduce
    (one that averages over the N ranks takes ``loss * N`` in its backward).
    ``gather_outputs``: sequence-sharded outputs (logits) come back all-gathered (True), as
    this rank's tokens (False), or by default all-gathered only from graphs that compute no
    loss: a model called with labels returns the global loss and this rank's logits (full
    logits at 128k tokens would cost every rank what SP saves), one called without labels,
    or whose loss follows a graph break, returns full logits.
    ``compiler``: how each sharded graph runs: ``"inductor"`` (the default: AOTAutograd +
    Inductor, fused kernels, cheap ops recomputed in backward; ``bench/vs_deepspeed_autosp.py``:
    25% faster steps than eager graphs, after a first step that compiles for 25-60 s on a 2-core
    CPU; without a C++ compiler on CPU, ``aot_eager`` with a warning), ``"aot_eager"``
    (AOTAutograd's forward and backward graphs run as they are: the same partition and memory,
    no fusion) or ``"eager"`` (the sharded graph as traced, autograd as usual: compiles in
    seconds, for debugging). ``$AUTOSP_COMPILER`` sets the default (the test suite runs eagerly);
    ``layout="balanced"`` defaults to eager graphs.
    ``checkpoint``: activation checkpointing, ``"none"``, ``"selective"`` (recompute cheap ops,
    keep matmul, attention and collective outputs) or ``"full"`` (keep each layer's input), or a
    list with one per transformer layer; a plan's choice per layer class is applied.
    ``loss_chunks``: > 1 runs the LM head and the cross-entropy over that many chunks of this
    rank's tokens (forward and backward), so the full-vocabulary logits never exist; the
    model's logits output is then empty (:mod:`autosp.transform.tiled_loss`).
    ``mlp_chunks``: > 1 runs every layer's MLP over that many chunks of this rank's tokens,
    recomputing each chunk's intermediates in its backward, so the ``tokens x intermediate``
    activations exist for one chunk at a time (:mod:`autosp.transform.tiled_mlp`); or a list with
    one count per transformer layer; a plan's choice per layer class is applied.
    ``mesh``: a ``DeviceMesh`` with dimensions ``("dp", "sp")`` (or 1-D: SP only); SP runs inside
    each ``"sp"`` row, data parallelism across rows (each row passes its own batch).
    ``zero_stage``: ``None`` (default): gradients are summed over the SP group inside the graphs and
    data parallelism is the caller's; ``0``: autosp makes the loss global over the whole mesh (equal
    to one process on the concatenated global batch) and sums gradients over the whole mesh once, in
    buckets of ``bucket_mb`` MiB launched asynchronously during the backward
    (:mod:`autosp.transform.grad_reducer`); ``1``: the same, and ``sp.optimizer(cls, **kw)`` shards
    the optimizer states over the mesh; ``2``: FSDP2 shards gradients and optimizer states; ``3``:
    parameters too, gathered per transformer block inside the graph (:mod:`autosp.transform.zero3`).
    ``overlap``: strategies may pipeline their collectives with compute (``ulysses:cK``: K head
    groups, each group's all-to-alls moving while another group attends), as planned, and ZeRO 3
    gathers the next block while one computes and reduce-scatters a block's gradients while the
    blocks before it back-propagate; ``False`` runs every strategy unpipelined (its plain form) and
    ZeRO 3's collectives blocking, for comparison and debugging.
    ``zero_shard`` (ZeRO 3): ``"mesh"`` shards parameters over every rank of the mesh; ``"node"``
    (the launch's ``LOCAL_WORLD_SIZE``) or a number k shards them over each k consecutive ranks and
    replicates across (HSDP): gathers stay inside a node, and only the reduced shards cross nodes.
    ``plan``: a :class:`autosp.planner.plan.Plan` or the path of one (``autosp plan --out``):
    its SP degree (the mesh: DP across), ZeRO stage (unless ``zero_stage`` is given), token layout,
    per-layer strategies and checkpointing are applied; a plan made for another world size,
    sequence length or model, or one that splits Ulysses and ring by node for another node size
    than the launch's (``LOCAL_WORLD_SIZE``), is refused.
    Without an initialised process group there is nothing to split: the model is returned
    as it is, with a warning, so one training script runs alone or under torchrun.
    """
    provider = plan if callable(plan) and not isinstance(plan, str) else None
    the_plan = None if provider is not None else _load_plan(plan)
    if the_plan is not None:
        if dist.is_available() and dist.is_initialized():
            the_plan.check(world_size=dist.get_world_size())
            _check_plan_placement(the_plan)
        strategy, layout, checkpoint = the_plan.strategy(), the_plan.layout, the_plan.checkpoint()
        mlp_chunks = the_plan.mlp_chunks() if mlp_chunks == 1 else mlp_chunks
        loss_chunks = the_plan.loss_chunks if loss_chunks == 1 else loss_chunks
        sp_size = the_plan.sp_degree if the_plan.sp_degree > 1 else sp_size
        zero_stage = the_plan.zero_stage if zero_stage is None else zero_stage
        zero_shard = the_plan.zero_shard or "mesh" if zero_shard == "mesh" else zero_shard
    strategies = [strategy] if isinstance(strategy, str) else list(strategy)
    for st in strategies:
        check_spec(st)
    if not overlap:
        strategies = [st if st == AUTO else resolve(st).without_overlap().spec for st in strategies]
        strategy = strategies[0] if isinstance(strategy, str) else strategies
    check_zero_stage(zero_stage)
    if zero_stage is not None and not reduce_grads:
        raise AutospError(f"zero_stage={zero_stage} has autosp reduce the gradients over the mesh; reduce_grads=False "
                          "(the caller reduces them) contradicts it: pass one of the two")
    if mesh is not None and (sp_size is not None or group is not None):
        raise AutospError("give a mesh, or sp_size / group, not both (the mesh's 'sp' dimension is the SP group)")
    per_layer = [mlp_chunks] if isinstance(mlp_chunks, int) else list(mlp_chunks)
    mlp_chunks = mlp_chunks if isinstance(mlp_chunks, int) else per_layer
    for name, k in (("loss_chunks", loss_chunks), *(("mlp_chunks", c) for c in per_layer)):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise AutospError(f"{name} must be a positive integer (1 = untiled), got {k!r}")
    checkpoint = checkpoint if isinstance(checkpoint, str) else list(checkpoint)
    check_modes(checkpoint)
    layout = layout_for(strategies, layout)
    compiler = check_compiler(compiler if compiler is not None else default_compiler(layout))
    if layout == "balanced" and compiler != "eager":
        raise AutospError(f"layout='balanced' deals chunks per batch, which a {compiler} graph would freeze at its "
                          "first batch; use compiler='eager' with it, or layout='zigzag'")
    if not dist.is_available() or not dist.is_initialized():
        if sp_size not in (None, 1) or group is not None or mesh is not None:
            raise AutospError(f"sp_size={sp_size} needs torch.distributed initialised: call "
                              "torch.distributed.init_process_group() first, e.g. under torchrun")
        warnings.warn("torch.distributed is not initialised: autosp runs the model on this device alone "
                      "(SP degree 1); launch with torchrun to split the sequence", stacklevel=2)
        return model
    if mesh is not None:
        the_mesh = mesh_from(mesh)
    elif group is not None:
        if sp_size is not None and sp_size != dist.get_world_size(group):
            raise AutospError(f"sp_size={sp_size} but the given group has {dist.get_world_size(group)} ranks; pass one")
        the_mesh = Mesh(sp=group, whole=group, sp_degree=dist.get_world_size(group), dp_degree=1)
    else:
        the_mesh = mesh_for(sp_size)
    group = the_mesh.sp
    reduced_by_us = zero_stage is not None
    if zero_stage in (2, 3):
        if the_mesh.device_mesh is None and the_mesh.sp is not dist.group.WORLD:
            raise AutospError(f"zero_stage={zero_stage} shards parameters over a device mesh; pass mesh= "
                              "(init_device_mesh(..., mesh_dim_names=('dp', 'sp'))) instead of group=")
        modes = [checkpoint] if isinstance(checkpoint, str) else checkpoint
        if zero_stage == 3 and compiler != "eager" and "full" in modes:
            raise AutospError(f"zero_stage=3 with checkpoint='full' through {compiler} is not supported yet (AOTAutograd "
                              "cannot recompute a block's parameter gather inside a fully checkpointed layer); use "
                              "checkpoint='selective', zero_stage=2, or compiler='eager'")
        param_groups = shard_parameters(model, the_mesh, zero_stage, _shard_ranks(zero_shard))
    elif zero_shard != "mesh":
        raise AutospError(f"zero_shard={zero_shard!r} shards ZeRO 3's parameters by node (HSDP); it needs zero_stage=3")
    config = SPConfig(group, strategies[0] if isinstance(strategy, str) else strategies, layout, gather_outputs,
                      reduce_grads=reduce_grads and not reduced_by_us, compiler=compiler, checkpoint=checkpoint,
                      loss_chunks=loss_chunks, mlp_chunks=mlp_chunks, layer_paths=layer_paths(model),
                      loss_group=the_mesh.whole if reduced_by_us or not reduce_grads else group,
                      # eager checkpointing splits the graph per layer: a prefetch would cross the split
                      prefetch_params=overlap and not (compiler == "eager" and checkpoint != "none"))
    set_up(config, strategies)
    sp = SequenceParallel(model, config)
    sp.mesh, sp.zero_stage = the_mesh, zero_stage
    sp.param_groups = param_groups if zero_stage in (2, 3) else []
    if zero_stage in (0, 1):
        sp.reducer = GradReducer(list(model.parameters()), the_mesh.whole, bucket_mb)
    sp.plan = the_plan
    sp.plan_provider = provider
    return sp


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
    split = any(layer.get("ulysses_degree", 1) > 1 and layer.get("ring_degree", 1) > 1 for layer in plan.layers)
    if launched and split and int(launched) != plan.devices_per_node:
        raise AutospError(f"this plan keeps each Ulysses group inside a node of {plan.devices_per_node} devices, but "
                          f"the launch has {launched} per node (LOCAL_WORLD_SIZE); re-plan with --devices-per-node "
                          f"{launched}")


def _load_plan(plan: Any) -> Any:
    if plan is None:
        return None
    from autosp.planner.plan import Plan

    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        return Plan.load(plan)
    raise AutospError(f"plan must be a Plan or the path of a plan JSON, not {type(plan).__name__}")


