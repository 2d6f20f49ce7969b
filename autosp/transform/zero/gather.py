"""ZeRO stage 3 inside the compiled graph: parameters held as 1/N shards, gathered where the
graph reads them, per transformer block, and gathered again for the backward.

Why not FSDP2 here: FSDP2 gathers and frees a unit's parameters in module hooks that torch
2.13 hides from torch.compile (``torch._dynamo.disable``), so a unit per transformer block
would cut autosp's one sharded graph at every block. Instead the gathers are ops *in* the
graph, where the planner's other decisions (checkpointing, overlap) see them:

* Each parameter is stored as FSDP2 stores it between steps: a ``DTensor`` sharded along
  dim 0 over the whole dp x sp mesh (``Shard(0)``, uneven sizes as ``torch.chunk`` gives), so
  the optimizer updates its shard only, and ``torch.distributed.checkpoint`` saves the plain
  model's keys and reshards on load.
* Reading ``module.weight`` while Dynamo traces gives the gathered parameter
  (:func:`gather_shard`: pad the local rows to ``ceil(rows / N)``, all-gather, trim); read
  anywhere else it is the ``DTensor``, and no collective runs.
* :func:`bucket_gathers` (a graph pass) merges the gathers of one unit (a transformer block;
  the embedding, final norm and head are the root unit) into one collective, issued where
  the unit's first parameter is read.
* The gather's backward reduce-scatters the gradient and *sums* it over the mesh: inside
  autosp's graphs each rank's gradient is a partial sum (its tokens, its batch, a loss
  normalised by the global token count), so the SP sum and the DP sum are that one
  reduce-scatter, as with FSDP2 (:mod:`autosp.transform.zero.shard`).
* Through AOTAutograd (``aot_eager``, ``inductor``) the gathers are tagged for recompute
  (:func:`tag_gathers_for_recompute`): the backward gathers each unit again where it needs
  it, so at any time a rank holds its shards plus about one unit whole, forward and
  backward. With ``compiler="eager"`` autograd keeps what it keeps: the gathered parameters
  live until their matmuls' backward, as ZeRO 2's would.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy

from autosp.errors import AutospError
from autosp.strategies.collectives import blocked, resolve_group, tally
from autosp.transform.graph_pass import finish_pass

GATHER_KIND = "param_all_gather"        # the tally's names (report.collectives) for these collectives
REDUCE_KIND = "grad_reduce_scatter"
REPLICA_KIND = "grad_replica_all_reduce"


# ------------------------------------------------------------------------------ the collectives

def _rows_per_rank(rows: int, world: int) -> int:
    return -(-rows // world)


def _padded(local: Tensor, rows: int) -> Tensor:
    if local.shape[0] == rows:
        return local.contiguous()
    return F.pad(local, (0, 0) * (local.dim() - 1) + (0, rows - local.shape[0]))


def _gather_flat(flat: Tensor, group_name: str) -> Tensor:
    """[n] on each rank -> [world, n]."""
    pg = resolve_group(group_name)
    world = dist.get_world_size(pg)
    out = flat.new_empty(world * flat.numel())
    tally(GATHER_KIND, group_name, flat)
    t0 = time.perf_counter()
    dist.all_gather_into_tensor(out, flat, group=pg)
    blocked(GATHER_KIND, group_name, t0)
    return out.view(world, -1)


def _reduce_scatter_flat(full: Tensor, group_name: str) -> Tensor:
    """[world, n] partial sums on each rank (a buffer of the caller's, overwritten) -> this rank's
    row of their sum."""
    pg = resolve_group(group_name)
    tally(REDUCE_KIND, group_name, full)
    t0 = time.perf_counter()
    out = full.new_empty(full.shape[1:])
    if dist.get_backend(pg) == "nccl":
        dist.reduce_scatter_tensor(out, full.reshape(-1), group=pg)
    else:       # gloo has no reduce-scatter: all-reduce (in place: ``full`` is our own buffer), keep our row
        dist.all_reduce(full, group=pg)
        out = full[dist.get_rank(pg)].clone()
    blocked(REDUCE_KIND, group_name, t0)
    return sum_over_replicas(out, group_name)


# HSDP: the group that holds copies of a shard group's shards (by the shard group's name), whose
# partial sums the reduced shard is summed over too. Set by shard_in_graph, the same on every rank.
_REPLICAS: dict[str, str] = {}


def sum_over_replicas(shard: Tensor, group_name: str) -> Tensor:
    """Under HSDP, this rank's reduced shard summed over the ranks holding the same shard."""
    replicas = _REPLICAS.get(group_name)
    if replicas is None:
        return shard
    tally(REPLICA_KIND, replicas, shard)
    t0 = time.perf_counter()
    dist.all_reduce(shard, group=resolve_group(replicas))
    blocked(REPLICA_KIND, replicas, t0)
    return shard


@torch.library.custom_op("autosp::gather_shards", mutates_args=())
def gather_shards(locals_: list[Tensor], rows: list[int], group_name: str) -> list[Tensor]:
    """The whole parameters of one unit from every rank's dim-0 shards, in one all-gather."""
    world = dist.get_world_size(resolve_group(group_name))
    return _unpack(_gather_flat(flat_shards(locals_, rows, world), group_name), locals_, rows)


def flat_shards(locals_: list[Tensor], rows: list[int], world: int) -> Tensor:
    """This rank's shards of one unit, each padded to its even share of rows, as one flat buffer."""
    return torch.cat([_padded(t, _rows_per_rank(r, world)).reshape(-1) for t, r in zip(locals_, rows)])


def _unpack(full: Tensor, locals_: list[Tensor], rows: list[int]) -> list[Tensor]:
    """The gathered ``[world, n]`` buffer as whole parameters (own storage each: a custom op's
    outputs may not alias one another)."""
    world = full.shape[0]
    out, at = [], 0
    for t, r in zip(locals_, rows):
        p = _rows_per_rank(r, world)
        n = p * _row_numel(t)
        out.append(full[:, at:at + n].reshape(world * p, *t.shape[1:])[:r].clone())
        at += n
    return out


def _row_numel(t: Tensor) -> int:
    return math.prod(t.shape[1:])


def flat_grads(grads: list[Tensor], world: int) -> Tensor:
    """Whole gradients as one ``[world, n]`` buffer: row r holds every tensor's rank-r shard."""
    return torch.cat([_padded(g, world * _rows_per_rank(g.shape[0], world)).reshape(world, -1) for g in grads],
                     dim=1)


def split_row(mine: Tensor, rows: list[int], local_rows: list[int], shapes: list[tuple[int, ...]],
              world: int) -> list[Tensor]:
    """This rank's row of a reduced :func:`flat_grads` buffer as its shard of each gradient."""
    out, at = [], 0
    for r, local, like in zip(rows, local_rows, shapes):
        p = _rows_per_rank(r, world)
        n = p * math.prod(like)
        out.append(mine[at:at + n].reshape(p, *like)[:local].clone())
        at += n
    return out


@gather_shards.register_fake
def _(locals_: list[Tensor], rows: list[int], group_name: str) -> list[Tensor]:
    return [t.new_empty((r, *t.shape[1:])) for t, r in zip(locals_, rows)]


def _gather_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    locals_, ctx.rows, ctx.group_name = inputs
    ctx.local_rows = [t.shape[0] for t in locals_]
    ctx.shapes = [tuple(t.shape[1:]) for t in locals_]
    ctx.dtype = locals_[0].dtype


def _gather_backward(ctx: Any, grads: list[Tensor | None]) -> tuple:
    full = [g if g is not None else torch.zeros((r, *like), dtype=ctx.dtype)
            for g, r, like in zip(grads, ctx.rows, ctx.shapes)]
    return scatter_grads(full, ctx.local_rows, ctx.group_name), None, None


@torch.library.custom_op("autosp::scatter_grads", mutates_args=())
def scatter_grads(grads: list[Tensor], local_rows: list[int], group_name: str) -> list[Tensor]:
    """The backward of :func:`gather_shards`: each whole gradient summed over the group, this
    rank's dim-0 shard of it kept, in one reduce-scatter."""
    world = dist.get_world_size(resolve_group(group_name))
    mine = _reduce_scatter_flat(flat_grads(grads, world), group_name)
    return split_row(mine, [g.shape[0] for g in grads], local_rows, [tuple(g.shape[1:]) for g in grads], world)


@scatter_grads.register_fake
def _(grads: list[Tensor], local_rows: list[int], group_name: str) -> list[Tensor]:
    return [g.new_empty((r, *g.shape[1:])) for g, r in zip(grads, local_rows)]


gather_shards.register_autograd(_gather_backward, setup_context=_gather_setup)


def gather_shard(local: Tensor, rows: int, group_name: str) -> Tensor:
    """One parameter whole (``rows`` along dim 0) from every rank's shard."""
    return gather_shards([local], [rows], group_name)[0]


# ------------------------------------------------------------------------- the sharded model

def _reader(name: str, rows: int, group_name: str) -> property:
    def read(module: nn.Module) -> Any:
        param = module._parameters[name]
        if torch.compiler.is_compiling():          # inside autosp's graph: gather it there
            return gather_shard(module._autosp_shards[name], rows, group_name)
        return param                               # outside: the DTensor shard, no collective
    return property(read)


def _plain_shard(param: nn.Parameter) -> nn.Parameter:
    """The graph's view of a DTensor parameter: its local shard as a plain Parameter (same storage, so
    the optimizer's in-place updates of the DTensor are what the next step reads).

    Why not ``param.to_local()`` in the graph: where a layer is fully recomputed, AOTAutograd then
    saves the DTensor's device mesh for the backward among the tensors, and the step fails. A plain
    leaf keeps every DTensor out of the graph; its gradient reaches the parameter by a hook
    (:func:`_to_parameter_grad`)."""
    # a Parameter, so the graph's gradient convention treats it as one (a plain input requiring grad
    # would be an activation, its gradient summed over the SP group)
    leaf = nn.Parameter(param._local_tensor.detach(), requires_grad=param.requires_grad)
    if param.requires_grad:
        leaf.register_post_accumulate_grad_hook(_to_parameter_grad(param))
    return leaf


def _to_parameter_grad(param: nn.Parameter) -> Any:
    """Moves the shard's accumulated gradient into ``param.grad`` (a DTensor sharded as ``param``),
    adding to one already there: ``zero_grad()`` and accumulation over micro-batches act on the
    parameter, as without ZeRO 3."""
    from torch.distributed.tensor import DTensor

    def hook(leaf: Tensor) -> None:
        g, leaf.grad = leaf.grad, None
        if param.grad is None:
            param.grad = DTensor.from_local(g, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
        else:
            param.grad.to_local().add_(g)
    return hook


def _shared_leaf(param: nn.Parameter, leaves: dict[int, Tensor]) -> Tensor:
    """``param``'s plain shard, one per parameter (a tied parameter read by two modules has one)."""
    if id(param) not in leaves:
        leaves[id(param)] = _plain_shard(param)
    return leaves[id(param)]


def refresh_shards(model: nn.Module) -> None:
    """Re-derive the plain shards of parameters whose local storage was replaced since (``.to()``,
    ``param.data = ...``); cheap, so :class:`SequenceParallel` calls it at every step."""
    leaves: dict[int, Tensor] = {}
    for module in model.modules():
        shards = module.__dict__.get("_autosp_shards")
        for n, leaf in (shards or {}).items():
            param = module._parameters[n]
            local = param._local_tensor
            if leaf.data_ptr() != local.data_ptr() or leaf.dtype != local.dtype or leaf.shape != local.shape:
                shards[n] = _shared_leaf(param, leaves)
            else:
                leaves.setdefault(id(param), leaf)


def shard_in_graph(model: nn.Module, device_mesh: Any) -> int:
    """Replace every parameter of ``model`` by its dim-0 DTensor shard over ``device_mesh`` and make
    Dynamo read it gathered. Returns how many. A 1-D mesh (the whole dp x sp mesh) shards over all
    its ranks; a 2-D ``("replicate", "shard")`` mesh is HSDP: sharded over each row (a node),
    replicated across rows, gradients reduce-scattered in the row and summed across rows.
    Tied parameters (an embedding shared with the head) stay one parameter."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if device_mesh.ndim == 2:
        placements = [Replicate(), Shard(0)]
        group_name = device_mesh["shard"].get_group().group_name
        _REPLICAS[group_name] = device_mesh["replicate"].get_group().group_name
    else:
        placements = [Shard(0)]
        group_name = device_mesh.get_group().group_name
    sharded: dict[int, nn.Parameter] = {}
    leaves: dict[int, Tensor] = {}         # tied parameters share one plain shard
    for path, module in model.named_modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        readers = {}
        for n in names:
            p = module._parameters[n]
            if p.dim() == 0:
                raise AutospError(f"parameter {path}.{n} is a scalar; ZeRO 3 shards parameters along dim 0: "
                                  "make it a 1-element tensor, or use zero=2")
            if id(p) not in sharded:
                sharded[id(p)] = nn.Parameter(distribute_tensor(p.detach(), device_mesh, placements),
                                              requires_grad=p.requires_grad)
            module._parameters[n] = sharded[id(p)]
            readers[n] = _reader(n, p.shape[0], group_name)
        module._autosp_shards = {n: _shared_leaf(module._parameters[n], leaves) for n in names}
        cls = type(module)
        module.__class__ = type(f"Sharded{cls.__name__}", (cls,), {**readers, "_autosp_sharded_from": cls})
    return len(sharded)


# ------------------------------------------------------------------------- the graph passes

_GATHER_ID = 10 ** 6      # the gathers' checkpoint id: above every layer's (see checkpointing.py)


def gather_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.autosp.gather_shards.default]


def _prefetched(gm: fx.GraphModule) -> list[fx.Node]:
    ops = (torch.ops.autosp.gather_start.default, torch.ops.autosp.gather_finish.default)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]


def bucket_gathers(gm: fx.GraphModule, layer_paths: list[str]) -> int:
    """Merge each run of consecutive parameter gathers of one unit (a transformer block, or the
    root's parameters read between two blocks) into one collective, issued where the run's first
    parameter is read. Returns the number of gathers left (the collectives per forward)."""
    from autosp.transform.checkpointing import _layer_of

    gathers = gather_nodes(gm)
    if not gathers:             # not ZeRO 3: nothing to merge, and no recompile
        return 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    runs: list[list[fx.Node]] = []
    last_unit: object = object()
    for n in gathers:
        unit = _layer_of(n, layer_paths)
        if runs and unit == last_unit:
            runs[-1].append(n)
        else:
            runs.append([n])
        last_unit = unit
    for run in runs:
        if len(run) == 1:
            continue
        first = run[0]
        locals_, rows = [], []
        for g in run:
            (local,), (r,), _ = g.args
            if any(a.op != "placeholder" for a in local.all_input_nodes):
                raise AutospError(f"a ZeRO-3 parameter gather reads {local.name}, not a parameter's shard")
            if order[local] > order[first]:
                first.prepend(local)          # only reads a placeholder: safe anywhere after them
            locals_.append(local)
            rows.append(r)
        with gm.graph.inserting_before(first):
            bucket = gm.graph.call_function(torch.ops.autosp.gather_shards.default, (locals_, rows, first.args[2]))
        bucket.meta = dict(first.meta)
        for k, g in enumerate(run):
            for user in list(g.users):        # getitem(g, 0) -> getitem(bucket, k)
                user.args = (bucket, k)
            gm.graph.erase_node(g)
    finish_pass(gm, 1)          # the gathers were bucketed: the graph changed
    return len(gather_nodes(gm))


def tag_gathers_for_recompute(gm: fx.GraphModule) -> int:
    """Through AOTAutograd: the backward gathers each unit again rather than keep it from the
    forward (ZeRO 3's resharding). Returns how many gathers were tagged."""
    tagged = 0
    for g in gather_nodes(gm) + _prefetched(gm):
        for n in (g, *g.users):
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = _GATHER_ID
        tagged += 1
    return tagged
