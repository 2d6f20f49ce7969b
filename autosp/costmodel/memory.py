"""Memory accounting per device: model states, activations by liveness, checkpointing.

Model states: parameters, optimizer states (AdamW: fp32 moments, + fp32 master
weights for low-precision parameters) and gradients, divided by the ZeRO stage
(3: parameters; 1: optimizer states; 2: gradients too).

Activations: liveness over the captured forward+backward schedule (a tensor lives
from its op to its last reader; views alias their base; gradients live to the
end), evaluated at the local number of tokens.

Checkpointing per layer class keeps of one layer's saved activations:
  none       everything autograd saves
  selective  what is expensive to recompute: every matmul and attention output
  full       the layer's input only (one hidden state)

A tiled MLP (:mod:`autosp.transform.tiled_mlp`, ``mlp_chunks`` k > 1) saves none of its
intermediates: of the layer's saved bytes, those its MLP's ops saved (``none``) or its
matmul outputs (``selective``) go; its input is saved by the op before it either way.
Under ``full`` nothing changes in what is saved (the chunks shrink the recompute transient).
"""

from __future__ import annotations

from typing import Any

from autosp.graph import OpGraph, OpKind, evaluate

CHECKPOINTS = ("none", "selective", "full")
MLP_CHUNKS = (1, 8)            # token chunks of a layer's MLP the planner chooses between
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 2)


def model_states(graph: OpGraph, group: int, zero_stage: int) -> dict[str, float]:
    """Bytes per device of parameters, optimizer states and gradients under a ZeRO stage."""
    p_bytes = dtype_bytes(graph.dtype)
    n = graph.total_params
    return {"parameters": n * p_bytes / (group if zero_stage >= 3 else 1),
            "optimizer": n * (8 + (4 if p_bytes < 4 else 0)) / (group if zero_stage >= 1 else 1),
            "gradients": n * p_bytes / (group if zero_stage >= 2 else 1)}


def liveness_peak(graph: OpGraph, tokens: float, phases: dict | None = None) -> tuple[float, float, float]:
    """(peak live bytes over the captured schedule, gradients alive at the end, most bytes live
    while an attention op runs), with sizes evaluated at ``tokens`` per rank; ``phases`` is filled
    with the peaks of the schedule's phases (:func:`_phases`), which the memory decisions change
    differently."""
    g = graph.graph
    order = list(g.nodes)
    ops = {n: graph.op(n) for n in order}
    idx = {n: i for i, n in enumerate(order)}
    base: dict[str, str] = {}
    size: dict[str, float] = {}
    for n in order:
        preds = [p for p in g.predecessors(n) if ops[p].holds_memory]
        if ops[n].kind == OpKind.VIEW and preds:
            base[n] = base.get(preds[0], preds[0])
        else:
            base[n] = n
            size[n] = evaluate(ops[n].bytes_written, tokens)
    last = {b: idx[b] for b in size}
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
    grads = sum(size.get(b, 0.0) for b, i in last.items() if i == end)
    frees: dict[int, list[str]] = {}
    for b, i in last.items():
        frees.setdefault(i, []).append(b)
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


def mlp_saved(graph: OpGraph, tokens: float) -> dict[str, dict[str, float]]:
    """Per layer class, what tiling its MLP removes from one layer's saved bytes, per checkpointing."""
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
                saved += evaluate(a.bytes_saved, tokens)
                if a.kind == OpKind.MATMUL:
                    outputs += evaluate(a.bytes_written, tokens)
        out[fp] = {"none": saved, "selective": outputs, "full": 0.0, "tileable": float(region is not None)}
    return out


def saved_per_layer(graph: OpGraph, tokens: float) -> dict[str, dict[str, float]]:
    """Per layer class: saved activation bytes of one layer under each checkpointing choice."""
    emb = next(graph.nodes(phase="fwd", kind=OpKind.EMBEDDING), None)
    hidden = evaluate(emb.bytes_written, tokens) if emb else 0.0
    out = {}
    for fp, lc in graph.layer_classes.items():
        saved = sel = 0.0
        for a in graph.nodes(phase="fwd", layer=lc.captured[0]):
            saved += evaluate(a.bytes_saved, tokens)
            if a.kind in (OpKind.MATMUL, OpKind.ATTENTION):
                # Selective checkpointing keeps every output of these ops for the recompute (whether
                # or not autograd saves it), and recomputes the rest.
                sel += evaluate(a.bytes_written, tokens)
        out[fp] = {"none": saved, "selective": min(sel + hidden, saved), "full": min(hidden, saved)}
    return out


def layer_saved(graph: OpGraph, tokens: float, checkpoint: str, mlp_chunks: int) -> dict[str, float]:
    """Per layer class: what one layer keeps for backward under a checkpointing mode and MLP tiling."""
    mem, tiled = saved_per_layer(graph, tokens), mlp_saved(graph, tokens)
    return {fp: mem[fp][checkpoint] - (tiled[fp][checkpoint] if mlp_chunks > 1 and tiled[fp]["tileable"] else 0.0)
            for fp in mem}


LOSS_CHUNKS = (1, 8)           # token chunks of the LM head and loss the planner chooses between


def peak_terms(graph: OpGraph, tokens: float, phases: dict[str, Any], nonstep: float, untraced: float,
               workspace: float, loss_chunks: int) -> dict[Any, float]:
    """The constants of the planner's memory constraints for one mesh (see :mod:`autosp.planner.ilp`).

    The captured schedule without decisions peaks in phases: at the loss (what is live when the
    head starts, ``loss_start``, plus the head and loss's transient, which ``loss_chunks`` divides)
    and during each layer's backward. Under any decisions, every layer but the one running its
    backward holds what its options keep (the shared term sum_c count_c * s_c(o)); so each phase's
    constant is the schedule's value there with every layer's saved bytes taken out:
        "loss"          nonstep + untraced + loss_start + (loss - loss_start) / k - sum_c count_c s_c(none)
        (c, "mlp")      nonstep + untraced + mlp_c - sum_c count_c s_c(none)
        (c, "rest")     nonstep + untraced + rest_c + workspace - sum_c count_c s_c(none)
    where ``nonstep`` is what exists outside the step (parameters, optimizer states, gradients)
    and ``untraced`` the saved activations of the layers not traced."""
    s_none = layer_saved(graph, tokens, "none", 1)
    total = sum(lc.count * s_none[fp] for fp, lc in graph.layer_classes.items())
    head = phases["loss_start"] + (phases["loss"] - phases["loss_start"]) / loss_chunks
    out: dict[Any, float] = {"loss": nonstep + untraced + head - total}
    for fp, lc in graph.layer_classes.items():
        block = max(lc.captured)          # the class's last traced layer: its backward runs first
        d = phases["layers"].get(block)
        if d is None:
            continue
        out[(fp, "mlp")] = nonstep + untraced + d["mlp"] - total
        out[(fp, "rest")] = nonstep + untraced + d["rest"] + workspace - total
    return out


def own_bytes(graph: OpGraph, tokens: float, fp: str, checkpoint: str, mlp_chunks: int) -> dict[str, float]:
    """What one layer of class ``fp`` holds during its own backward beyond what its option keeps:
    its activations come back as without checkpointing (recomputed), a tiled MLP's one chunk at a
    time."""
    none = layer_saved(graph, tokens, "none", 1)[fp]
    kept = layer_saved(graph, tokens, checkpoint, mlp_chunks)[fp]
    tiled = mlp_saved(graph, tokens)[fp]
    shrink = (1 - 1 / mlp_chunks) * tiled["none"] if mlp_chunks > 1 and tiled["tileable"] else 0.0
    return {"mlp": none - kept - shrink, "rest": none - kept}


def decided_peak(graph: OpGraph, tokens: float, terms: dict[Any, float], choice: dict[str, tuple[str, int]]) -> float:
    """The largest memory constraint's value under per-class (checkpointing, MLP chunks) choices."""
    shared = sum(lc.count * layer_saved(graph, tokens, *choice[fp])[fp] for fp, lc in graph.layer_classes.items())
    peaks = [terms["loss"] + shared]
    for key, base in terms.items():
        if key != "loss":
            fp, phase = key
            peaks.append(base + shared + own_bytes(graph, tokens, fp, *choice[fp])[phase])
    return max(peaks)
