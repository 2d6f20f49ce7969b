"""Attention the model writes itself, found in a Dynamo graph and made one call.

A region is what a model computes between its queries, keys and values and its attention output
without ``scaled_dot_product_attention``::

    scores = q @ k^T                 # matmul / bmm / baddbmm (an additive bias: BLOOM's ALiBi)
    scores = f(scores, extras)       # scale, soft-capping tanh (Gemma-2), + mask or bias,
                                     # masked_fill / where with a mask: elementwise
    p = softmax(scores, dim=-1)      # cast, dropout; or softmax with a sink column (gpt-oss),
                                     # folded first into one call (softmax_sink.py)
    out = p @ v

q, k and v are the region's inputs in the ``[batch, heads, seq, head_dim]`` form the model holds
them in before the score matmul (walking back through the views that flatten batch and heads,
BLOOM's ``[batch*heads, seq, head_dim]``); ``out`` is the output in that form again. Everything
in between, and what it computes from sizes of q, k and v, moves into a small graph module; the
outer graph calls :func:`region_attention` instead, which the sharding pass treats as an attention
op and gives a strategy's runtime (:mod:`autosp.strategies.region`).

Those runtimes run the region on other shapes than the model's: Ulysses on fewer heads, the
key-splitting strategies on fewer query rows. So each dim of every tensor in the region is labelled
with the *atoms* it is made of (``b``, ``h``, ``sq``, ``sk``, ``d``, ``dv``: batch, heads, query and
key positions, head dims), propagated op by op; a view or reshape gets its shape from the atoms'
sizes at run time instead of the literals the trace baked in, and an extra (mask, bias) is sliced
along the atoms the strategy splits. An op the propagation cannot follow is refused by name.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from autosp.errors import AutospError
from autosp.strategies.ring_region import register_scores
from autosp.transform.region_atoms import (ELEMENTWISE, MATMUL, RESHAPING, SOFTMAX, VIEWS, Atoms, RegionAtoms,
                                           matmul_operands, op_name, region_shape, source_line, value_of)
from autosp.transform.graph_pass import finish_pass
from autosp.transform.softmax_sink import fold_sinks


@dataclass
class RegionInfo:
    """What a strategy's runtime needs to know of one region (kept on its graph module)."""

    where: str                                   # the model's line of the softmax
    extras: list[Atoms | None]                   # per extra input, its atoms (None: not a tensor)
    positional: list[str] = field(default_factory=list)   # ops that read positions (tril, arange, ...)
    dropout: float = 0.0                         # the largest dropout probability inside
    unsplit: str = ""            # why its softmax cannot be split over key blocks ("": it can)
    score_key: str = ""          # its score function for ring attention (strategies/ring_region.py)
    sink: int = -1               # which extra is a sink column joining the softmax (softmax_sink.py); -1: none


def region_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extras: Any,
                     region: fx.GraphModule) -> torch.Tensor:
    """The region as the model wrote it (what runs when the graph is not sharded)."""
    return region(q, k, v, *extras)


def _seq_dims(v: Any, syms: set | None = None) -> list[int]:
    """Dims holding the sequence symbols ``syms`` (None: any symbol; the batch may be symbolic too)."""
    if not isinstance(v, torch.Tensor):
        return []
    return [i for i, d in enumerate(v.shape) if isinstance(d, torch.SymInt) and d.node.expr.free_symbols
            and (syms is None or d.node.expr.free_symbols & syms)]


def _shape_of(n: Any) -> str:
    v = value_of(n)
    return f"{n.name} {list(v.shape)}" if isinstance(v, torch.Tensor) else str(n)


def _canonical(n: fx.Node, syms: set) -> bool:
    """``[batch, heads, seq, head_dim]``: four dims, the sequence only at dim 2."""
    v = value_of(n)
    return isinstance(v, torch.Tensor) and v.dim() == 4 and _seq_dims(v, syms) == [2]


def _walk_back(n: fx.Node, syms: set) -> fx.Node | None:
    """From a score or value matmul's operand back to the canonical tensor it is a view of."""
    while True:
        if _canonical(n, syms):
            return n
        if op_name(n) not in RESHAPING or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        n = n.args[0]


def _walk_on(n: fx.Node, syms: set) -> fx.Node | None:
    while not _canonical(n, syms):
        users = list(n.users)
        if len(users) != 1 or op_name(users[0]) not in RESHAPING:
            return None
        n = users[0]
    return n


def _ancestors(n: fx.Node, stop: set[fx.Node]) -> set[fx.Node]:
    seen, stack = set(), [n]
    while stack:
        x = stack.pop()
        if x in seen or x in stop:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
    return seen


def _descendants(roots: list[fx.Node]) -> set[fx.Node]:
    seen, stack = set(), [u for r in roots for u in r.users]
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.users)
    return seen


@dataclass
class _Found:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    out: fx.Node
    softmax: fx.Node
    nodes: list[fx.Node]          # in graph order
    value: fx.Node | None = None  # the value matmul


def _find(graph: fx.Graph) -> list[_Found]:
    found = []
    for sm in graph.nodes:
        if sm.op not in ("call_function", "call_method") or op_name(sm) not in SOFTMAX:
            continue
        x = sm.args[0] if sm.args else None
        xv = value_of(x)
        if not isinstance(xv, torch.Tensor) or xv.dim() < 2 or len(_seq_dims(xv)) < 2 \
                or _seq_dims(xv)[-2:] != [xv.dim() - 2, xv.dim() - 1]:
            continue
        # the sequence: what sizes the scores' rows and columns (a batch may be symbolic too)
        syms = {s for d in xv.shape[-2:] for s in d.node.expr.free_symbols}
        # the score matmul: an ancestor over [.., S, S] tensors that multiplies [.., S, d] by [.., d, S]
        scores, stack, seen = [], [x], set()
        while stack:
            a = stack.pop()
            if a in seen or not isinstance(a, fx.Node):
                continue
            seen.add(a)
            if op_name(a) in MATMUL:
                scores.append(a)
                continue
            av = value_of(a)
            if isinstance(av, torch.Tensor) and len(_seq_dims(av, syms)) >= 2:
                stack.extend(a.all_input_nodes)
        if len(scores) != 1:
            continue
        _, left, right = matmul_operands(scores[0])
        # the value matmul: softmax, then casts / dropout / views, then @ v
        p = sm
        while len(p.users) == 1 and op_name(next(iter(p.users))) not in MATMUL:
            p = next(iter(p.users))
            if op_name(p) not in ELEMENTWISE | VIEWS:
                break
        users = list(p.users)
        if len(users) != 1 or op_name(users[0]) not in MATMUL:
            raise AutospError(f"the attention weights of the softmax at {source_line(sm)} are used for more than the "
                              "value matmul (returned, or read twice); SP shards attention whose weights stay "
                              "inside it: do not return them (output_attentions=False)")
        value = users[0]
        _, pl, vr = matmul_operands(value)
        q, k = _walk_back(left, syms), _walk_back(right, syms) if isinstance(right, fx.Node) else None
        v = _walk_back(vr, syms) if isinstance(vr, fx.Node) else None
        out = _walk_on(value, syms)
        if pl is not p or None in (q, k, v, out):
            raise AutospError(f"the attention written by hand at {source_line(sm)} does not take its queries, keys, "
                              "values and output in a [batch, heads, seq, head_dim] form autosp can follow "
                              f"({', '.join(_shape_of(x) for x in (left, right, vr, value))}); "
                              "write it so, or call F.scaled_dot_product_attention")
        inside = _descendants([q, k, v]) & (_ancestors(out, {q, k, v}) | {out})
        nodes = [n for n in graph.nodes if n in inside]
        found.append(_Found(q, k, v, out, sm, nodes, value))     # type: ignore[arg-type]
    return found


# ------------------------------------------------------------------ the rewrite


def extract_regions(gm: fx.GraphModule) -> int:
    """Replace every region of ``gm`` by a call of :func:`region_attention`; returns how many."""
    graph = gm.graph
    fold_sinks(gm)
    regions = _find(graph)
    for i, f in enumerate(regions):
        labels = RegionAtoms(f)
        inside = set(f.nodes)
        extras = [a for n in f.nodes for a in n.all_input_nodes if a not in inside and a not in (f.q, f.k, f.v)]
        extras = list(dict.fromkeys(e for e in extras if not _only_in_recipes(e, inside, labels.recipes)))
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for name, x in (("q", f.q), ("k", f.k), ("v", f.v)):
            env[x] = sub.placeholder(name)
        for j, e in enumerate(extras):
            env[e] = sub.placeholder(f"extra_{j}")
        for n in f.nodes:
            if op_name(n) == "dropout" and _dropout(n) == 0.0:
                # F.dropout(p=0.0, training=True) copies its S x S input, which the value matmul then
                # saves beside the softmax's output: the identity it is keeps one copy
                env[n] = env[n.args[0]]
                continue
            if n in labels.recipes:
                shape = sub.call_function(region_shape, (env[f.q], env[f.k], env[f.v], labels.recipes[n]))
                env[n] = sub.call_method(op_name(n) if op_name(n) != "_unsafe_view" else "reshape",
                                         (env[n.args[0]], shape))
            else:
                env[n] = sub.node_copy(n, lambda x: env[x])
            env[n].meta = dict(n.meta)
        sub.output(env[f.out])
        module = fx.GraphModule(torch.nn.Module(), sub)
        atoms = [labels.extra_atoms.get(e) for e in extras]
        scores = _scores_of(sub, env[f.softmax].args[0].name)
        unsplit = _unsplit(f, labels, extras, scores)
        sink = -1
        if op_name(f.softmax) == "softmax_with_sink":
            if f.softmax.args[1] in extras:
                sink = extras.index(f.softmax.args[1])
            else:
                unsplit = unsplit or "computes its sink column inside it"
        module.autosp_region = RegionInfo(       # type: ignore[assignment]
            where=source_line(f.softmax), extras=atoms, positional=labels.positional,
            dropout=max((_dropout(n) for n in f.nodes if op_name(n) == "dropout"), default=0.0),
            unsplit=unsplit, sink=sink,
            score_key="" if unsplit else register_scores(scores, atoms))
        attr = f"autosp_region_{i}"
        gm.add_submodule(attr, module)
        with graph.inserting_before(f.out):
            ref = graph.get_attr(attr)
            call = graph.call_function(region_attention, (f.q, f.k, f.v, *extras), {"region": ref})
        call.meta = {k: v for k, v in f.out.meta.items()}
        call.meta["autosp_region"] = module.autosp_region
        f.out.replace_all_uses_with(call)
        for n in reversed(f.nodes):
            if not n.users:
                graph.erase_node(n)
    return finish_pass(gm, len(regions))


# between the softmax and the value matmul: what a blockwise softmax may skip
_AFTER_SOFTMAX = VIEWS | {"to", "float", "type_as", "contiguous", "clone", "dropout"}


def _unsplit(f: _Found, labels: RegionAtoms, extras: list[fx.Node], scores: fx.GraphModule) -> str:
    """Why ring attention cannot run this region over key blocks ("" when it can): its softmax
    must read only ``[batch, heads, q, k]`` scores made from q, k and tensors from outside."""
    read = [p for p in scores.graph.nodes if p.op == "placeholder"][3:]
    sizes = [e.name for e, p in zip(extras, read) if p.users and isinstance(value_of(e), (int, torch.SymInt))]
    if sizes:
        return f"computes its scores with a size from outside it ({sizes[0]})"
    if labels.positional:
        return f"reads token positions inside it ({labels.positional[0]})"
    atoms = labels.atoms.get(f.softmax.args[0]) or ()
    if tuple(atoms[-2:]) != (("sq",), ("sk",)) or not {a for d in atoms[:-2] for a in d} <= {"b", "h"}:
        return "softmaxes scores not laid out as [batch, heads, queries, keys]"
    if f.softmax.kwargs.get("dtype", torch.float32) not in (torch.float32, None):
        return "softmaxes in a precision below fp32"
    feeding = _ancestors(f.value, set())
    between = [n for n in f.nodes if n not in (f.softmax, f.value) and n in feeding and
               f.softmax in _ancestors(n, set())]
    odd = [op_name(n) for n in between if op_name(n) not in _AFTER_SOFTMAX] + \
        [op_name(f.value)] * (op_name(f.value) == "baddbmm")
    return f"runs {odd[0]} between its softmax and the value matmul" if odd else ""


def _scores_of(region: fx.Graph, scores: str) -> fx.GraphModule:
    """The region's graph up to the softmax's input: ``(q, k, v, *extras) -> scores``."""
    g = copy.deepcopy(region)
    end = next(n for n in g.nodes if n.name == scores)
    g.erase_node(next(n for n in g.nodes if n.op == "output"))
    g.output(end)
    g.eliminate_dead_code()
    return fx.GraphModule(torch.nn.Module(), g)


def _dropout(n: fx.Node) -> float:
    """F.dropout(x, p=0.5, training=True): its probability when it is on (1.0 when unknown)."""
    p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
    training = n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True)
    try:        # a graph input when Dynamo keeps floats symbolic: its value at this compile
        p = float(value_of(p)) if isinstance(p, fx.Node) else float(p)
        training = bool(value_of(training)) if isinstance(training, fx.Node) else bool(training)
    except (TypeError, ValueError):
        return 1.0
    return p if training else 0.0


def _only_in_recipes(e: fx.Node, inside: set[fx.Node], recipes: dict[fx.Node, Atoms]) -> bool:
    """An input read only as a view's size (the trace's literal length): the recipe replaces it."""
    users = [u for u in e.users if u in inside]
    return bool(users) and all(u in recipes and e not in u.args[:1] for u in users) and \
        not isinstance(value_of(e), torch.Tensor)


REGION_TARGETS: set[Callable[..., Any]] = {region_attention}
