"""OpGraph: the costed view of one captured training step (forward + backward).

A thin wrapper over a ``networkx.DiGraph`` whose nodes are the aten ops of the
joint forward+backward graph. Sizes are kept as *symbolic* expressions in the
sequence length ``S`` (a sympy symbol), so the same graph is evaluated at any
sequence length without re-tracing; the planner relies on that to search the
longest sequence that fits.

Node attributes
  target       aten op, as text          kind     :class:`OpKind`
  phase        "fwd" or "bwd"            layer    captured block index or None
  shapes       output shapes (exprs)     dtypes   output dtypes
  seq_dims     per output, the dims whose size holds ``S``
  flops        matmul/attention FLOPs    bytes_read, bytes_written
  bytes_saved  bytes of this output kept alive for backward (activations only,
               one count per storage: a saved view and its saved base count once)

Only a few blocks of a deep model are traced; :class:`LayerClass` records how
many layers of the full model each traced block stands for, so totals are
``non-layer part + sum(count * one representative block)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import networkx as nx
import sympy

from autosp.costmodel.flops import OpKind
from autosp.costmodel.partition import S

NUMERIC_FIELDS = ("flops", "bytes_read", "bytes_written", "bytes_saved")


def evaluate(expr: Any, seq_len: int) -> float:
    """Value of a size expression at a sequence length."""
    if isinstance(expr, (int, float)):
        return expr
    return float(expr.subs(S, seq_len))


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

    # -- node selection -------------------------------------------------------------------
    def nodes(self, *, phase: str | None = None, kind: OpKind | None = None,
              layer: int | None | str = "any") -> Iterable[tuple[str, dict]]:
        for name, a in self.graph.nodes(data=True):
            if phase is not None and a["phase"] != phase:
                continue
            if kind is not None and a["kind"] != kind:
                continue
            if layer != "any" and a["layer"] != layer:
                continue
            yield name, a

    # -- symbolic sums ---------------------------------------------------------------------
    def block_sum(self, block: int | None, fld: str, phase: str | None = None) -> Any:
        """Symbolic sum of a field over one captured block (``None``: outside all blocks)."""
        total = sympy.Integer(0)
        for _, a in self.nodes(phase=phase, layer=block):
            total += a[fld]
        return sympy.expand(total)

    @property
    def nonlayer_params(self) -> int:
        return self.total_params - sum(lc.params * lc.count for lc in self.layer_classes.values())

    # -- evaluated summaries -----------------------------------------------------------------
    def layer_rows(self, seq_len: int | None = None) -> list[dict[str, Any]]:
        """One row per layer class plus one for everything outside the layers."""
        s = seq_len or self.seq_len
        rows = []
        for lc in self.layer_classes.values():
            rep = lc.captured[0]
            rows.append(self._row(lc.module_type, lc.count, lc.params, rep, s, lc.fingerprint))
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

    def attention_nodes(self, phase: str = "fwd") -> list[str]:
        return [n for n, _ in self.nodes(phase=phase, kind=OpKind.ATTENTION)]
