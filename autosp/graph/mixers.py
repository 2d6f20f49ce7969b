"""Sequence mixers in the captured step: the layers' modules that mix tokens without attention.

The sharding pass runs such a module gathered (:mod:`autosp.transform.sequence_mixers`): a child of
a block, with no attention op in it, that runs a convolution, a pad, a cumulative op or a cut
along the sequence (a Mamba-2 or gated DeltaNet layer's causal conv1d and chunked scan, MiniMax's
lightning attention in blocks). Here the same modules are found in the captured aten graph, so
the cost model can cost them as they run: on the whole sequence on every rank.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import sympy
import torch

from autosp.graph.ops import OpKind

_SCANS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}


def _has_seq(e: Any, S: sympy.Symbol) -> bool:
    return isinstance(e, sympy.Basic) and S in e.free_symbols


def works_along_sequence(n: torch.fx.Node, input_shape: tuple | None, S: sympy.Symbol) -> bool:
    """Whether aten op ``n`` mixes entries along a sequence dim of its first input (of shape
    ``input_shape``, sizes in ``S``)."""
    if not input_shape:
        return False
    seq = {d for d, e in enumerate(input_shape) if _has_seq(e, S)}
    if not seq:
        return False
    name = getattr(getattr(n.target, "_overloadpacket", None), "__name__", "")
    ndim = len(input_shape)
    if name == "convolution":
        return bool(seq & set(range(2, ndim)))
    if name == "constant_pad_nd":
        pads = n.args[1] if len(n.args) > 1 else ()
        return bool(seq & {ndim - 1 - i // 2 for i, p in enumerate(pads) if not (isinstance(p, int) and p == 0)})
    if name in _SCANS:
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        return isinstance(dim, int) and dim % ndim in seq
    if name == "slice":
        dim, start, end = (list(n.args[1:4]) + [0, None, None])[:3] if len(n.args) > 1 else (0, None, None)
        whole = start in (None, 0) and (end is None or (isinstance(end, int) and end >= 2 ** 62))
        return isinstance(dim, int) and dim % ndim in seq and not whole
    return False


def mark_gathered(g: nx.DiGraph, forward: list[torch.fx.Node], shapes_of: dict) -> list[tuple[int, str]]:
    """Mark every op (forward and backward) of a block's child module that has no attention op and
    holds a ``forward`` op that works along the sequence as ``gathered`` (``shapes_of``: each node's
    output shapes, sizes in S); returns the (block, child) pairs marked."""
    from autosp.graph.opgraph import S

    along = set()
    for n in forward:
        first = n.args[0] if n.op == "call_function" and n.args and isinstance(n.args[0], torch.fx.Node) else None
        if first is not None and works_along_sequence(n, (shapes_of.get(first) or [None])[0], S):
            along.add(n.name)
    groups: dict[tuple[int, str], list[Any]] = {}
    for _, data in g.nodes(data=True):
        a = data["op"]
        if a.layer is not None and a.region is not None:
            groups.setdefault((a.layer, a.region), []).append(a)
    marked = []
    for key, ops in groups.items():
        if any(a.kind == OpKind.ATTENTION for a in ops) or not any(a.name in along for a in ops):
            continue
        for a in ops:
            a.gathered = True
        marked.append(key)
    return sorted(marked)
