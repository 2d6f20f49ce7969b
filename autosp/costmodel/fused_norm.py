"""What running a layer's RMSNorms as one op (:mod:`autosp.transform.fused_norm`) takes out of
what eager autograd saves for it.

Read off the captured aten graph: an RMSNorm is the chain ``[_to_copy fp32] -> pow -> mean ->
add -> rsqrt``, ``mul(x32, rsqrt) -> [_to_copy] -> mul(weight, .)``. Eagerly its ops save the fp32
copy and the normalised tensor (bf16 model: three hidden states' worth); fused, the op saves its
input and the reciprocal RMS. So a norm's saving is what its chain's ops save, less the
reciprocal RMS, less its input where nothing else saved that (the residual stream inside a layer;
a layer's input is what full checkpointing keeps already).
"""

from __future__ import annotations

from autosp.graph import OpGraph, OpNode, evaluate


def _one(graph: OpGraph, names: list[str], target: str) -> OpNode | None:
    found = [graph.op(n) for n in names if graph.op(n).target.startswith(target)]
    return found[0] if len(found) == 1 else None


def _chain(graph: OpGraph, rsqrt: OpNode) -> tuple[str, list[OpNode]] | None:
    """(the norm's input, the chain's ops) around one ``rsqrt``, or None where it is not a norm."""
    g = graph.graph
    add = _one(graph, list(g.predecessors(rsqrt.name)), "aten.add")
    mean = add and _one(graph, list(g.predecessors(add.name)), "aten.mean")
    pow_ = mean and _one(graph, list(g.predecessors(mean.name)), "aten.pow")
    if pow_ is None:
        return None
    x32 = next(iter(g.predecessors(pow_.name)), None)
    mul = next((graph.op(u) for u in g.successors(rsqrt.name)
                if graph.op(u).target.startswith("aten.mul") and x32 in set(g.predecessors(u))), None)
    if x32 is None or mul is None:
        return None
    chain = [pow_, mean, add, rsqrt, mul]
    x = x32
    if graph.op(x32).target.startswith("aten._to_copy"):
        chain.insert(0, graph.op(x32))
        x = next(iter(g.predecessors(x32)), x32)
    down = _one(graph, [u for u in g.successors(mul.name) if graph.op(u).phase == "fwd"], "aten._to_copy")
    last = down or mul
    out = _one(graph, [u for u in g.successors(last.name) if graph.op(u).phase == "fwd"], "aten.mul")
    if out is None:
        return None
    chain += [down, out] if down is not None else [out]
    return x, chain


def _norms(graph: OpGraph, fp: str, region: str | None) -> list[tuple[str, list[OpNode]]]:
    """(input, chain) of each RMSNorm in one layer of class ``fp`` outside ``region``; read once
    per graph (the planner asks for every option of every SP degree)."""
    memo = graph.memo.setdefault("rms_norms", {})
    if (fp, region) not in memo:
        block = graph.layer_classes[fp].captured[0]
        found = (_chain(graph, a) for a in graph.nodes(phase="fwd", layer=block)
                 if a.target.startswith("aten.rsqrt") and (region is None or a.region != region))
        memo[(fp, region)] = [f for f in found if f is not None]
    return memo[(fp, region)]


def fused_norm_saving(graph: OpGraph, tokens: float, region: str | None = None) -> dict[str, float]:
    """Per layer class, the bytes one layer's eager saves lose when its RMSNorms outside
    ``region`` (the tiled MLP's child module) run fused, at ``tokens`` per rank."""
    out: dict[str, float] = {}
    for fp, lc in graph.layer_classes.items():
        mine = {a.name for a in graph.nodes(phase="fwd", layer=lc.captured[0])}
        saving = 0.0
        for x, chain in _norms(graph, fp, region):
            rsqrt = next(c for c in chain if c.target.startswith("aten.rsqrt"))
            saving += sum(evaluate(c.bytes_saved, tokens) for c in chain) - evaluate(rsqrt.bytes_written, tokens)
            producer = graph.op(x)
            if x in mine and not evaluate(producer.bytes_saved, tokens):
                saving -= evaluate(producer.bytes_written, tokens)      # the op saves its input
        out[fp] = max(saving, 0.0)
    return out
