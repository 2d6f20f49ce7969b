"""What a tensor-parallel (TP) degree t does to one training step, Megatron style with its
sequence parallelism: the rule every cost and memory figure of a TP plan is derived from.

A TP group is t ranks of one node (its collectives run per layer, on the node's fast links).
Inside a transformer block, q/k/v and gate/up projections are split column-wise (by heads, by
intermediate features), the output and down projections row-wise; between blocks the
activations are split on the tokens over the group (Megatron's sequence parallelism), so norms
and residuals are not replicated either. The embedding and LM head are split on the vocabulary
and the loss is computed without gathering the logits. So, per rank, at S/P tokens of its SP
shard (P the SP degree):

    work         every op's FLOPs and bytes / t (the matmuls at their per-rank size: small
                 ones run less efficiently, the profile's tables say how much)
    attention    heads / t per rank; key/value heads / t where t divides them, else each rank
                 holds the one key/value head its query heads read (replicated: t a multiple of
                 the key/value heads); the SP strategy runs on these local heads
    parameters   all / t, but the key/value projections replicated where t exceeds their heads
                 (what is replicated stays whole); gradients and optimizer states follow, and
                 ZeRO shards them over the other axes
    activations  what a layer keeps / t (token-sharded between the column- and row-parallel
                 ops, head- or feature-sharded inside them): the schedule's liveness at
                 S / (P t) tokens, plus the gathered input of the running block, one hidden
                 state at S/P tokens
    collectives  per block (attention, MLP), of one hidden state at S/P tokens, h = B S/P H bytes:
                   forward   all-gather of the block's input, reduce-scatter of its output
                   backward  all-gather of the output's gradient, reduce-scatter of the input's,
                             and the input gathered again for the weight gradients (the layer
                             keeps it split)
                 outside the blocks the same for the head's input and the embedding's output
                 (2 + 2 collectives), and the vocabulary-parallel loss's all-reduces of B S/P
                 fp32 values (the row maxima, the sums of exponentials, the target logits)
    exposed      all of it: the runtime issues them blocking, so nothing is claimed hidden

The DESIGN's one rule for parameters: a parameter is split by TP or replicated, then sharded by
ZeRO over the other axes (:func:`autosp.costmodel.memory.model_states`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autosp.costmodel.dtypes import dtype_bytes
from autosp.costmodel.profile import HardwareProfile
from autosp.errors import AutospError
from autosp.graph import OpGraph, OpKind, evaluate

TP_DEGREES = (1, 2, 4, 8)           # what the planner searches (within a node, dividing the heads)
# collectives per block: forward 2, backward 3 (the input gathered again for the weight gradients)
FORWARD_PER_BLOCK = 2
BACKWARD_PER_BLOCK = 3
BLOCKS_PER_LAYER = 2                # attention and MLP
LOSS_ALL_REDUCES = 3                # the row maxima, the sums of exponentials, the target logits


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
    if kv_heads % t and t % kv_heads:
        return f"{kv_heads} key/value heads neither divide over {t} ranks nor divide {t} (to be replicated)"
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


def local_kv_heads(kv_heads: int, t: int) -> int:
    """Key/value heads a rank holds: split where ``t`` divides them, else the one its queries read."""
    return kv_heads // t if kv_heads % t == 0 else 1


def local_attention(shape, t: int):
    """An :class:`autosp.strategies.AttentionShape` as one rank of a TP group of ``t`` sees it."""
    if t == 1:
        return shape
    return replace(shape, heads=shape.heads // t, kv_heads=local_kv_heads(shape.kv_heads, t))


@dataclass(frozen=True)
class TPShape:
    """What the TP rule needs of a model: its hidden size, and its attention's heads."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @classmethod
    def of(cls, graph: OpGraph) -> "TPShape":
        a = graph.first_attention()
        emb = next(graph.nodes(phase="fwd", kind=OpKind.EMBEDDING), None)
        # one token of one sequence: the embedding's output per token, in elements
        hidden = evaluate(emb.bytes_written, 1.0) / graph.batch_size / dtype_bytes(graph.dtype) if emb else 0
        ev = lambda x: int(evaluate(x, 1.0)) if a is not None else 1  # noqa: E731
        return cls(hidden=int(hidden), heads=ev(a.heads) if a else 1, kv_heads=ev(a.kv_heads) if a else 1,
                   head_dim=ev(a.head_dim) if a else 0,
                   layers=sum(lc.count for lc in graph.layer_classes.values()))


def params_per_rank(graph: OpGraph, t: int) -> float:
    """Parameters one rank of a TP group of ``t`` holds: all / t, with the key/value projections
    whole on each rank where ``t`` exceeds their heads (each holds one head's, not kv / t)."""
    n = float(graph.total_params)
    if t == 1:
        return n
    s = TPShape.of(graph)
    kv_proj = 2 * s.hidden * s.head_dim           # one key/value head's k and v projections, one layer
    replicated = s.layers * kv_proj * (local_kv_heads(s.kv_heads, t) - s.kv_heads / t)
    return n / t + max(0.0, replicated)


def gathered_input_bytes(graph: OpGraph, tokens: float, t: int) -> float:
    """Beyond what the liveness at S/(P t) counts: a block's input gathered whole over the TP
    group (one hidden state at ``tokens`` = S/P), less the rank's own shard of it."""
    if t == 1:
        return 0.0
    s = TPShape.of(graph)
    return graph.batch_size * tokens * s.hidden * dtype_bytes(graph.dtype) * (1 - 1 / t)


@dataclass(frozen=True)
class TPComm:
    """Seconds of TP collectives in one step, per rank (all exposed: see the module docstring)."""

    layer_forward_s: float      # all layers' forward collectives (what a full recompute repeats)
    layer_s: float              # all layers', forward and backward
    outside_s: float            # the embedding's, the head's and the loss's

    @property
    def total_s(self) -> float:
        return self.layer_s + self.outside_s


def tp_comm(graph: OpGraph, profile: HardwareProfile, t: int, tokens: float) -> TPComm:
    """The TP collectives of one step at ``tokens`` = S/P tokens a rank of the SP group."""
    if t == 1:
        return TPComm(0.0, 0.0, 0.0)
    s = TPShape.of(graph)
    h = graph.batch_size * tokens * s.hidden * dtype_bytes(graph.dtype)
    gather = profile.collective_time("all_gather", t, h / t)        # buffer: one shard
    scatter = profile.collective_time("reduce_scatter", t, h)       # buffer: the whole input
    fwd_block = gather + scatter
    bwd_block = 2 * gather + scatter
    layer_fwd = s.layers * BLOCKS_PER_LAYER * fwd_block
    layer = layer_fwd + s.layers * BLOCKS_PER_LAYER * bwd_block
    loss = LOSS_ALL_REDUCES * profile.collective_time("all_reduce", t, graph.batch_size * tokens * 4)
    return TPComm(layer_forward_s=layer_fwd, layer_s=layer, outside_s=2 * (gather + scatter) + loss)
