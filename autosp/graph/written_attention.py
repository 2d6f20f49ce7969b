"""Attention the model writes itself, in the captured aten graph: costed as one attention op.

The transform cuts such a region out of the model's graph and runs it under a strategy
(:mod:`autosp.transform.attention_region`); the cost model must see it the same way. In the
joint aten graph the region is ``bmm(q, k^T) -> pointwise -> _softmax -> bmm(p, v)`` with views
between, and in the backward the ops autograd made for them. Here:

  * the value ``bmm`` becomes the forward attention op and the region's first backward op the
    backward one (:class:`~autosp.graph.opgraph.AttentionOp` with ``written=True``: costed by the
    strategy, which splits it as it runs it);
  * every other op of the region, forward and backward, is costed inside them (a view here), since
    its ``S x S`` sizes per rank follow the strategy, not the local token count: ``B*H*S*S/P``
    entries under Ulysses and all-gather-KV alike;
  * what the region's ``S x S`` tensors cost, per score entry, is measured from the graph: bytes
    saved for the backward, bytes live at once in the forward, bytes its pointwise ops move
    (``score_saved``, ``score_live``, ``score_traffic``); the strategies charge them per rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autosp.graph.opgraph import AttentionOp, evaluate
from autosp.graph.ops import attention_flops, prod

_MATMUL = {"bmm", "baddbmm", "mm", "matmul"}
_POSITIONAL = {"tril", "triu", "cumsum", "cumprod", "logcumsumexp"}     # what reads positions in a region
_VIEWISH = {"view", "_unsafe_view", "expand", "transpose", "permute", "clone", "t", "contiguous", "alias",
            "reshape", "squeeze", "unsqueeze", "_reshape_alias", "as_strided", "detach"}


@dataclass
class Written:
    """One region of the captured graph."""

    q: fx.Node
    k: fx.Node
    forward: fx.Node                       # the value bmm: the forward attention op
    backward: fx.Node | None               # the region's first backward op: the backward one
    inside: list[fx.Node] = field(default_factory=list)   # costed inside the two (forward and backward)


def _name(n: fx.Node) -> str:
    t = n.target
    name = getattr(t, "__name__", str(t))
    return name.split(".")[0]


def _sym_dims(n: Any) -> list[int]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return []
    return [i for i, d in enumerate(v.shape) if isinstance(d, torch.SymInt) and d.node.expr.free_symbols]


def _canonical(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dim() == 4 and _sym_dims(n) == [2]


def _back(n: Any) -> fx.Node | None:
    while isinstance(n, fx.Node):
        if _canonical(n):
            return n
        if _name(n) not in _VIEWISH or not n.args:
            return None
        n = n.args[0]
    return None


def _operands(n: fx.Node) -> tuple[Any, Any]:
    return (n.args[1], n.args[2]) if _name(n) == "baddbmm" else (n.args[0], n.args[1])


def find_written(nodes: list[fx.Node], boundary: int) -> list[Written]:
    """The regions among ``nodes`` (``boundary``: the first backward node's index)."""
    index = {n: i for i, n in enumerate(nodes)}
    fwd = lambda n: index.get(n, boundary) < boundary       # noqa: E731
    found = []
    for sm in nodes[:boundary]:
        if sm.op != "call_function" or _name(sm) not in ("_softmax", "softmax"):
            continue
        x = sm.args[0]
        dims = _sym_dims(x)
        rank = x.meta["val"].dim() if isinstance(x, fx.Node) else 0
        if dims[-2:] != [rank - 2, rank - 1]:
            continue
        scores, stack, seen = [], [x], set()
        while stack:
            a = stack.pop()
            if not isinstance(a, fx.Node) or a in seen:
                continue
            seen.add(a)
            if _name(a) in _MATMUL:
                scores.append(a)
            elif len(_sym_dims(a)) >= 2:
                stack.extend(a.all_input_nodes)
        values, stack, seen = [], [sm], set()
        while stack:                          # softmax -> casts, dropout, views -> bmm(p, v)
            a = stack.pop()
            for u in a.users:
                if u in seen or not fwd(u) or _name(u) == "detach":
                    continue
                seen.add(u)
                if _name(u) in _MATMUL:
                    if u.args[0] is a:
                        values.append(u)
                elif len(_sym_dims(u)) >= 2:
                    stack.append(u)
        if len(scores) != 1 or len(values) != 1:
            continue
        left, right = _operands(scores[0])
        q, k, v = _back(left), _back(right), _back(values[0].args[1])
        out = values[0]
        while not _canonical(out) and len(out.users) == 1 and _name(next(iter(out.users))) in _VIEWISH:
            out = next(iter(out.users))
        if None in (q, k, v) or not _canonical(out):
            continue
        inside = _between([q, k, v], out, fwd)
        inside.discard(values[0])
        seq_nrs = {n.meta.get("seq_nr") for n in inside | {values[0]}} - {None}
        backward = [n for n in nodes[boundary:] if n.op == "call_function" and n.meta.get("seq_nr") in seq_nrs]
        found.append(Written(q=q, k=k, forward=values[0], backward=backward[0] if backward else None,
                             inside=sorted(inside | set(backward[1:]), key=index.__getitem__)))
    return found


def _between(roots: list[fx.Node], out: fx.Node, fwd: Any) -> set[fx.Node]:
    """Forward nodes on a path from ``roots`` to ``out`` (``out`` included, roots not)."""
    down, stack = set(), [u for r in roots for u in r.users]
    while stack:
        x = stack.pop()
        if x not in down and fwd(x):
            down.add(x)
            stack.extend(x.users)
    up, stack = set(), [out]
    while stack:
        x = stack.pop()
        if x not in up and x not in roots:
            up.add(x)
            stack.extend(x.all_input_nodes)
    return down & up


def roles(written: list[Written]) -> dict[fx.Node, tuple[str, Written]]:
    """Per node of a region: "forward" or "backward" (the attention op) or "inside"."""
    out: dict[fx.Node, tuple[str, Written]] = {}
    for w in written:
        for n in w.inside:
            out[n] = ("inside", w)
        out[w.forward] = ("forward", w)
        if w.backward is not None:
            out[w.backward] = ("backward", w)
    return out


def score_costs(w: Written, nodes: list[fx.Node], boundary: int, nbytes: Any, seq_len: int) -> dict[str, float]:
    """Bytes per score entry (``batch * heads * S * S``) the region's ``S x S`` tensors take: saved
    for its backward, live at once at the region's peak (forward or backward, the saved ones
    included), moved by its forward's pointwise ops. ``nbytes(node)``: its output's bytes at
    ``seq_len``."""
    index = {n: i for i, n in enumerate(nodes)}
    later = lambda n: index.get(n, 0) >= boundary          # noqa: E731
    qv = w.q.meta["val"]
    unit = float(qv.shape[0] * qv.shape[1]) * seq_len * seq_len
    region = [n for n in (*w.inside, w.forward, w.backward) if n is not None]
    big = [n for n in region if len(_sym_dims(n)) >= 2 and _name(n) not in _VIEWISH]
    saved = traffic = 0.0
    for n in big:
        if later(n):
            continue
        if any(later(u) or (_name(u) in _VIEWISH and any(later(x) for x in u.users)) for u in n.users):
            saved += nbytes(n)
        if _name(n) not in _MATMUL:
            traffic += nbytes(n) + sum(nbytes(a) for a in n.all_input_nodes if len(_sym_dims(a)) >= 2)
    # a tensor lives from its op to its last reader (through views: the reader of a view reads it)
    events: dict[int, float] = {}
    for n in big:
        readers, stack = [], list(n.users)
        while stack:
            u = stack.pop()
            readers.append(index.get(u, 0))
            if _name(u) in _VIEWISH:
                stack.extend(u.users)
        events[index[n]] = events.get(index[n], 0.0) + nbytes(n)
        end = max(readers, default=index[n]) + 1
        events[end] = events.get(end, 0.0) - nbytes(n)
    live = peak = 0.0
    for i in sorted(events):
        live += events[i]
        peak = max(peak, live)
    return {"score_saved": saved / unit, "score_live": max(peak, saved) / unit, "score_traffic": traffic / unit}


def written_op(role: tuple[str, Written], shapes_of: dict, out_bytes: Any,
                window: int) -> tuple[AttentionOp, Any, Any]:
    """A region's value bmm or first backward op as the attention op: (its AttentionOp, FLOPs, bytes
    written; the backward one stands for dq, dk and dv). The S x S costs are filled in once every
    node's shape is known (:func:`fill_score_costs`)."""
    which, w = role
    q, k = shapes_of[w.q][0], shapes_of[w.k][0]
    op = AttentionOp(batch=prod(q[:-3]), heads=q[-3], kv_heads=k[-3], q_len=q[-2], kv_len=k[-2], head_dim=q[-1],
                     causal=True, masked=True, window=window, written=True,
                     positional=any(_name(n) in _POSITIONAL for n in w.inside))
    backward = which == "backward"
    elem = w.q.meta["val"].element_size()
    return op, attention_flops(q, k, False, backward), 3 * prod(q) * elem if backward else out_bytes


def fill_score_costs(g: Any, role: dict, nodes: list[Any], boundary: int, shapes_of: dict, seq_len: int) -> None:
    """Set each region's S x S costs (:func:`score_costs`) on its attention ops in the OpGraph ``g``."""
    def nbytes(n: Any) -> float:
        v = n.meta.get("val")
        size = sum(evaluate(prod(s), seq_len) for s in shapes_of.get(n, []))
        return float(size) * v.element_size() if isinstance(v, torch.Tensor) else 0.0

    for n, (which, w) in role.items():
        if which != "inside" and n.name in g:
            op = g.nodes[n.name]["op"]
            op.attention = dataclasses.replace(op.attention, **score_costs(w, nodes, boundary, nbytes, seq_len))
