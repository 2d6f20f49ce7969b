"""Attention sinks: a learned logit column that joins each row's softmax and is dropped after it.

gpt-oss writes its attention so (eager, the only attention ``transformers`` offers it)::

    combined = cat([scores, sinks.reshape(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values      # optional: a stable shift
    probs = softmax(combined, dim=-1)
    p = probs[..., :-1]                                                  # the sink column dropped
    out = p @ v

The sink takes a share of each row's probability mass and gives nothing back: a row may attend to
"nothing". :func:`fold_sinks` rewrites that pattern of a Dynamo graph into one call,
``softmax_with_sink(scores, sink)``, before the attention region is cut out
(:mod:`autosp.transform.attention_region`), so that the region is the familiar
``scores -> softmax -> @ v`` with the sink as one more extra, laid out ``[batch, heads, rows, 1]``:

  * Ulysses keeps the sink's heads of this rank, all-gather-KV its query rows; both run the
    folded call as written, and autograd gives the sink its gradient on the rows this rank holds
    (summed over the group where the parameter enters the graph, as every parameter's is);
  * ring splits the keys into blocks, so the sink must join the log-sum-exp merge once per row,
    not once per block: the region's score function stops before the softmax (the sink is not
    in it) and the ring op merges the sink after the last block, returning its gradient
    ``-p_sink * rowsum(dO * O)`` (:mod:`autosp.strategies.ring_region`).

The stable shift (``combined - max``) is dropped: softmax is shift-invariant per row, and the
folded call shifts by the row's maximum itself. A shift by a per-block maximum would break the
ring's merge, and no other strategy needs it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autosp.transform.region_atoms import op_name, value_of


def softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor, dim: int = -1,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """``softmax(cat([scores, sink], -1))[..., :-k]`` for a sink of ``k`` columns (``[.., rows, k]``)."""
    k = sink.shape[-1]
    sink = sink.expand(*scores.shape[:-1], k).to(scores.dtype)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=dtype)
    return probs[..., : probs.shape[-1] - k]


def _is_cat_last(n: Any) -> bool:
    if not isinstance(n, fx.Node) or op_name(n) not in ("cat", "concat", "concatenate"):
        return False
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
    parts = n.args[0] if n.args else n.kwargs.get("tensors")
    v = value_of(n)
    return isinstance(v, torch.Tensor) and isinstance(dim, int) and dim % v.dim() == v.dim() - 1 \
        and isinstance(parts, (list, tuple)) and len(parts) == 2


def _row_max(n: Any, of: fx.Node) -> bool:
    """``of.max(dim=-1, keepdim=True).values`` (or ``amax``): a per-row shift."""
    if not isinstance(n, fx.Node):
        return False
    if op_name(n) == "getitem" and n.args[1] == 0:
        n = n.args[0]
    if not isinstance(n, fx.Node) or op_name(n) not in ("max", "amax") or n.args[:1] != (of,):
        return False
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    keep = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
    d = value_of(of).dim()
    return keep is True and (dim in (-1, d - 1) or dim in ((-1,), [-1], (d - 1,), [d - 1]))


def _drops_last(n: fx.Node, k: int) -> bool:
    """``probs[..., :-k]`` (Ellipsis first, or a full slice on every dim before the last)."""
    if op_name(n) != "getitem" or not isinstance(n.args[1], tuple):
        return False
    idx = n.args[1]
    last, lead = idx[-1], idx[:-1]
    full = slice(None, None, None)
    return last == slice(None, -k, None) and (lead == (Ellipsis,) or all(x == full for x in lead)) \
        and (lead == (Ellipsis,) or len(idx) == value_of(n.args[0]).dim())


def fold_sinks(gm: fx.GraphModule) -> int:
    """Rewrite every sink softmax of ``gm`` into :func:`softmax_with_sink`; returns how many."""
    graph, folded = gm.graph, 0
    for sm in list(graph.nodes):
        if sm.op not in ("call_function", "call_method") or op_name(sm) != "softmax" or len(sm.users) != 1:
            continue
        dim = sm.kwargs.get("dim", sm.args[1] if len(sm.args) > 1 else None)
        x = sm.args[0]
        xv = value_of(x)
        if not isinstance(xv, torch.Tensor) or dim not in (-1, xv.dim() - 1):
            continue
        shift = None
        if op_name(x) == "sub" and len(x.users) == 1 and _is_cat_last(x.args[0]) and _row_max(x.args[1], x.args[0]):
            shift, x = x, x.args[0]
        if not _is_cat_last(x) or len(x.users) != (2 if shift is not None else 1):
            continue
        scores, sink = x.args[0] if x.args else x.kwargs["tensors"]
        sv = value_of(sink)
        k = sv.shape[-1] if isinstance(sv, torch.Tensor) else None
        drop = next(iter(sm.users))
        if not isinstance(k, int) or not _drops_last(drop, k):
            continue
        dtype = sm.kwargs.get("dtype", sm.args[2] if len(sm.args) > 2 else None)
        with graph.inserting_before(drop):
            call = graph.call_function(softmax_with_sink, (scores, sink), {"dim": -1, "dtype": dtype})
        call.meta = dict(drop.meta)
        drop.replace_all_uses_with(call)
        dead = [drop, sm]
        if shift is not None:        # the shift, then the row maximum it read
            top = shift.args[1]
            dead += [shift, top] + ([top.args[0]] if op_name(top) == "getitem" else [])
        for n in dead + [x]:
            if not n.users:
                graph.erase_node(n)
        folded += 1
    if folded:
        graph.lint()
        gm.recompile()
    return folded

