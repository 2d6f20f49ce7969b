"""Memory accounting per device: model states, activations by liveness, checkpointing.

Model states: parameters, optimizer states (AdamW: fp32 moments, + fp32 master
weights for low-precision parameters) and gradients, divided by the ZeRO stage
(3: parameters; 1: optimizer states; 2: gradients too).

Activations: liveness over the captured forward+backward schedule (a tensor lives
from its op to its last reader; views alias their base; gradients live to the
end), evaluated at the local number of tokens.

Checkpointing per layer class keeps of one layer's saved activations, as the compiled path
(AOTAutograd's partitioner, the default) keeps them, or eager autograd (``compiled=False``):
  none       compiled: the partitioner's min-cut (:func:`partitioned_saved`); eagerly:
             everything autograd saves
  selective  every matmul and attention output (eagerly also the region's input)
  full       the layer's input only (one hidden state)
A strategy adds what it saves itself (Ulysses' output all-to-all result:
:func:`autosp.costmodel.phases.strategy_saved`).

A tiled MLP (:mod:`autosp.transform.tiled_mlp`, ``mlp_chunks`` k > 1) saves none of its
intermediates: of the layer's saved bytes, those its MLP's ops saved (``none``) or its
matmul outputs (``selective``) go; its input is saved by the op before it either way.
Compiled under checkpointing it is its own recompute region, which keeps its input (and under
selective its output); under ``full`` it may instead recompute with the whole layer
(``keep_mlp_input=False``): the layer keeps one hidden state, and the attention's recomputed
tensors are alive during the MLP chunks' backward. The planner's constraints per phase:
:mod:`autosp.costmodel.phases`.
"""

from __future__ import annotations

from typing import Any

from autosp.costmodel.dtypes import DTYPE_BYTES, dtype_bytes  # noqa: F401 - where callers read them
from autosp.graph import OpGraph, OpKind, evaluate
from autosp.graph.ops import prod



def tp_regions(graph: OpGraph) -> dict[int, set[str]]:
    """Per captured block, the child modules TP splits (the rule: :mod:`autosp.costmodel.tensor_parallel`):
    the one its attention op runs in, where that op is SDPA on whole heads of one head dim (not
    attention written by hand, not multi-head latent attention), and its tileable MLP (not a
    mixture of experts)."""
    if "tp_regions" not in graph.memo:
        regions: dict[int, set[str]] = {}
        for lc in graph.layer_classes.values():
            for block in lc.captured:
                split = {a.region for a in graph.nodes(phase="fwd", kind=OpKind.ATTENTION, layer=block)
                         if a.region is not None and a.attention is not None and not a.attention.written
                         and not a.attention.v_head_dim}
                split |= {tiled_region(graph, block)} - {None}
                regions[block] = split
        graph.memo["tp_regions"] = regions
    return graph.memo["tp_regions"]


def tp_split_params(graph: OpGraph) -> float:
    """Parameters TP splits: the weights of the matmuls in the split modules (a linear layer's
    weight is its FLOPs over twice its rows), over every layer of each class."""
    if "tp_split_params" not in graph.memo:
        total = 0.0
        for lc in graph.layer_classes.values():
            block = lc.captured[0]
            split = tp_regions(graph).get(block, set())
            for a in graph.nodes(phase="fwd", kind=OpKind.MATMUL, layer=block):
                if a.region in split and a.shapes and a.shapes[0]:
                    out = a.shapes[0]
                    rows = evaluate(prod(out), 1024.0) / evaluate(out[-1], 1024.0)
                    total += lc.count * evaluate(a.flops, 1024.0) / (2 * rows)
        graph.memo["tp_split_params"] = total
    return graph.memo["tp_split_params"]


def params_per_rank(graph: OpGraph, t: int) -> float:
    """Parameters one rank of a TP group of ``t`` holds: the split modules' weights / t
    (:func:`tp_split_params`), the rest whole (the rule: :mod:`autosp.costmodel.tensor_parallel`)."""
    n = float(graph.total_params)
    if t == 1:
        return n
    return n - tp_split_params(graph) * (1 - 1 / t)


def model_states(graph: OpGraph, group: int, zero_stage: int, shard: int = 0, tp: int = 1) -> dict[str, float]:
    """Bytes per device of parameters, optimizer states and gradients under a ZeRO stage; ``shard``
    (stage 3, HSDP): the ranks of the world each parameter is sharded over, 0 = the whole group.
    The one rule: a parameter is split by TP (degree ``tp``) or replicated, then sharded by ZeRO over
    the other axes (``group``: their ranks; a shard group of k ranks holds k / tp of them)."""
    p_bytes = dtype_bytes(graph.dtype)
    n = params_per_rank(graph, tp)
    if zero_stage == 3 and shard:
        group = max(1, shard // tp)
    return {"parameters": n * p_bytes / (group if zero_stage >= 3 else 1),
            "optimizer": n * (8 + (4 if p_bytes < 4 else 0)) / (group if zero_stage >= 1 else 1),
            "gradients": n * p_bytes / (group if zero_stage >= 2 else 1)}


def liveness_peak(graph: OpGraph, tokens: float, phases: dict | None = None,
                  full: float | None = None, fused: bool = False, tp: int = 1,
                  split: frozenset = frozenset()) -> tuple[float, float, float]:
    """(peak live bytes over the captured schedule, gradients alive at the end, most bytes live
    while an attention op runs), with sizes at ``tokens`` per rank; ``phases`` is
    filled with the peaks of the schedule's phases (:func:`_phases`), which the memory decisions
    change differently; ``fused``: as Inductor runs it, the pointwise chains it fuses never
    written (:func:`autosp.costmodel.fusion.fused_away`); ``tp``: a TP degree, which splits the
    ``split`` buffers t ways (:func:`autosp.costmodel.tensor_parallel.split_ops`)."""
    from autosp.costmodel.fusion import fused_away

    if "liveness" not in graph.memo:         # the schedule's structure; only sizes depend on tokens
        graph.memo["liveness"] = lifetimes(graph)
    order, ops, base, last, frees = graph.memo["liveness"]
    gone = fused_away(graph) if fused else frozenset()
    # one every rank makes whole from positions alone (a mask, rotary tables) at the ``full`` length
    size = {b: 0.0 if b in gone else evaluate(ops[b].bytes_written, full if full and ops[b].replicated else tokens)
            for b in last}
    for b in split & size.keys() if tp > 1 else ():
        size[b] /= tp
    end = len(order)
    grads = sum(size[b] for b, i in last.items() if i == end)
    live = peak = at_attention = 0.0
    curve = []
    for i, n in enumerate(order):
        if base[n] == n:
            live += size[n]
            peak = max(peak, live)
        curve.append(live)
        if ops[n].kind == OpKind.ATTENTION:
            at_attention = max(at_attention, live)
        for b in frees.get(i, []):
            live -= size[b]
    if phases is not None:
        phases.update(_phases(graph, order, ops, curve))
    return peak, grads, at_attention


def lifetimes(graph: OpGraph) -> tuple[list[str], dict, dict[str, str], dict[str, int], dict[int, list[str]]]:
    """The schedule's order, its ops, each node's buffer (a view's is its base's), each buffer's
    last use (``len(order)``: a gradient, kept) and the buffers freed after each position."""
    g = graph.graph
    order = list(g.nodes)
    ops = {n: graph.op(n) for n in order}
    idx = {n: i for i, n in enumerate(order)}
    base: dict[str, str] = {}
    for n in order:
        preds = [p for p in g.predecessors(n) if ops[p].holds_memory]
        base[n] = base.get(preds[0], preds[0]) if ops[n].kind == OpKind.VIEW and preds else n
    last = {n: idx[n] for n in order if base[n] == n}
    end = len(order)
    for n in order:
        if not ops[n].holds_memory:
            continue
        succ = list(g.successors(n))
        b = base[n]
        if not succ and ops[n].phase == "bwd":
            last[b] = end                                      # a gradient: kept
        for u in succ:
            if ops[u].holds_memory:
                last[b] = max(last[b], idx[u])
    # A tensor every rank makes whole before the layers (a mask) is read by every layer of the
    # classes that read it; where a class has layers the capture did not trace (they follow the
    # traced ones), its last reader is among them: it lives to the end of the forward.
    shallow = {b for lc in graph.layer_classes.values() if lc.count > len(lc.captured) for b in lc.captured}
    fwd_end = max((idx[n] for n in order if ops[n].phase == "fwd" and ops[n].layer is not None), default=0)
    for n in order:
        if ops[n].replicated and ops[n].layer is None and ops[n].holds_memory and \
                any(ops[u].layer in shallow for u in g.successors(n)):
            last[base[n]] = max(last[base[n]], fwd_end)
    frees: dict[int, list[str]] = {}
    for b, i in last.items():
        frees.setdefault(i, []).append(b)
    return order, ops, base, last, frees


def _phases(graph: OpGraph, order: list[str], ops: dict, curve: list[float]) -> dict[str, Any]:
    """Where the schedule's memory peaks: outside the layers' backward (the loss: ``loss``, and
    what is live as the head and loss begin: ``loss_start``) and, per captured block, during its
    backward, in its tileable MLP (``mlp``) and elsewhere (``rest``)."""
    last_layer_fwd = max((i for i, n in enumerate(order) if ops[n].phase == "fwd" and ops[n].layer is not None),
                         default=0)
    regions = {lc_b: tiled_region(graph, lc_b) for lc in graph.layer_classes.values() for lc_b in lc.captured}
    loss = 0.0
    layers: dict[int, dict[str, float]] = {}
    for i, n in enumerate(order):
        a = ops[n]
        if a.phase == "bwd" and a.layer is not None:
            part = "mlp" if a.region is not None and a.region == regions.get(a.layer) else "rest"
            d = layers.setdefault(a.layer, {"mlp": 0.0, "rest": 0.0})
            d[part] = max(d[part], curve[i])
        else:
            loss = max(loss, curve[i])
    start = curve[last_layer_fwd] if curve else 0.0
    return {"loss": loss, "loss_start": start, "layers": layers}


def untraced_layer_activations(graph: OpGraph, tokens: float) -> float:
    """Saved activations of the layers that were not traced: alive across the forward/backward turn."""
    extra = 0.0
    for lc in graph.layer_classes.values():
        missing = lc.count - len(lc.captured)
        if missing > 0:
            extra += missing * evaluate(graph.block_sum(lc.captured[0], "bytes_saved", "fwd"), tokens)
    return extra


def tiled_region(graph: OpGraph, block: int) -> str | None:
    """The child module of a captured block that ``mlp_chunks`` tiles: the one whose forward is
    matmuls, pointwise ops and views only, with two matmuls at least (the transform's rule, on
    aten ops)."""
    kinds: dict[str, list[OpKind]] = {}
    for a in graph.nodes(phase="fwd", layer=block):
        if a.region is not None:
            kinds.setdefault(a.region, []).append(a.kind)
    allowed = {OpKind.MATMUL, OpKind.POINTWISE, OpKind.VIEW}
    return next((name for name, ks in kinds.items() if ks.count(OpKind.MATMUL) >= 2 and set(ks) <= allowed), None)


def hidden_bytes(graph: OpGraph, tokens: float) -> float:
    """One hidden state at ``tokens`` (the embedding's output)."""
    emb = next(graph.nodes(phase="fwd", kind=OpKind.EMBEDDING), None)
    return evaluate(emb.bytes_written, tokens) if emb else 0.0


def mlp_saved(graph: OpGraph, tokens: float, compiled: bool = True) -> dict[str, dict[str, float]]:
    """Per layer class, what tiling its MLP removes from one layer's saved bytes, per checkpointing
    (``compiled``: of what the partitioner saves, else of what eager autograd saves)."""
    kept = partitioned_saved(graph) if compiled else None
    out = {}
    for fp, lc in graph.layer_classes.items():
        block = lc.captured[0]
        region = tiled_region(graph, block)
        saved = outputs = 0.0
        inside = {a.name for a in graph.nodes(phase="fwd", layer=block) if region is not None and a.region == region}
        for a in graph.nodes(phase="fwd", layer=block):
            if a.name not in inside:
                continue
            # Not a view of what enters: that is the MLP's input, which the chunks save too.
            if a.kind != OpKind.VIEW or any(p in inside for p in graph.graph.predecessors(a.name)):
                if kept is None:
                    saved += evaluate(a.bytes_saved, tokens)
                elif a.name in kept:
                    saved += evaluate(a.bytes_written, tokens)
                if a.kind == OpKind.MATMUL:
                    outputs += evaluate(a.bytes_written, tokens)
        # Compiled under checkpointing, the tiled MLP is its own recompute region, whose input is
        # kept: one hidden state more (eagerly, the chunks nest in the layer's region); under
        # selective its output is kept too (tiled_mlp.py: so that no chunk is recomputed early).
        hidden = hidden_bytes(graph, tokens) if compiled else 0.0
        out[fp] = {"none": saved, "selective": outputs - 2 * hidden, "full": -hidden,
                   "tileable": float(region is not None)}
    return out


# Ops the partitioner never recomputes (compute-bound, or communication), and the backward
# readers that are not fused with a recompute (so what they read is materialised anyway).
_UNFUSIBLE = (OpKind.MATMUL, OpKind.ATTENTION, OpKind.COLLECTIVE, OpKind.EMBEDDING, OpKind.OTHER)


def partitioned_saved(graph: OpGraph) -> set[str]:
    """The forward ops whose outputs AOTAutograd's min-cut partitioner saves for the backward
    when nothing is tagged (checkpointing ``none`` on the compiled path), read off the captured
    joint graph with the partitioner's rules:

      * the backward needs what eager autograd saves (ops with ``bytes_saved``);
      * a needed value is saved, or recomputed from saved values by fusible ops (pointwise,
        reductions, views, creation, the loss's log-softmax);
      * never recomputed: matmuls, attention, collectives, embeddings; an op a non-fusible
        backward op reads (a matmul's input for its weight gradient: it is materialised
        anyway); a reduction whose output is 4x smaller than its inputs (a norm's statistics);
      * of the cuts that satisfy these, the one saving the fewest bytes (a max-flow min-cut,
        node capacities = output bytes at the captured length; views cost their base).

    Eager autograd instead saves every needed value as it is: a pointwise chain's inputs and
    intermediates, where the partitioner keeps one tensor and recomputes the rest."""
    cached = graph.memo.get("partitioned_saved")
    if cached is not None:
        return cached
    import networkx as nx

    g, n_tok = graph.graph, graph.seq_len
    fwd = [n for n in g.nodes if graph.op(n).phase == "fwd" and graph.op(n).holds_memory]
    fwd_set = set(fwd)

    def size(n: str) -> float:
        return float(evaluate(graph.op(n).bytes_written, n_tok))

    def bwd_readers(n: str) -> list[str]:
        """Backward ops reading ``n``, directly or through forward views of it."""
        out, todo, seen = [], [n], {n}
        while todo:
            for u in g.successors(todo.pop()):
                if graph.op(u).phase == "bwd":
                    out.append(u)
                elif graph.op(u).kind == OpKind.VIEW and u not in seen:
                    seen.add(u)
                    todo.append(u)
        return out

    flow = nx.DiGraph()
    for n in fwd:
        a = graph.op(n)
        readers = bwd_readers(n)
        ins = [p for p in g.predecessors(n) if p in fwd_set]
        inputs = sum(size(p) for p in ins)
        banned = a.kind in _UNFUSIBLE or any(graph.op(u).kind in _UNFUSIBLE for u in readers) \
            or (a.kind == OpKind.REDUCTION and 4 * size(n) < inputs)
        flow.add_edge(n + ":in", n + ":out", capacity=float("inf") if a.kind == OpKind.VIEW else size(n))
        if banned and a.kind != OpKind.VIEW:
            flow.add_edge("source", n + ":in")                  # only saving it brings it back
        if any(graph.op(u).phase == "bwd" for u in g.successors(n)):
            flow.add_edge(n + ":out", "sink")                   # the backward reads it
        for p in ins:
            flow.add_edge(p + ":out", n + ":in")
    if "source" not in flow or "sink" not in flow:
        out: set[str] = set()
    else:
        _, (reach, _) = nx.minimum_cut(flow, "source", "sink")
        out = {n for n in fwd if n + ":in" in reach and n + ":out" not in reach}
    graph.memo["partitioned_saved"] = out
    return out


def saved_per_layer(graph: OpGraph, tokens: float, compiled: bool = True) -> dict[str, dict[str, float]]:
    """Per layer class: saved activation bytes of one layer under each checkpointing choice;
    ``compiled``: through AOTAutograd's partitioner (the default compile path), else as eager
    autograd saves them (what the captured schedule holds)."""
    hidden = hidden_bytes(graph, tokens)
    kept = partitioned_saved(graph) if compiled else None
    out = {}
    for fp, lc in graph.layer_classes.items():
        saved = sel = 0.0
        for a in graph.nodes(phase="fwd", layer=lc.captured[0]):
            if kept is None:
                saved += evaluate(a.bytes_saved, tokens)
            elif a.name in kept:
                saved += evaluate(a.bytes_written, tokens)
            if a.kind in (OpKind.MATMUL, OpKind.ATTENTION):
                # Selective checkpointing keeps every output of these ops for the recompute (whether
                # or not autograd saves it), and recomputes the rest.
                sel += evaluate(a.bytes_written, tokens)
        # Eagerly, a checkpointed region also keeps its input; compiled, the tags save what they
        # name and the partitioner recomputes the residual stream from them.
        out[fp] = {"none": saved, "selective": sel if compiled else min(sel + hidden, saved),
                   "full": min(hidden, saved)}
    return out


def layer_saved(graph: OpGraph, tokens: float, checkpoint: str, mlp_chunks: int,
                keep_mlp_input: bool = True, compiled: bool = True) -> dict[str, float]:
    """Per layer class: what one layer keeps for backward under a checkpointing mode and MLP tiling
    (``compiled``: on the compiled path, else eagerly: see :func:`saved_per_layer`;
    ``keep_mlp_input=False``: under ``full``, the tiled MLP recomputes with the layer)."""
    mem, tiled = saved_per_layer(graph, tokens, compiled), mlp_saved(graph, tokens, compiled)
    nested = checkpoint == "full" and not keep_mlp_input
    return {fp: mem[fp][checkpoint] - (tiled[fp][checkpoint] if mlp_chunks > 1 and tiled[fp]["tileable"]
                                       and not nested else 0.0)
            for fp in mem}
