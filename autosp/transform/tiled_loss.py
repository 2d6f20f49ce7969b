"""Tiled LM head and loss: the head matmul and the cross-entropy over chunks of this rank's tokens.

A causal LM ends in ``logits = h @ W.T`` (``[tokens, vocabulary]``, often upcast to fp32)
and a cross-entropy over them: at 16k local tokens and a 128k vocabulary that is 8 GiB of
fp32 logits, plus their gradient, per rank. After the sharding pass this pass finds the
global cross-entropy whose input is such a head (through views and dtype casts) and
replaces the pair with :func:`chunked_head_loss`: each chunk's logits are made, reduced to
its loss sum and freed; backward recomputes them chunk by chunk (eagerly: non-reentrant
``torch.utils.checkpoint``; through AOTAutograd: one graph node per chunk carrying the
recompute tags its partitioner follows, :func:`_chunked_nodes`), so at most one chunk's
logits and their gradient are alive.
Exact: the same matmul and log-softmax per token; only the order of the final sum
changes. The model's logits output becomes an empty tensor: the logits are what it saves.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from autosp.strategies.collectives import all_reduce_sum
from autosp.transform.loss import all_reduce_count, sharded_cross_entropy
from autosp.transform.tiled_mlp import token_split
from autosp.transform.graph_pass import finish_pass

_LINEAR = {torch._C._nn.linear, F.linear}
# What may stand between the head and the loss: views and dtype casts, nothing that computes.
_PASS_METHODS = {"view", "reshape", "float", "to", "contiguous"}
_PASS_FUNCTIONS = {torch.reshape, torch.flatten}
# Checkpoint ids of the chunks under AOTAutograd: apart from the layers' (their indices).
_CHUNK_ID_BASE = 1 << 24


def _chunk_loss(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, upcast: bool, ignore_index: int,
                label_smoothing: float) -> Tensor:
    logits = F.linear(h, weight, bias)
    if upcast:
        logits = logits.float()
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum",
                           label_smoothing=label_smoothing)


def chunked_head_loss(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, *, chunks: int, upcast: bool,
                      group_name: str, ignore_index: int = -100, reduction: str = "mean",
                      label_smoothing: float = 0.0) -> Tensor:
    """The global cross-entropy of ``linear(h, weight, bias)`` against ``target`` (this rank's
    tokens), with the logits made ``chunks`` tokens-slices at a time (eagerly: each chunk
    under ``torch.utils.checkpoint``)."""
    parts = [checkpoint(_chunk_loss, hc, weight, bias, tc, upcast, ignore_index, label_smoothing, use_reentrant=False)
             for hc, tc in zip(token_chunks(h, chunks), token_chunks(target, chunks))]
    return global_loss(parts, target, group_name=group_name, ignore_index=ignore_index, reduction=reduction)


def token_chunks(x: Tensor, chunks: int) -> tuple[Tensor, ...]:
    """``x``'s tokens (all dims but the last of a hidden state, all of a target) in ``chunks`` slices."""
    flat = x.reshape(-1, x.shape[-1]) if x.is_floating_point() else x.reshape(-1)
    return token_split(flat, chunks, 0)


def global_loss(parts: list[Tensor], target: Tensor, *, group_name: str, ignore_index: int = -100,
                reduction: str = "mean") -> Tensor:
    """The chunks' loss sums made global over the group: their sum, or the token-weighted mean."""
    total = all_reduce_sum(sum(parts), group_name)
    if reduction == "sum":
        return total
    count = (target.reshape(-1) != ignore_index).sum().to(total.dtype)
    return total / all_reduce_count(count.detach(), group_name)


def _chunked_nodes(graph: fx.Graph, h: fx.Node, weight: Any, bias: Any, target: Any, chunks: int, upcast: bool,
                   ignore_index: int, label_smoothing: float, group_name: str, reduction: str) -> fx.Node:
    """The tiled loss as graph nodes, for AOTAutograd: each chunk's head and loss one call tagged
    ``MUST_RECOMPUTE`` with its own checkpoint id, so the partitioner saves the chunk's input
    only and recomputes its logits right before the chunk's backward."""
    hs = graph.call_function(token_chunks, (h, chunks))
    ts = graph.call_function(token_chunks, (target, chunks))
    parts = []
    for c in range(chunks):
        hc, tc = graph.call_function(operator.getitem, (hs, c)), graph.call_function(operator.getitem, (ts, c))
        part = graph.call_function(_chunk_loss, (hc, weight, bias, tc, upcast, ignore_index, label_smoothing))
        part.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        part.meta["ac_graph_id"] = _CHUNK_ID_BASE + c
        parts.append(part)
    return graph.call_function(global_loss, (parts, target), {"group_name": group_name, "ignore_index": ignore_index,
                                                             "reduction": reduction})


def _head_of(x: Any) -> tuple[fx.Node | None, list[fx.Node], bool]:
    """Walk from the loss input back through views and casts to a ``linear``: (the linear node or
    None, the nodes passed, whether a cast to fp32 was among them)."""
    chain, upcast = [], False
    while isinstance(x, fx.Node):
        if x.op == "call_function" and x.target in _LINEAR:
            return x, chain, upcast
        passes = (x.op == "call_method" and x.target in _PASS_METHODS) or \
                 (x.op == "call_function" and x.target in _PASS_FUNCTIONS) or _keeps_last_dim(x)
        if not passes:
            return None, chain, upcast
        upcast |= x.op == "call_method" and (x.target == "float" or (
            x.target == "to" and torch.float32 in list(x.args[1:]) + list(x.kwargs.values())))
        chain.append(x)
        x = x.args[0]
    return None, chain, upcast


def _keeps_last_dim(x: fx.Node) -> bool:
    """A ``.flatten(...)`` that merges token dims only (the vocabulary stays the last dim, as
    ``logits.flatten(0, 1)``): to the chunked loss, which flattens tokens itself, a view."""
    if x.op != "call_method" or x.target != "flatten" or not isinstance(x.args[0], fx.Node):
        return False
    before, after = x.args[0].meta.get("example_value"), x.meta.get("example_value")
    return isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and after.dim() >= 2 \
        and isinstance(before.shape[-1], int) and before.shape[-1] == after.shape[-1]


def tile_head_loss(gm: fx.GraphModule, chunks: int, group_name: str, aot: bool = False) -> int:
    """Rewrite every (LM head, global cross-entropy) pair of ``gm``; returns how many were tiled.
    ``aot``: as tagged graph nodes for AOTAutograd's partitioner (else one checkpointed call)."""
    tiled = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not sharded_cross_entropy:
            continue
        if n.kwargs.get("weight") is not None or (len(n.args) > 2 and n.args[2] is not None):
            continue                         # class weights: left to the untiled loss
        reduction = n.kwargs.get("reduction", "mean")
        if reduction == "none":
            continue
        head, chain, upcast = _head_of(n.args[0])
        if head is None:
            continue
        h, weight = head.args[0], head.args[1]
        bias = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
        target = n.args[1] if len(n.args) > 1 else n.kwargs["target"]
        ignore_index, smoothing = n.kwargs.get("ignore_index", -100), n.kwargs.get("label_smoothing", 0.0)
        with gm.graph.inserting_before(n):
            if aot:
                loss = _chunked_nodes(gm.graph, h, weight, bias, target, chunks, upcast, ignore_index, smoothing,
                                      group_name, reduction)
            else:
                loss = gm.graph.call_function(chunked_head_loss, (h, weight, bias, target), {
                    "chunks": chunks, "upcast": upcast, "group_name": group_name, "ignore_index": ignore_index,
                    "reduction": reduction, "label_smoothing": smoothing})
        loss.meta = {k: v for k, v in n.meta.items() if k != "nn_module_stack"}
        n.replace_all_uses_with(loss)
        gm.graph.erase_node(n)
        for x in [*chain, head]:               # the logits as an output: an empty tensor instead
            for user in list(x.users):
                if user.op == "output":
                    with gm.graph.inserting_before(user):
                        empty = gm.graph.call_function(torch.empty, (0,), {"dtype": x.meta["example_value"].dtype
                                                                          if "example_value" in x.meta else None})
                    user.replace_input_with(x, empty)
        for x in [*chain, head]:
            if not x.users:
                gm.graph.erase_node(x)
        tiled += 1
    return finish_pass(gm, tiled)
