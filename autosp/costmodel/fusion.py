"""Which tensors of the captured step Inductor never writes to memory: a bf16 model's fp32 copies.

The captured schedule materialises every aten op's output, as eager kernels and ``aot_eager`` do.
Inductor fuses a chain of pointwise ops into the kernel of the op that consumes it, computing in
registers. In a bf16 model that matters most where the chain is wider than the model: RMSNorm
upcasts the hidden state to fp32 (two hidden states' bytes), squares and scales it, and its
backward makes several more fp32 tensors of that size; Inductor runs each direction as one kernel
reading and writing bf16, so none of them exists.

The rule: a pointwise op's output wider than the model's dtype is fused away when every op
reading it (through views) is a pointwise op, a reduction or a norm of the same phase (forward
or backward). Never a matmul's, attention's, collective's, embedding's or loss's input (those
kernels read memory), nor what the other phase reads (a saved tensor, a gradient).

Only the wider chains: measured on CPU (``bench/memory_decisions.py --compiler inductor``), an
fp32 model's step held what the unfused schedule counts (within 5%), and dropping every fusible
intermediate predicted 4.5-6% below it; a bf16 model's held less than even the wide rule counts
(28-44% less). What the forward saves for the backward is the partitioner's choice either way
(:func:`autosp.costmodel.memory.partitioned_saved`); :func:`upcast_saved` is what a recomputed
layer no longer holds.
"""

from __future__ import annotations

from autosp.costmodel.memory import dtype_bytes, tiled_region
from autosp.graph import OpGraph, OpKind, evaluate

FUSIBLE_READERS = {OpKind.POINTWISE, OpKind.REDUCTION, OpKind.NORM}


def _wider(dtypes: list[str], width: int) -> bool:
    """A floating-point output wider than the model's dtype (fp32 in a bf16 model)."""
    return bool(dtypes) and dtypes[0].startswith("float") and dtype_bytes(dtypes[0]) > width


def fused_away(graph: OpGraph) -> frozenset[str]:
    """The captured step's ops whose outputs Inductor fuses into their readers' kernels."""
    cached = graph.memo.get("fused_away")
    if cached is not None:
        return cached
    g = graph.graph

    def readers(n: str) -> list[str]:
        out, todo, seen = [], [n], {n}
        while todo:
            for u in g.successors(todo.pop()):
                op = graph.op(u)
                if op.kind == OpKind.VIEW:
                    if u not in seen:
                        seen.add(u)
                        todo.append(u)
                elif op.holds_memory:
                    out.append(u)
        return out

    width = dtype_bytes(graph.dtype)
    out = set()
    for n in g.nodes:
        a = graph.op(n)
        if a.kind != OpKind.POINTWISE or not a.holds_memory or not _wider(a.dtypes, width):
            continue
        r = readers(n)
        if r and all(graph.op(u).phase == a.phase and graph.op(u).kind in FUSIBLE_READERS for u in r):
            out.add(n)
    graph.memo["fused_away"] = frozenset(out)
    return graph.memo["fused_away"]


def upcast_saved(graph: OpGraph, tokens: float) -> dict[str, float]:
    """Per layer class, the bytes of what eager autograd saves outside the tiled MLP that are
    copies wider than the model's dtype (a bf16 model's norms compute in fp32) read only by
    fusible ops: recomputed inside Inductor's backward (a fully checkpointed layer's), such a copy
    lives in the kernel's registers, never in memory (measured on CPU, ``bench/memory_decisions.py
    --dtype bfloat16 --compiler inductor``: the step held less than the count without them)."""
    cached = graph.memo.get("upcast_saved")
    if cached is None:
        width = dtype_bytes(graph.dtype)
        cached = {}
        for fp, lc in graph.layer_classes.items():
            block = lc.captured[0]
            mlp = tiled_region(graph, block)
            cached[fp] = [a.bytes_saved for a in graph.nodes(phase="fwd", layer=block)
                          if a.kind == OpKind.POINTWISE and a.region != mlp and _wider(a.dtypes, width)
                          and all(graph.op(u).kind in FUSIBLE_READERS | {OpKind.VIEW}
                                  for u in graph.graph.successors(a.name))]
        graph.memo["upcast_saved"] = cached
    return {fp: sum(evaluate(b, tokens) for b in sizes) for fp, sizes in cached.items()}
