"""Collectives as ``torch.library`` custom ops, with autograd and fake (shape) kernels.

Each op names its process group by ``group_name`` (a string, so the ops stay
traceable); the autograd rule says what the backward pass communicates:

  op                        forward                         backward
  autosp::all_to_all        scatter one dim, gather another  the inverse all-to-all
  autosp::all_reduce_sum    sum over the group               identity (each rank keeps
                                                             the gradient of its own term)
  autosp::all_gather        concatenate shards along a dim   this rank's slice of the grad

The identity backward of ``all_reduce_sum`` is what makes SP gradients right:
the loss every rank returns is the *global* loss, and each rank back-propagates
only through its own tokens, so parameter gradients are partial sums that one
all-reduce over the SP group completes.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor


# Collectives issued by this process, by (group name, kind): [calls, bytes this rank sent].
# Always on (one dict update per call, at run time only: fake kernels do not count); the
# SP model's report() reads what one step issued.
TALLY: defaultdict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])


def tally(kind: str, group_name: str, *sent: Tensor) -> None:
    entry = TALLY[(group_name, kind)]
    entry[0] += 1
    entry[1] += sum(t.numel() * t.element_size() for t in sent)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_size(group_name: str) -> int:
    return dist.get_world_size(resolve_group(group_name))


# ---------------------------------------------------------------------------------- all_to_all

@torch.library.custom_op("autosp::all_to_all", mutates_args=())
def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group_name: str) -> Tensor:
    """Split ``x`` into P chunks along ``scatter_dim``, send chunk j to rank j, and
    concatenate what arrives along ``gather_dim`` in rank order."""
    pg = resolve_group(group_name)
    p = dist.get_world_size(pg)
    send = torch.stack(x.chunk(p, dim=scatter_dim)).contiguous()
    tally("all_to_all", group_name, send)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    return torch.cat(recv.unbind(0), dim=gather_dim)


@all_to_all.register_fake
def _(x: Tensor, scatter_dim: int, gather_dim: int, group_name: str) -> Tensor:
    p = group_size(group_name)
    shape = list(x.shape)
    shape[scatter_dim] = shape[scatter_dim] // p
    shape[gather_dim] = shape[gather_dim] * p
    return x.new_empty(shape)


def _a2a_setup(ctx, inputs, output) -> None:
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group_name = inputs


def _a2a_backward(ctx, grad: Tensor):
    return all_to_all(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group_name), None, None, None


all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_setup)


# ------------------------------------------------------------------------------ all_reduce_sum

@torch.library.custom_op("autosp::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    tally("all_reduce", group_name, x)
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=resolve_group(group_name))
    return out


@all_reduce_sum.register_fake
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x)


def _ar_backward(ctx, grad: Tensor):
    return grad, None


all_reduce_sum.register_autograd(_ar_backward, setup_context=lambda ctx, inputs, output: None)


# ---------------------------------------------------------------------------------- all_gather

@torch.library.custom_op("autosp::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    return _gather(x, dim, group_name)


def _gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    pg = resolve_group(group_name)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
    tally("all_gather", group_name, x)
    dist.all_gather(parts, x.contiguous(), group=pg)
    return torch.cat(parts, dim=dim)


@all_gather.register_fake
def _(x: Tensor, dim: int, group_name: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * group_size(group_name)
    return x.new_empty(shape)


def _ag_setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.group_name = inputs


def _ag_backward(ctx, grad: Tensor):
    pg = resolve_group(ctx.group_name)
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    n = grad.shape[ctx.dim] // p
    return grad.narrow(ctx.dim, r * n, n), None, None


all_gather.register_autograd(_ag_backward, setup_context=_ag_setup)


# --------------------------------------------------------------- all_gather with reduce-scatter

@torch.library.custom_op("autosp::all_gather_rs", mutates_args=())
def all_gather_rs(x: Tensor, dim: int, group_name: str) -> Tensor:
    """All-gather whose backward *sums* the gradient shards (every rank used the gathered
    tensor, e.g. gathered K/V read by each rank's queries)."""
    return _gather(x, dim, group_name)


@all_gather_rs.register_fake
def _(x: Tensor, dim: int, group_name: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * group_size(group_name)
    return x.new_empty(shape)


@torch.library.custom_op("autosp::reduce_scatter_sum", mutates_args=())
def reduce_scatter_sum(x: Tensor, dim: int, group_name: str) -> Tensor:
    """Sum ``x`` over the group and keep this rank's ``1/P`` slice along ``dim``."""
    pg = resolve_group(group_name)
    p, r = dist.get_world_size(pg), dist.get_rank(pg)
    n = x.shape[dim] // p
    tally("reduce_scatter", group_name, x)
    if dist.get_backend(pg) == "nccl":
        parts = torch.stack(x.chunk(p, dim=dim)).contiguous()
        out = torch.empty_like(parts[0])
        dist.reduce_scatter_tensor(out, parts, group=pg)
        return out
    total = x.contiguous().clone()             # gloo has no reduce-scatter: all-reduce, keep ours
    dist.all_reduce(total, group=pg)
    return total.narrow(dim, r * n, n).contiguous()


@reduce_scatter_sum.register_fake
def _(x: Tensor, dim: int, group_name: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] // group_size(group_name)
    return x.new_empty(shape)


def _agrs_backward(ctx, grad: Tensor):
    return reduce_scatter_sum(grad, ctx.dim, ctx.group_name), None, None


all_gather_rs.register_autograd(_agrs_backward, setup_context=_ag_setup)
