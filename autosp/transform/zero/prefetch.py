"""ZeRO 3's collectives moved beside compute: the next unit's parameters gather while this unit
computes, and a unit's gradients reduce-scatter while the units before it back-propagate.

:func:`prefetch_gathers` splits each unit's gather (:func:`autosp.transform.zero.gather.gather_shards`)
into a start and a finish and moves the start of unit k+1 to just after the finish of unit k:

    forward:   start(0) finish(0) start(1) [unit 0] finish(1) start(2) [unit 1] finish(2) ...

So a rank holds at most two units whole (the one computing, the one arriving). The autograd
rules swap the roles, as :mod:`autosp.strategies.collectives`' issue/complete pair does:

    backward:  [unit k] finish'(k): reduce-scatter of unit k's gradients starts
               [unit k-1]           ... it travels ...
               start'(k): wait, keep this rank's shard of the sum

The autograd engine runs the later-created work first, and ``start(k)`` was created before
unit k-1's forward, so unit k-1's backward runs between the two. The gradient of the start's
buffer *is* the flat buffer being reduced, which is how the finish's backward hands it on.

Through AOTAutograd the gathers are recomputed for the backward where it needs them (tagged
in :func:`autosp.transform.zero.gather.tag_gathers_for_recompute`): those re-gathers block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor

from autosp.strategies.collectives import resolve_group, tally, wait_all
from autosp.transform.zero.gather import (GATHER_KIND, REDUCE_KIND, _row_numel, _rows_per_rank, _unpack, flat_grads,
                                    flat_shards, gather_nodes, split_row, sum_over_replicas)
from autosp.transform.graph_pass import finish_pass

# Buffers in flight by data pointer: (the work to wait for, what it sends or where it lands).
_IN_FLIGHT: dict[int, tuple[Any, Tensor | None]] = {}


@torch.library.custom_op("autosp::gather_start", mutates_args=())
def gather_start(locals_: list[Tensor], rows: list[int], group_name: str) -> Tensor:
    """Start gathering one unit's shards; returns the receive buffer ``[world, n]``, filled in the
    background: only :func:`gather_finish` may read it."""
    pg = resolve_group(group_name)
    world = dist.get_world_size(pg)
    flat = flat_shards(locals_, rows, world)
    out = flat.new_empty((world, flat.numel()))
    tally(GATHER_KIND, group_name, flat)
    _IN_FLIGHT[out.data_ptr()] = (dist.all_gather_into_tensor(out.view(-1), flat, group=pg, async_op=True), flat)
    return out


@gather_start.register_fake
def _(locals_: list[Tensor], rows: list[int], group_name: str) -> Tensor:
    world = dist.get_world_size(resolve_group(group_name))
    n = sum(_rows_per_rank(r, world) * _row_numel(t) for t, r in zip(locals_, rows))
    return locals_[0].new_empty((world, n))


@torch.library.custom_op("autosp::gather_finish", mutates_args=())
def gather_finish(buf: Tensor, locals_: list[Tensor], rows: list[int], group_name: str) -> list[Tensor]:
    """Wait for the gather into ``buf`` (a recomputation finds it done) and unpack the unit."""
    pending = _IN_FLIGHT.pop(buf.data_ptr(), None)
    if pending is not None:
        wait_all([pending[0]], GATHER_KIND, group_name)
    return _unpack(buf, locals_, rows)


@gather_finish.register_fake
def _(buf: Tensor, locals_: list[Tensor], rows: list[int], group_name: str) -> list[Tensor]:
    return [t.new_empty((r, *t.shape[1:])) for t, r in zip(locals_, rows)]


@torch.library.custom_op("autosp::scatter_start", mutates_args=())
def scatter_start(grads: list[Tensor], group_name: str) -> Tensor:
    """Start summing a unit's whole gradients over the group; returns the flat ``[world, n]``
    buffer in flight (gloo: all-reduced in place; nccl: reduce-scattered from it)."""
    pg = resolve_group(group_name)
    world = dist.get_world_size(pg)
    flat = flat_grads(grads, world)
    tally(REDUCE_KIND, group_name, flat)
    if dist.get_backend(pg) == "nccl":
        out = flat.new_empty(flat.shape[1:])
        _IN_FLIGHT[flat.data_ptr()] = (dist.reduce_scatter_tensor(out, flat.reshape(-1), group=pg, async_op=True),
                                       out)
    else:
        _IN_FLIGHT[flat.data_ptr()] = (dist.all_reduce(flat, group=pg, async_op=True), None)
    return flat


@scatter_start.register_fake
def _(grads: list[Tensor], group_name: str) -> Tensor:
    world = dist.get_world_size(resolve_group(group_name))
    n = sum(_rows_per_rank(g.shape[0], world) * _row_numel(g) for g in grads)
    return grads[0].new_empty((world, n))


@torch.library.custom_op("autosp::scatter_finish", mutates_args=())
def scatter_finish(flat: Tensor, local_rows: list[int], rows: list[int], row_shapes: list[int],
                   group_name: str) -> list[Tensor]:
    """Wait for :func:`scatter_start`'s sum and keep this rank's shard of each gradient.
    ``row_shapes``: each tensor's dims after the first, concatenated, with its count first."""
    pg = resolve_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    work, out = _IN_FLIGHT.pop(flat.data_ptr(), (None, None))
    if work is not None:
        wait_all([work], REDUCE_KIND, group_name)
    mine = sum_over_replicas(out if out is not None else flat[rank].clone(), group_name)
    return split_row(mine, rows, local_rows, _shapes(row_shapes), world)


@scatter_finish.register_fake
def _(flat: Tensor, local_rows: list[int], rows: list[int], row_shapes: list[int], group_name: str) -> list[Tensor]:
    return [flat.new_empty((local, *like)) for local, like in zip(local_rows, _shapes(row_shapes))]


def _shapes(packed: list[int]) -> list[tuple[int, ...]]:
    out, i = [], 0
    while i < len(packed):
        k = packed[i]
        out.append(tuple(packed[i + 1:i + 1 + k]))
        i += 1 + k
    return out


def _pack(shapes: list[tuple[int, ...]]) -> list[int]:
    return [x for s in shapes for x in (len(s), *s)]


def _start_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    locals_, ctx.rows, ctx.group_name = inputs
    ctx.local_rows = [t.shape[0] for t in locals_]
    ctx.row_shapes = _pack([tuple(t.shape[1:]) for t in locals_])


def _start_backward(ctx: Any, grad_buf: Tensor) -> tuple:
    # the reduction was started by the finish's backward: wait for it, keep this rank's shards
    grads = scatter_finish(grad_buf, ctx.local_rows, ctx.rows, ctx.row_shapes, ctx.group_name)
    return grads, None, None


def _finish_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    _, locals_, ctx.rows, ctx.group_name = inputs
    ctx.shapes = [tuple(t.shape[1:]) for t in locals_]
    ctx.dtype = locals_[0].dtype


def _finish_backward(ctx: Any, grads: list[Tensor | None]) -> tuple:
    # start the reduction; the autograd engine runs the units before this one until the start's backward
    whole = [g if g is not None else torch.zeros((r, *like), dtype=ctx.dtype)
             for g, r, like in zip(grads, ctx.rows, ctx.shapes)]
    return scatter_start(whole, ctx.group_name), [None] * len(whole), None, None


gather_start.register_autograd(_start_backward, setup_context=_start_setup)
gather_finish.register_autograd(_finish_backward, setup_context=_finish_setup)


def prefetch_gathers(gm: fx.GraphModule) -> int:
    """Split each unit's gather into start and finish, the start of unit k+1 right after the
    finish of unit k. Returns how many gathers are prefetched (all but the first)."""
    gathers = gather_nodes(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    previous_finish: fx.Node | None = None
    for g in gathers:
        locals_, rows, group = g.args
        anchor = previous_finish.next if previous_finish is not None else g
        for local in locals_:          # each only reads a placeholder: movable up to just after them
            if order[local] > order[anchor]:
                anchor.prepend(local)
                order[local] = order[anchor] - 0.5
        with gm.graph.inserting_before(anchor):
            start = gm.graph.call_function(torch.ops.autosp.gather_start.default, (locals_, rows, group))
        with gm.graph.inserting_before(g):
            finish = gm.graph.call_function(torch.ops.autosp.gather_finish.default, (start, locals_, rows, group))
        start.meta, finish.meta = dict(g.meta), dict(g.meta)
        g.replace_all_uses_with(finish)
        gm.graph.erase_node(g)
        previous_finish = finish
    finish_pass(gm, 1)          # the gathers were rewritten: the graph changed
    return max(0, len(gathers) - 1)
