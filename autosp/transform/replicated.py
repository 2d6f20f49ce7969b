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

from typing import Any

import torch
from torch import Tensor

from autosp.strategies.collectives import all_reduce_sum
from autosp.transform.loss import global_mean, global_sum, sharded_cross_entropy, token_total


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


# Ops whose output is global (the same on every rank, made from every rank's tokens): a loss, a
# full sum or mean, a token statistic. Their backward hands each rank the *full* output gradient.
_GLOBAL_OPS = {global_mean, global_sum, sharded_cross_entropy, token_total}


def share_replicated_gradients(graph: torch.fx.Graph, place: dict, ranks: int) -> int:
    """Inside a sharded graph, replicated work on a replicated input that requires grad (the full
    router logits a graph break gathered, then a load-balancing loss computed on them; a weight
    penalty added to the loss) gives every rank the *full* gradient of that input, while the
    boundary's :func:`sum_grad` (or the caller's reduction of a parameter) sums over the ranks,
    counting it ``ranks`` times. Where such a replicated value meets a global one (the loss) or
    leaves the graph, it passes through :func:`share_grad`: each rank keeps 1/P, the sum is whole.

    A replicated value that is instead sliced into this rank's tokens needs nothing: the slice's
    backward already leaves a partial gradient. ``place`` maps a node to its sequence dims (None:
    replicated). Returns how many values were routed."""
    replicated: set[torch.fx.Node] = set()      # replicated values fed by inputs that require grad
    made_global: set[torch.fx.Node] = set()
    routed = 0

    def requires_grad(n: Any) -> bool:
        v = n.meta.get("example_value", n.meta.get("val")) if isinstance(n, torch.fx.Node) else None
        return isinstance(v, torch.Tensor) and v.requires_grad

    def share(user: torch.fx.Node, inputs: list[torch.fx.Node]) -> None:
        nonlocal routed
        for x in inputs:
            with graph.inserting_before(user):
                s = graph.call_function(share_grad, (x, ranks))
            s.meta = {k: v for k, v in x.meta.items() if k != "nn_module_stack"}
            user.replace_input_with(x, s)
            routed += 1

    for n in list(graph.nodes):
        if n.op == "placeholder":
            if requires_grad(n):
                replicated.add(n)
            continue
        ins = n.all_input_nodes
        if n.op == "output":
            share(n, [a for a in ins if a in replicated and requires_grad(a)])
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        if n.target in _GLOBAL_OPS or (place.get(n) is None and any(a in made_global for a in ins)):
            share(n, [a for a in ins if a in replicated and requires_grad(a)])
            made_global.add(n)
        elif place.get(n) is None and not any(place.get(a) is not None for a in ins) and \
                any(a in replicated for a in ins) and n.target is not share_grad:
            replicated.add(n)           # replicated work (sharded ops' backward leaves partial gradients)
    return routed
