"""What a tensor-parallel (TP) degree t does to one training step, as autosp's runtime runs it
(:mod:`autosp.transform.tensor_parallel`): the rule every cost and memory figure of a TP plan
is derived from.

A TP group is t ranks of one node (its collectives run per layer, on the node's fast links).
Inside a transformer block, the attention module's q/k/v projections are split by heads
(column-parallel) and its output projection by its input features (row-parallel); the MLP
module's first linear layers column-parallel, its last row-parallel. The ranks of a group hold
the same tokens (those of their SP shard, S/P): a module's input is whole on each, its output
summed over the group. So, per rank:

    work         inside a block's attention and MLP modules (the captured graph's regions: the
                 one its attention op ran in where that is SDPA on whole heads of one head dim,
                 the tileable MLP; attention written by hand, multi-head latent attention and
                 mixtures of experts stay whole, as the runtime leaves them), forward and backward: every
                 matmul's FLOPs / t (at its per-rank size: small ones run less efficiently, the
                 profile's tables say how much), and every other op's bytes / t but a hidden
                 state's (the row-parallel output, whole after its sum); the attention at heads / t
                 (key/value heads / t: t must divide both); the rest of the block (norms,
                 residuals) and everything outside the blocks (embedding, LM head, loss) whole
    parameters   the split modules' weights / t, the rest (embedding, LM head, norms, experts) whole; gradients and optimizer
                 states follow, and ZeRO shards them over the other axes
    activations  the schedule's liveness at S/P tokens with the tensors the work rule splits / t
                 (a tensor whose last dim is the hidden size counted whole: errs on the side of
                 memory where heads x head dim equals it)
    collectives  per split block module, of one hidden state at S/P tokens (h = B S/P H bytes): an
                 all-reduce of its output forward, of its input's gradient backward (a full
                 recompute repeats the forward's); the per-head norms' gradient sums are tiny
                 and left out
    exposed      all of it: the runtime issues them blocking, so nothing is claimed hidden

What Megatron adds beyond this (the hidden states between the modules split on the tokens, the
vocabulary split) is not run yet, so not costed.

The DESIGN's one rule for parameters: a parameter is split by TP or replicated, then sharded by
ZeRO over the other axes (:func:`autosp.costmodel.memory.model_states`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autosp.costmodel.dtypes import dtype_bytes
from autosp.costmodel.memory import (hidden_bytes, params_per_rank, tp_regions,  # noqa: F401 - the TP rule's
                                     tp_split_params)
from autosp.costmodel.profile import HardwareProfile
from autosp.errors import AutospError
from autosp.graph import OpGraph, OpKind, evaluate

TP_DEGREES = (1, 2, 4, 8)           # what the planner searches (within a node, dividing the heads)


def tp_refusal(t: int, heads: int, kv_heads: int, devices_per_node: int, world_size: int) -> str:
    """Why TP degree ``t`` cannot run this attention on this cluster ("" where it can)."""
    if t == 1:
        return ""
    if t > devices_per_node:
        return f"a TP group of {t} would span nodes of {devices_per_node} devices (TP runs inside a node)"
    if devices_per_node % t:
        return f"TP groups of {t} do not tile a node of {devices_per_node} devices"
    if world_size % t:
        return f"the world of {world_size} devices does not divide into TP groups of {t}"
    if heads % t:
        return f"{heads} attention heads do not divide over {t} ranks"
    if kv_heads % t:
        return f"{kv_heads} key/value heads do not divide over {t} ranks"
    return ""


def legal_tp_degrees(heads: int, kv_heads: int, devices_per_node: int, world_size: int,
                     allowed: tuple[int, ...] = TP_DEGREES) -> list[int]:
    """The TP degrees of ``allowed`` this attention can run at on this cluster."""
    return [t for t in allowed if not tp_refusal(t, heads, kv_heads, devices_per_node, world_size)]


def check_tp_degree(t: int, heads: int, kv_heads: int, devices_per_node: int, world_size: int) -> None:
    """Refuse a TP degree given by hand that cannot run, naming the degrees that would."""
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise AutospError(f"the TP degree must be a positive integer, got {t!r}")
    why = tp_refusal(t, heads, kv_heads, devices_per_node, world_size)
    if why:
        ok = legal_tp_degrees(heads, kv_heads, devices_per_node, world_size,
                              tuple(d for d in range(1, devices_per_node + 1) if devices_per_node % d == 0))
        raise AutospError(f"TP degree {t} cannot run: {why}; use one of {', '.join(map(str, ok))}")


def splits_attention(graph: OpGraph) -> bool:
    """Whether TP splits this model's attention by heads (see :func:`autosp.costmodel.memory.tp_regions`)."""
    return any(a.name in split_ops(graph)[0] for a in graph.nodes(phase="fwd", kind=OpKind.ATTENTION))


def tp_refused_for(graph: OpGraph) -> str:
    """Why no TP degree above 1 helps this model ("" where one does): it splits nothing of it."""
    if tp_split_params(graph):
        return ""
    return (f"TP splits no layer of {graph.model_name} (its attention is written by hand or multi-head latent "
            "attention, and its MLP a mixture of experts)")


def local_attention(shape, t: int):
    """An :class:`autosp.strategies.AttentionShape` as one rank of a TP group of ``t`` sees it
    (``t``: 1 where TP leaves the attention whole, :func:`splits_attention`)."""
    if t == 1:
        return shape
    return replace(shape, heads=shape.heads // t, kv_heads=max(1, shape.kv_heads // t))


def _hidden_size(graph: OpGraph) -> float:
    """Elements of one token's hidden state (the embedding's output)."""
    return hidden_bytes(graph, 1.0) / graph.batch_size / dtype_bytes(graph.dtype)


def split_ops(graph: OpGraph) -> tuple[frozenset[str], frozenset[str]]:
    """(the captured ops whose work TP splits, those whose output it splits): see the module
    docstring's work and activations rules."""
    if "tp_split" not in graph.memo:
        regions = tp_regions(graph)
        hidden = _hidden_size(graph)
        work, out = set(), set()
        for name in graph.graph.nodes:
            a = graph.op(name)
            if a.layer is None or a.region is None or a.region not in regions.get(a.layer, ()):
                continue
            whole_state = bool(a.shapes) and bool(a.shapes[0]) and evaluate(a.shapes[0][-1], 1.0) == hidden
            if a.kind in (OpKind.MATMUL, OpKind.ATTENTION) or not whole_state:
                work.add(name)
            if a.shapes and not whole_state:
                out.add(name)
        graph.memo["tp_split"] = (frozenset(work), frozenset(out))
    return graph.memo["tp_split"]


def saved_share(graph: OpGraph, t: int) -> float:
    """The share of what a block keeps for its backward that one rank of a TP group of ``t`` keeps
    (the split tensors / t, the rest whole): what the per-layer memory terms scale by."""
    if t == 1:
        return 1.0
    _, out = split_ops(graph)
    block = min(lc.captured[0] for lc in graph.layer_classes.values())
    saved = [(evaluate(a.bytes_saved, 1024.0), a.name in out) for a in graph.nodes(phase="fwd", layer=block)]
    total = sum(b for b, _ in saved)
    return sum(b / t if split else b for b, split in saved) / total if total else 1.0 / t


@dataclass(frozen=True)
class TPComm:
    """Seconds of TP collectives in one step, per rank (all exposed: see the module docstring)."""

    layer_forward_s: float      # all layers' forward collectives (what a full recompute repeats)
    layer_s: float              # all layers', forward and backward
    outside_s: float = 0.0      # outside the layers (none: the embedding, head and loss run whole)

    @property
    def total_s(self) -> float:
        return self.layer_s + self.outside_s


def tp_comm(graph: OpGraph, profile: HardwareProfile, t: int, tokens: float) -> TPComm:
    """The TP collectives of one step at ``tokens`` = S/P tokens a rank of the SP group."""
    if t == 1:
        return TPComm(0.0, 0.0)
    modules = sum(lc.count * len(tp_regions(graph).get(lc.captured[0], ())) for lc in graph.layer_classes.values())
    h = hidden_bytes(graph, tokens)            # one hidden state of the SP shard
    forward = modules * profile.collective_time("all_reduce", t, h)
    return TPComm(layer_forward_s=forward, layer_s=2 * forward)
