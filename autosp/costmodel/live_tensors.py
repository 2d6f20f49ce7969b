"""What bounds the context: the largest tensors alive where the captured step's memory peaks."""

from __future__ import annotations

from typing import Any

from autosp.costmodel.memory import lifetimes
from autosp.graph import OpGraph, evaluate


def largest_live(graph: OpGraph, tokens: float, k: int = 6, full: float | None = None) -> list[dict[str, Any]]:
    """The ``k`` largest tensors alive where the captured step's memory peaks, at ``tokens`` per
    rank (before checkpointing and tiling change the schedule): what bounds the context. Each with
    its op, phase, layer (None outside the blocks), shape and bytes; ``full``: the whole sequence's
    length, at which the tensors every rank makes whole (masks, rotary tables) are sized."""
    if "liveness" not in graph.memo:
        graph.memo["liveness"] = lifetimes(graph)
    order, ops, base, last, frees = graph.memo["liveness"]
    size = {b: evaluate(ops[b].bytes_written, full if full and ops[b].replicated else tokens) for b in last}
    live: set[str] = set()
    total = peak = 0.0
    at_peak: set[str] = set()
    for i, n in enumerate(order):
        if base[n] == n:
            live.add(n)
            total += size[n]
            if total > peak:
                peak, at_peak = total, set(live)
        for b in frees.get(i, []):
            live.discard(b)
            total -= size[b]
    top = sorted(at_peak, key=lambda b: (-size[b], b))[:k]
    return [{"op": b, "target": ops[b].target, "phase": ops[b].phase, "layer": ops[b].layer,
             "shape": [int(evaluate(d, full if full and ops[b].replicated else tokens)) for d in ops[b].shapes[0]]
             if ops[b].shapes else [],
             "bytes": size[b]} for b in top]
