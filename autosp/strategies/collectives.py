"""Collectives as ``torch.library`` custom ops, with autograd and fake (shape) kernels.

Each op names its process group by ``group_name`` (a string, so the ops stay
traceable); the autograd rule says what the backward pass communicates:

  op                        forward                         backward
  autosp::all_to_all        scatter one dim, gather another  the inverse all-to-all
  autosp::all_reduce_sum    sum over the group               identity (each rank keeps
                                                             the gradient of its own term)
  autosp::copy_sum_grad     identity                         sum over the group (a tensor-
                                                             parallel region's input)
  autosp::all_gather        concatenate shards along a dim   this rank's slice of the grad
  autosp::all_to_all_issue  start an all-to-all; returns the  the inverse's completion
                            receive buffer (not yet valid)
  autosp::all_to_all_complete  wait for it; assemble           the inverse's start

The issue/complete pair is how a strategy overlaps an all-to-all with compute: what
runs between the two calls runs while the data moves. Their autograd rules swap the
roles, so the backward overlaps the same way: the autograd engine runs the later
node first, so a gradient's all-to-all starts in the complete's backward and is
waited for in the issue's backward, with the work created in between (e.g. the
previous head group's attention) running while it moves.

The identity backward of ``all_reduce_sum`` is what makes SP gradients right:
the loss every rank returns is the *global* loss, and each rank back-propagates
only through its own tokens, so parameter gradients are partial sums that one
all-reduce over the SP group completes.
"""

from __future__ import annotations

import atexit
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

from autosp.errors import AutospError


# Collectives issued by this process, by (group name, kind): [calls, bytes this rank sent,
# seconds the calling thread was blocked waiting for them]. Always on (one dict update per
# call, at run time only: fake kernels do not count); the SP model's report() reads what one
# step issued. The blocked seconds are the communication compute waited on: exposed.
TALLY: defaultdict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])


# Seconds the interpreter waits at exit, once this process ran collectives. Gloo's worker thread
# drops its reference to a collective's tensors just after the wait returns; where Python had
# already dropped its own (a gradient bucket, freed as soon as the sums are copied out), the
# worker frees the tensor's Python object and takes the GIL to do it. If the script ended right
# after the step, that thread finds the interpreter finalizing, is made to exit inside a C++
# destructor, and the process aborts ("terminate called without an active exception"). A short
# pause before finalization lets it finish.
EXIT_GRACE_S = 0.05


@atexit.register
def _let_collective_threads_finish() -> None:
    if TALLY:
        time.sleep(EXIT_GRACE_S)


def tally(kind: str, group_name: str, *sent: Tensor) -> None:
    entry = TALLY[(group_name, kind)]
    entry[0] += 1
    entry[1] += sum(t.numel() * t.element_size() for t in sent)


# Opt-in (a benchmark sets a list): each SP collective (all-to-all, all-gather, reduce-scatter),
# as it completes, appends (issued, waited from, done) in perf_counter seconds, a
# clock every process on a machine shares. Ranks run the same collectives in the same order, so
# entry i is the same exchange on every rank: whether a rank waited for its peers to issue it or
# for the transfer itself (:func:`split_waits`).
TIMELINE: list[tuple[float, float, float]] | None = None


def _timeline(issued: float, waited_from: float) -> None:
    if TIMELINE is not None:
        TIMELINE.append((issued, waited_from, time.perf_counter()))


def split_waits(every: list[list[tuple[float, float, float]]]) -> list[tuple[float, float]]:
    """Per rank, from every rank's :data:`TIMELINE`: (seconds it waited before the last rank had
    issued the exchange, seconds it waited after). The first is the peers' lag (load imbalance,
    scheduling), which no schedule can hide; the second is the transfer left in flight."""
    if len({len(mine) for mine in every}) > 1:
        raise AutospError(f"the ranks' timelines hold {[len(m) for m in every]} exchanges; every rank must "
                          "record the same collectives (set TIMELINE on every rank before the step)")
    last_issued = [max(issued) for issued in zip(*[[e[0] for e in mine] for mine in every])]
    out = []
    for mine in every:
        lag = transfer = 0.0
        for (_, start, done), last in zip(mine, last_issued):
            lag += max(0.0, min(done, last) - start)
            transfer += max(0.0, done - max(start, last))
        out.append((lag, transfer))
    return out


def blocked(kind: str, group_name: str, since: float) -> None:
    """Count the time since ``since`` as spent waiting on a ``kind`` collective."""
    TALLY[(group_name, kind)][2] += time.perf_counter() - since


def wait_all(works: list, kind: str, group_name: str, issued: float | None = None) -> None:
    """Wait for asynchronous ``works`` of a ``kind`` collective, counting the time blocked;
    ``issued`` (when the first was started) puts the wait on the :data:`TIMELINE`."""
    t0 = time.perf_counter()
    for work in works:
        work.wait()
    blocked(kind, group_name, t0)
    if issued is not None:
        _timeline(issued, t0)


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
    t0 = time.perf_counter()
    dist.all_to_all_single(recv, send, group=pg)
    blocked("all_to_all", group_name, t0)
    _timeline(t0, t0)
    del send                    # sent: freed before the result is assembled (one buffer less at the peak)
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


# ------------------------------------------------------------------ all_to_all, issue / complete

# Receive buffers in flight, by data pointer: (the work to wait for, the send buffer it reads,
# when it was issued).
# Keyed by pointer, not identity: a compiled graph may hand the buffer on as a new tensor object.
_IN_FLIGHT: dict[int, tuple[object, Tensor, float]] = {}


@torch.library.custom_op("autosp::all_to_all_issue", mutates_args=())
def all_to_all_issue(x: Tensor, scatter_dim: int, group_name: str) -> Tensor:
    """Start :func:`all_to_all`'s exchange of ``x``; returns the receive buffer ``[P, *chunk]``,
    filled in the background: only :func:`all_to_all_complete` may read it."""
    pg = resolve_group(group_name)
    send = torch.stack(x.chunk(dist.get_world_size(pg), dim=scatter_dim)).contiguous()
    tally("all_to_all", group_name, send)
    recv = torch.empty_like(send)
    _IN_FLIGHT[recv.data_ptr()] = (dist.all_to_all_single(recv, send, group=pg, async_op=True), send,
                                   time.perf_counter())
    return recv


@all_to_all_issue.register_fake
def _(x: Tensor, scatter_dim: int, group_name: str) -> Tensor:
    p = group_size(group_name)
    chunk = list(x.shape)
    chunk[scatter_dim] = chunk[scatter_dim] // p
    return x.new_empty([p] + chunk)


@torch.library.custom_op("autosp::all_to_all_complete", mutates_args=())
def all_to_all_complete(recv: Tensor, gather_dim: int, group_name: str) -> Tensor:
    """Wait for the exchange into ``recv`` (if still in flight) and concatenate what arrived
    along ``gather_dim`` in rank order. A buffer already waited for (a recomputation under
    activation checkpointing) is only assembled."""
    pending = _IN_FLIGHT.pop(recv.data_ptr(), None)
    if pending is not None:
        wait_all([pending[0]], "all_to_all", group_name, issued=pending[2])
    return torch.cat(recv.unbind(0), dim=gather_dim)


@all_to_all_complete.register_fake
def _(recv: Tensor, gather_dim: int, group_name: str) -> Tensor:
    shape = list(recv.shape[1:])
    shape[gather_dim] = shape[gather_dim] * recv.shape[0]
    return recv.new_empty(shape)


def _issue_setup(ctx, inputs, output) -> None:
    _, ctx.scatter_dim, ctx.group_name = inputs


def _issue_backward(ctx, grad_recv: Tensor):
    # the gradient's exchange was started by the complete's backward: finish it, back to x's layout
    return all_to_all_complete(grad_recv.contiguous(), ctx.scatter_dim, ctx.group_name), None, None


def _complete_setup(ctx, inputs, output) -> None:
    _, ctx.gather_dim, ctx.group_name = inputs


def _complete_backward(ctx, grad: Tensor):
    # start the inverse exchange; the autograd engine runs other work before the issue's backward
    return all_to_all_issue(grad.contiguous(), ctx.gather_dim, ctx.group_name), None, None


all_to_all_issue.register_autograd(_issue_backward, setup_context=_issue_setup)
all_to_all_complete.register_autograd(_complete_backward, setup_context=_complete_setup)


# ------------------------------------------------------------------------------ all_reduce_sum

@torch.library.custom_op("autosp::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    tally("all_reduce", group_name, x)
    out = x.clone()
    t0 = time.perf_counter()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=resolve_group(group_name))
    blocked("all_reduce", group_name, t0)
    return out


@all_reduce_sum.register_fake
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x)


def _ar_backward(ctx, grad: Tensor):
    return grad, None


all_reduce_sum.register_autograd(_ar_backward, setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("autosp::copy_sum_grad", mutates_args=())
def copy_sum_grad(x: Tensor, group_name: str) -> Tensor:
    """What enters a tensor-parallel region whole on every rank of the group: itself forward, its
    gradient (each rank's, from its own part of the weights) summed over the group backward."""
    return x.clone()


@copy_sum_grad.register_fake
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x)


def _copy_backward(ctx, grad: Tensor):
    return all_reduce_sum(grad.contiguous(), ctx.group_name), None


def _copy_setup(ctx, inputs, output) -> None:
    ctx.group_name = inputs[1]


copy_sum_grad.register_autograd(_copy_backward, setup_context=_copy_setup)


# ---------------------------------------------------------------------------------- all_gather

@torch.library.custom_op("autosp::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    return _gather(x, dim, group_name)


def _gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    pg = resolve_group(group_name)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
    tally("all_gather", group_name, x)
    t0 = time.perf_counter()
    dist.all_gather(parts, x.contiguous(), group=pg)
    blocked("all_gather", group_name, t0)
    _timeline(t0, t0)
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
    t0 = time.perf_counter()
    if dist.get_backend(pg) == "nccl":
        parts = torch.stack(x.chunk(p, dim=dim)).contiguous()
        out = torch.empty_like(parts[0])
        dist.reduce_scatter_tensor(out, parts, group=pg)
        blocked("reduce_scatter", group_name, t0)
        _timeline(t0, t0)
        return out
    total = x.contiguous().clone()             # gloo has no reduce-scatter: all-reduce, keep ours
    t0 = time.perf_counter()                   # the copy is compute, not the transfer
    dist.all_reduce(total, group=pg)
    blocked("reduce_scatter", group_name, t0)
    _timeline(t0, t0)
    return total.narrow(dim, r * n, n).contiguous()


@reduce_scatter_sum.register_fake
def _(x: Tensor, dim: int, group_name: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] // group_size(group_name)
    return x.new_empty(shape)


def _agrs_backward(ctx, grad: Tensor):
    return reduce_scatter_sum(grad, ctx.dim, ctx.group_name), None, None


all_gather_rs.register_autograd(_agrs_backward, setup_context=_ag_setup)
