"""OpGraph: the typed view of one captured training step (forward + backward).

A thin wrapper over a ``networkx.DiGraph`` whose nodes are the aten ops of the
joint forward+backward graph; each graph node carries one :class:`OpNode` under
the key ``"op"``. Sizes are *symbolic* expressions in the sequence length ``S``
(a sympy symbol), so the same graph is evaluated at any sequence length without
re-tracing; the planner relies on that to search the longest sequence that fits.

Only a few blocks of a deep model are traced; :class:`LayerClass` records how
many layers of the full model each traced block stands for, so totals are
``non-layer part + sum(count * one representative block)``.

This is the contract the cost model reads: attributes, never string keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

import networkx as nx
import sympy

from autosp.graph.ops import OpKind

# The symbolic sequence length every captured size is an expression in.
S = sympy.Symbol("S", integer=True, positive=True)

Size = Any          # an int or a sympy expression in S


def evaluate(expr: Size, seq_len: float) -> float:
    """Value of a size expression at a sequence length."""
    if isinstance(expr, (int, float)):
        return float(expr)
    return _evaluate_expr(expr, float(seq_len))


@functools.lru_cache(maxsize=1 << 16)
def _evaluate_expr(expr: Any, seq_len: float) -> float:
    # The planner evaluates the same few hundred expressions at a handful of lengths for
    # dozens of candidate configurations: evaluate each once.
    try:
        return float(expr.xreplace({S: seq_len}))
    except TypeError:
        # The floor divisions and remainders a chunked scan pads its length with (torch's FloorDiv,
        # Mod) evaluate on integers only: such a size is taken at the nearest whole length.
        return float(expr.xreplace({S: sympy.Integer(round(seq_len))}))


@dataclass(frozen=True)
class AttentionOp:
    """Shapes of one attention call, ``q [batch, heads, q_len, head_dim]``, ``k [.., kv_heads, kv_len, ..]``."""

    batch: Size
    heads: Size
    kv_heads: Size
    q_len: Size
    kv_len: Size
    head_dim: Size
    causal: bool                     # what the tokens may see is causal (flag or the model's mask)
    v_head_dim: Size = 0             # the values' head dim where smaller (multi-head latent attention)
    masked: bool = False             # the kernel gets an explicit mask (it then computes every block)
    window: int = 0                  # sliding window of the model's causal mask, tokens (0: none)
    # attention the model writes itself (graph/written_attention.py): bytes per score entry
    # (batch x heads x S x S) its S x S tensors take: saved for backward, live at once, moved
    written: bool = False
    positional: bool = False         # ... reading token positions inside it (tril): Ulysses only
    score_saved: float = 0.0
    score_live: float = 0.0
    score_traffic: float = 0.0


@dataclass
class OpNode:
    """One aten op of the captured step."""

    name: str
    target: str
    kind: OpKind
    phase: str                       # "fwd" or "bwd"
    layer: int | None                # captured block index, None outside the blocks
    shapes: list[tuple]              # output shapes (sizes in S)
    dtypes: list[str]
    seq_dims: list[list[int]]        # per output, the dims whose size holds S
    flops: Size                      # matmul / attention FLOPs
    bytes_read: Size
    bytes_written: Size
    bytes_saved: Size = 0            # kept alive for backward (one count per storage)
    attention: AttentionOp | None = None
    index: int = 0
    region: str | None = None        # the child module of its block it ran in ("mlp", "self_attn", ...)
    # made from positions and inputs alone (a mask, rotary tables): under SP every rank computes it
    # on the full sequence (the sharding pass slices it where it meets sharded tokens)
    replicated: bool = False
    # in a sequence mixer (graph/mixers.py): under SP it runs on the whole sequence on every rank
    gathered: bool = False

    @property
    def holds_memory(self) -> bool:
        """sym_size & co. produce no tensor."""
        return bool(self.shapes)


@dataclass
class LayerClass:
    """Structurally identical transformer layers, costed once and multiplied."""

    fingerprint: str
    module_type: str
    count: int                 # layers of the full model in this class
    captured: list[int]        # captured block indices with this fingerprint
    params: int                # parameters of one layer


@dataclass
class OpGraph:
    graph: nx.DiGraph
    model_name: str
    batch_size: int
    seq_len: int
    dtype: str
    layer_classes: dict[str, LayerClass]
    total_params: int
    captured_layers: int
    notes: list[str] = field(default_factory=list)
    # (block, child module) of each sequence mixer: run gathered under SP (graph/mixers.py)
    mixers: list[tuple[int, str]] = field(default_factory=list)
    attention_dropout: bool = False    # traced without it (it hides the fused op); the strategies must take it
    # What the planner derives from the captured graph again and again (its symbolic sums, the
    # schedule's liveness structure); the graph is never changed once captured.
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)   # a copy starts empty

    # -- node selection -------------------------------------------------------------------
    def op(self, name: str) -> OpNode:
        return self.graph.nodes[name]["op"]

    def nodes(self, *, phase: str | None = None, kind: OpKind | None = None,
              layer: int | None | str = "any") -> Iterator[OpNode]:
        if "ops" not in self.memo:
            self.memo["ops"] = [data["op"] for _, data in self.graph.nodes(data=True)]
        for a in self.memo["ops"]:
            if phase is not None and a.phase != phase:
                continue
            if kind is not None and a.kind != kind:
                continue
            if layer != "any" and a.layer != layer:
                continue
            yield a

    def weighted_nodes(self) -> Iterator[tuple[OpNode, int]]:
        """Nodes with their multiplicity: one representative block per layer class times its count."""
        rep = {lc.captured[0]: lc.count for lc in self.layer_classes.values()}
        for a in self.nodes():
            if a.layer is None:
                yield a, 1
            elif a.layer in rep:
                yield a, rep[a.layer]

    def attention_nodes(self, phase: str = "fwd") -> list[OpNode]:
        return list(self.nodes(phase=phase, kind=OpKind.ATTENTION))

    def first_attention(self) -> AttentionOp | None:
        return next((a.attention for a in self.attention_nodes("fwd") if a.attention is not None), None)

    # -- symbolic sums ---------------------------------------------------------------------
    def block_sum(self, block: int | None, fld: str, phase: str | None = None) -> Any:
        """Symbolic sum of a size field over one captured block (``None``: outside all blocks)."""
        key = ("block_sum", block, fld, phase)
        if key not in self.memo:
            total = sympy.Integer(0)
            for a in self.nodes(phase=phase, layer=block):
                total += getattr(a, fld)
            self.memo[key] = sympy.expand(total)
        return self.memo[key]

    @property
    def nonlayer_params(self) -> int:
        return self.total_params - sum(lc.params * lc.count for lc in self.layer_classes.values())

    # -- evaluated summaries -----------------------------------------------------------------
    def layer_rows(self, seq_len: int | None = None) -> list[dict[str, Any]]:
        """One row per layer class plus one for everything outside the layers."""
        s = seq_len or self.seq_len
        rows = [self._row(lc.module_type, lc.count, lc.params, lc.captured[0], s, lc.fingerprint)
                for lc in self.layer_classes.values()]
        rows.append(self._row("embedding+head+loss", 1, self.nonlayer_params, None, s, "-"))
        return rows

    def _row(self, name: str, count: int, params: int, block: int | None, s: int, fp: str) -> dict:
        return {
            "layer_class": name,
            "fingerprint": fp,
            "count": count,
            "params_per_layer": params,
            "fwd_flops_per_layer": evaluate(self.block_sum(block, "flops", "fwd"), s),
            "bwd_flops_per_layer": evaluate(self.block_sum(block, "flops", "bwd"), s),
            "act_bytes_per_layer": evaluate(self.block_sum(block, "bytes_saved", "fwd"), s),
        }

    def totals(self, seq_len: int | None = None) -> dict[str, float]:
        rows = self.layer_rows(seq_len)
        return {
            "params": sum(r["params_per_layer"] * r["count"] for r in rows),
            "fwd_flops": sum(r["fwd_flops_per_layer"] * r["count"] for r in rows),
            "bwd_flops": sum(r["bwd_flops_per_layer"] * r["count"] for r in rows),
            "act_bytes": sum(r["act_bytes_per_layer"] * r["count"] for r in rows),
        }

    def total_flops(self, seq_len: int | None = None) -> float:
        t = self.totals(seq_len)
        return t["fwd_flops"] + t["bwd_flops"]
