"""The cost of sequence mixers that run gathered (:mod:`autosp.transform.sequence_mixers`).

Under SP degree P a mixer module (a Mamba-2 or gated DeltaNet layer: :mod:`autosp.graph.mixers`)
runs on the whole sequence on every rank. Its cost, per mixer layer, with h the bytes of one hidden
state of the whole sequence:

    compute, activations   its ops at S tokens, not S / P
    forward                an all-gather of its input: h / P per rank, over the SP group
    backward               an all-reduce of that input's gradient: h, over the SP group
    exposed                both in full (nothing overlaps them)

:func:`at_sp_degree` gives the captured step as a rank runs it at degree P: the gathered ops'
sizes read at P times the tokens, so every time and memory rule that evaluates sizes at a rank's
tokens counts them whole, with nothing else to change.
"""

from __future__ import annotations

import dataclasses

import sympy

from autosp.costmodel.memory import hidden_bytes
from autosp.costmodel.profile import HardwareProfile
from autosp.graph.opgraph import S, OpGraph

_SIZES = ("flops", "bytes_read", "bytes_written", "bytes_saved")


def at_sp_degree(graph: OpGraph, sp: int) -> OpGraph:
    """``graph`` with its gathered ops' sizes at ``sp`` times the tokens (itself without mixers or at
    degree 1). Cached on the graph per degree: the planner asks again for every mesh."""
    if sp <= 1 or not graph.mixers:
        return graph
    key = ("at_sp_degree", sp)
    if key not in graph.memo:
        scaled = graph.graph.copy()
        for name, data in scaled.nodes(data=True):
            a = data["op"]
            if a.gathered:
                data["op"] = dataclasses.replace(a, **{f: _times(getattr(a, f), sp) for f in _SIZES},
                                                 shapes=[tuple(_times(d, sp) for d in s) for s in a.shapes])
        graph.memo[key] = dataclasses.replace(graph, graph=scaled)
    return graph.memo[key]


def _times(expr: object, sp: int) -> object:
    return expr.xreplace({S: sp * S}) if isinstance(expr, sympy.Basic) else expr


def mixer_layers(graph: OpGraph) -> int:
    """Mixer layers of the whole model: each traced mixer times its layer class's count."""
    count = {b: lc.count for lc in graph.layer_classes.values() for b in lc.captured[:1]}
    return sum(count.get(block, 0) for block, _ in graph.mixers)


def mixer_comm(graph: OpGraph, profile: HardwareProfile, sp: int, seq_len: float, inter: bool = False) -> float:
    """Seconds of the gathers and gradient all-reduces of every mixer layer in one step (exposed)."""
    if sp <= 1 or not graph.mixers:
        return 0.0
    h = hidden_bytes(graph, seq_len)
    one = profile.collective_time("all_gather", sp, h / sp, inter) + profile.collective_time("all_reduce", sp, h, inter)
    return mixer_layers(graph) * one
