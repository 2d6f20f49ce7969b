"""The planner's memory constraints per phase of the step, from what each layer keeps.

The captured schedule peaks at the loss and during each layer's backward (its MLP, the rest):
:func:`peak_terms` gives each phase's constant with every layer's saved bytes taken out, a layer
option its share (what all its layers keep, :func:`autosp.costmodel.memory.layer_saved`) and what
the one layer running its backward holds beyond it (:func:`own_bytes`); :func:`decided_peak` adds
them up for given decisions, as the ILP's constraints do (:mod:`autosp.planner.ilp`).
"""

from __future__ import annotations

from typing import Any

from autosp.costmodel.fused_norm import fused_norm_saving
from autosp.costmodel.memory import layer_saved, mlp_saved, tiled_region
from autosp.decisions import LayerChoice
from autosp.graph import OpGraph, OpKind, evaluate


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
    and ``untraced`` the saved activations of the layers not traced. The class's first layer,
    whose backward runs last, has phases of its own, where only it holds activations:
        (c, "mlp@first")   nonstep + mlp_c^first - s_c(none)      (and "rest@first", + workspace)
    with :func:`first_layer_own` taking the shared term's other layers of c out again. The
    planner passes ``workspace`` 0 and charges each strategy's to its options' "rest" phases."""
    s_none = layer_saved(graph, tokens, "none", 1, compiled=False)      # what the captured schedule holds
    total = sum(lc.count * s_none[fp] for fp, lc in graph.layer_classes.items())
    head = phases["loss_start"] + (phases["loss"] - phases["loss_start"] + loss_gradient_buffer(graph, tokens)) \
        / loss_chunks
    out: dict[Any, float] = {"loss": nonstep + untraced + head - total}
    for fp, lc in graph.layer_classes.items():
        block = max(lc.captured)          # the class's last traced layer: its backward runs first
        d = phases["layers"].get(block)
        if d is None:
            continue
        out[(fp, "mlp")] = nonstep + untraced + d["mlp"] - total
        out[(fp, "rest")] = nonstep + untraced + d["rest"] + workspace - total
        # The class's first layer runs its backward last: the later layers' activations are gone,
        # their parameter gradients exist (what peaks there when every layer keeps little). Only
        # that layer holds its activations: its own share of the shared term, minus the rest (and
        # no untraced layer's: those are later layers of a shallow capture, done by then).
        d = phases["layers"].get(min(lc.captured))
        if d is not None and min(lc.captured) != block:
            out[(fp, "mlp" + FIRST)] = nonstep + d["mlp"] - s_none[fp]
            out[(fp, "rest" + FIRST)] = nonstep + d["rest"] + workspace - s_none[fp]
    return out


FIRST = "@first"     # suffix of the phases of a class's first layer (see peak_terms)


def first_layer_own(own: dict[str, float], count: int, kept: float) -> dict[str, float]:
    """``own`` (per phase, see :func:`own_bytes`) extended with the first layer's phases, where the
    shared term's other ``count - 1`` layers of the class keep nothing: E = own - (count - 1) kept."""
    return {**own, **{p + FIRST: v - (count - 1) * kept for p, v in own.items()}}


def loss_gradient_buffer(graph: OpGraph, tokens: float) -> float:
    """What the compiled backward of the loss holds beyond eager autograd's: AOTAutograd's
    ``nll_loss_backward`` writes into a zero-filled tensor of the log-probabilities' size, alive
    beside its result and the log-softmax's gradient (eagerly, that buffer is the result)."""
    return sum(evaluate(a.bytes_written, tokens) for a in graph.nodes(phase="bwd", kind=OpKind.LOSS)
               if "nll_loss_backward" in a.target)


def own_bytes(graph: OpGraph, tokens: float, fp: str, checkpoint: str, mlp_chunks: int,
              keep_mlp_input: bool = True, fused: bool = False) -> dict[str, float]:
    """What one layer of class ``fp`` holds during its own backward beyond what its option keeps:
    its activations come back as without checkpointing (recomputed), a tiled MLP's one chunk at a
    time. A checkpointed layer's tiled MLP is its own recompute region (compiled), whose backward
    runs before the rest of the layer is recomputed: then only the chunk is back, and after it
    the rest's recompute brings back what the partitioner would save of it, not what eager
    autograd saves (the captured schedule's phase has those). Recomputed with the whole layer
    (``keep_mlp_input=False``), the rest's recompute comes first and stays through the chunks' (as
    eager autograd saves it: ``aot_eager`` and, measured, Inductor hold that). There its RMSNorms
    run as one op each (:mod:`autosp.transform.fused_norm`), which ``aot_eager`` holds without their
    copies (:mod:`autosp.costmodel.fused_norm`); ``fused`` (Inductor) keeps the unfused count:
    measured, Inductor's peak moved by a fifth of that or not at all (docs/benchmarks.md)."""
    none = layer_saved(graph, tokens, "none", 1, compiled=False)[fp]   # what its backward reads
    kept = layer_saved(graph, tokens, checkpoint, mlp_chunks, keep_mlp_input=keep_mlp_input)[fp]
    tiled = mlp_saved(graph, tokens, compiled=False)[fp]
    if mlp_chunks == 1 or not tiled["tileable"]:
        return {"mlp": none - kept, "rest": none - kept}
    chunk = tiled["none"] / mlp_chunks
    if checkpoint == "none":
        return {"mlp": none - kept - (tiled["none"] - chunk), "rest": none - kept}
    # the rest's share: eagerly none - tiled; compiled, what the min-cut keeps outside the MLP
    rest_eager = none - tiled["none"]
    rest_compiled = layer_saved(graph, tokens, "none", 1)[fp] - mlp_saved(graph, tokens)[fp]["none"]
    rest = none - kept - (rest_eager - rest_compiled)
    if checkpoint == "full" and not keep_mlp_input:
        # the recompute replays the rest's forward ops, so what its backward reads is back as eager
        # autograd saves it (measured: the probe, bench/memory_decisions.py), beside one chunk; its
        # RMSNorms run fused there (transform/fused_norm.py), saving their input only
        norms = 0.0 if fused else \
            fused_norm_saving(graph, tokens, tiled_region(graph, graph.layer_classes[fp].captured[0]))[fp]
        return {"mlp": chunk + rest_eager - norms - kept, "rest": rest}
    return {"mlp": chunk, "rest": rest}


def strategy_saved(attention_saved: float, checkpoint: str) -> dict[str, float]:
    """What a strategy's own saved tensors (:attr:`AttentionCost.saved_bytes`, per layer) add to a
    layer's option: kept under ``none`` and ``selective`` (a collective's result is never
    recomputed), recomputed in the layer's own backward under ``full``."""
    if checkpoint == "full":
        return {"kept": 0.0, "own": attention_saved}
    return {"kept": attention_saved, "own": 0.0}


def with_strategy_own(own: dict[str, float], strategy_own: float, workspace: float,
                      mlp_with_layer: bool) -> dict[str, float]:
    """A layer's own phases (:func:`own_bytes`) with what its strategy saves and recomputes in its
    backward (:func:`strategy_saved`) and its workspace, both alive in the attention's backward; a
    tiled MLP recomputed with the whole layer (``mlp_with_layer``) has the former in its phase too."""
    return {"mlp": own["mlp"] + (strategy_own if mlp_with_layer else 0.0),
            "rest": own["rest"] + strategy_own + workspace}


def offloaded_own(own: dict[str, float], kept: float) -> dict[str, float]:
    """An offloaded layer's own phases (see :func:`peak_terms`): its kept
    bytes back for its backward, beside the next one's in flight (the planner's shared term holds
    one layer's); the class's first layer has none in flight after it."""
    return {**{ph: v + kept for ph, v in own.items()}, **{ph + FIRST: v for ph, v in own.items()}}


def decided_peak(graph: OpGraph, tokens: float, terms: dict[Any, float], choice: dict[str, tuple[str, int]],
                 attention_saved: dict[str, float] | None = None, offloaded: frozenset[str] = frozenset(),
                 fused: bool = False) -> float:
    """The largest memory constraint's value under per-class (checkpointing, MLP chunks[, keep the
    MLP's input]) choices;
    ``attention_saved``: per class, what the strategy keeps per layer (see :func:`strategy_saved`);
    ``offloaded``: classes keeping it in host memory (:func:`offloaded_own`)."""
    extra = {fp: strategy_saved((attention_saved or {}).get(fp, 0.0), choice[fp][0]) for fp in graph.layer_classes}
    kept = {fp: layer_saved(graph, tokens, *choice[fp])[fp] + extra[fp]["kept"] for fp in graph.layer_classes}
    shared = sum((1 if fp in offloaded else lc.count) * kept[fp] for fp, lc in graph.layer_classes.items())
    peaks = [terms["loss"] + shared]
    for key, base in terms.items():
        if key != "loss":
            fp, phase = key
            own = with_strategy_own(own_bytes(graph, tokens, fp, *choice[fp], fused=fused), extra[fp]["own"], 0.0,
                                    LayerChoice(**dict(zip(("checkpoint", "mlp_chunks", "keep_mlp_input"),
                                                           choice[fp]))).mlp_with_layer)
            own = offloaded_own(own, kept[fp]) if fp in offloaded else \
                first_layer_own(own, graph.layer_classes[fp].count, kept[fp])
            peaks.append(base + shared + own[phase])
    return max(peaks)

