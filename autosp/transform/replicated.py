"""Where the sharded and the replicated parts of a step meet: one gradient convention.

With ``autosp.compile(model)`` (``reduce_grads=True``) every gradient that leaves a
sharded graph is *full*: the same on every rank, equal to the single-device one.
Each input of a sharded graph that requires grad (its parameters, ``inputs_embeds``
from an upstream module, the outputs of an earlier graph) enters through
:func:`sum_grad`, whose backward all-reduces that use's gradient over the SP group:
inside the graph each rank back-propagated only its tokens (a partial sum); outside
it the gradient is whole.

Why full and not partial sums completed by one reduction at the end: a model rarely
runs entirely inside sharded graphs. A graph break after the sequence was sharded
leaves graphs without attention (an eager MoE loop, a loss behind a break), and a
break inside a loop leaves whole frames running eagerly; those run on the same full
tensors on every rank and produce full gradients already. A reduction at the end
would add them P times. With the sum at each sharded graph's boundary, sharded,
replicated and eager uses of a parameter simply accumulate.

``sum_grad`` is a ``torch.autograd.Function`` with a view forward (no copy); its
backward calls the traceable custom op :func:`autosp.strategies.collectives.all_reduce_sum`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from autosp.strategies.collectives import all_reduce_sum


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group_name: str) -> Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce_sum(grad.contiguous(), ctx.group_name), None


def sum_grad(x: Tensor, group_name: str) -> Tensor:
    """Identity forward; backward sums the gradient over the group."""
    return _SumGrad.apply(x, group_name)


class _ShareGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, ranks: int) -> Tensor:
        ctx.ranks = ranks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad / ctx.ranks, None


def share_grad(x: Tensor, ranks: int) -> Tensor:
    """Identity forward; backward keeps this rank's 1/P share of a gradient every rank computed whole.

    Under the partial convention (``reduce_grads=False``, ZeRO/FSDP reducing after the step) a
    graph that runs replicated (no attention: a loss or a final norm behind a graph break) gives
    every rank the full gradient of the parameters it reads; the caller's sum over the P ranks of
    the group would count it P times. Its 1/P share per rank sums to the full gradient exactly
    when P is a power of two (a scale by 2^-k is exact in floating point)."""
    return _ShareGrad.apply(x, ranks)
