"""Predicted step time and peak memory per device for one SP configuration.

Inputs: a captured :class:`OpGraph` (sizes symbolic in the sequence length S), a
:class:`HardwareProfile`, and the configuration (SP degree P, strategy, layout,
DP degree, ZeRO stage). Identical layers are costed once and multiplied.

Time (per device, one step):
  compute   sum over ops of table time, token-wise ops at S/P tokens; attention at
            1/P of its work times the causal imbalance of the layout (contiguous
            ring / all-gather-KV: (2P-1)/P, the last rank's share; zigzag and
            Ulysses: 1); plus the per-op floor
  comm      the strategy's collectives per attention layer (below) and the
            gradient reduction over the SP x DP group
  exposed   comm not hidden behind compute: ring transfers overlap the block they
            travel with (exposed = max(0, transfer - block)); everything else is
            exposed
  total     compute + exposed

Memory (per device):
  parameters, optimizer states (AdamW: fp32 moments, + fp32 master weights for
  low-precision parameters) and gradients, divided by ZeRO stage 3 / 1 / 2;
  step peak: liveness over the captured forward+backward schedule (a tensor lives
  from its op to its last reader; views alias their base; gradients live to the
  end), at S/P tokens, plus activations saved by the layers not traced, plus the
  strategy's transient attention workspace.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any

from autosp.costmodel.flops import OpKind
from autosp.costmodel.partition import S, n_chunks, rank_chunks, ulysses_kv_repeat
from autosp.costmodel.profile import HardwareProfile
from autosp.errors import AutospError

_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}


def _ev(expr: Any, s: float) -> float:
    if isinstance(expr, (int, float)):
        return float(expr)
    return _ev_sym(expr, float(s))


@functools.lru_cache(maxsize=1 << 16)
def _ev_sym(expr: Any, s: float) -> float:
    # The planner evaluates the same few hundred expressions at a handful of lengths
    # for dozens of candidate configurations: evaluate each once.
    return float(expr.xreplace({S: s}))


@dataclass
class Prediction:
    strategy: str
    sp: int
    dp: int
    seq_len: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    total_s: float
    memory: dict[str, float]
    peak_bytes: float
    model_flops: float
    mfu: float
    tokens_per_s: float
    details: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def weighted_nodes(graph) -> list[tuple[str, dict, int]]:
    """Nodes with their multiplicity: one representative block per layer class times its count."""
    rep = {lc.captured[0]: lc.count for lc in graph.layer_classes.values()}
    out = []
    for name, a in graph.graph.nodes(data=True):
        layer = a["layer"]
        if layer is None:
            out.append((name, a, 1))
        elif layer in rep:
            out.append((name, a, rep[layer]))
    return out


def _attention_critical_time(profile: HardwareProfile, a: dict, S: float, sp: int, strategy: str, layout: str,
                             dtype: str, backward: bool, ulysses_degree: int | None) -> float:
    """Kernel time of one attention op on the busiest rank, from the calls the strategy makes.

    Blockwise strategies (ring, all-gather-KV, the ring part of hybrid) cut the sequence into
    equal chunks; a rank holding query chunks ``A`` makes, under a causal mask, one causal
    call per chunk in ``A`` and ``sum(A)`` full calls (chunk ``a`` sees chunks ``0..a-1``):
    contiguous layout rank r: 1 causal + r full (the last rank is busiest); zigzag rank r
    (chunks r, 2P-1-r): 2 causal + 2P-1 full on every rank (balanced).
    """
    q = a["in_shapes"][0]
    bh = _ev(q[0], S) * _ev(q[1], S)
    d = _ev(q[-1], S)
    causal = _ev(a["flops"], S) < _full_attention_flops(a, S)
    call = lambda h, lq, lk, c: profile.attention_call_time(h, lq, lk, d, c, dtype, backward)  # noqa: E731
    if sp == 1:
        return call(bh, S, S, causal)
    if strategy == "ulysses":
        return call(bh / sp, S, S, causal)
    lay = "zigzag" if strategy == "zigzag_ring" else layout
    heads, ring = bh, sp
    if strategy.startswith("hybrid"):
        u = ulysses_degree or int(strategy.split(":")[1].lower().split("x")[0])
        heads, ring = bh / u, sp // u
    per_rank = len(rank_chunks(lay, 0, sp)) * (sp // ring)          # query chunks a ring rank holds
    n = n_chunks(lay, sp)
    c = S / n
    worst = 0.0
    for g in range(ring):
        ids = [x for j in range(sp // ring) for x in rank_chunks(lay, g * (sp // ring) + j, sp)]
        if causal:
            t = len(ids) * call(heads, c, c, True) + sum(ids) * call(heads, c, c, False)
        else:
            t = per_rank * n * call(heads, c, c, False)
        worst = max(worst, t)
    return worst


def _attention_shapes(a: dict, s: float) -> tuple[float, float, float, float, int]:
    """(batch, heads, kv heads, head_dim, element bytes) of a forward attention node."""
    q, k = a["in_shapes"][0], a["in_shapes"][1]
    e = _BYTES.get(a["dtypes"][0], 2)
    return _ev(q[0], s), _ev(q[1], s), _ev(k[1], s), _ev(q[-1], s), e


def predict(graph, profile: HardwareProfile, *, sp: int = 1, strategy: str = "ulysses",
            layout: str = "contiguous", seq_len: int | None = None, dp: int = 1, zero_stage: int = 0,
            reduce_grads: bool = True, ulysses_degree: int | None = None) -> Prediction:
    S = seq_len or graph.seq_len
    if sp < 1 or S % sp:
        raise AutospError(f"sequence length {S} is not divisible by the SP degree {sp}; pad it to "
                          f"{-(-S // sp) * sp}")
    s_loc = S / sp
    dtype = graph.dtype
    inter = sp > profile.devices_per_node
    nodes = weighted_nodes(graph)
    compute = attn_fwd = attn_bwd = 0.0
    layer_fwd = layer_fwd_pointwise = 0.0       # forward compute inside layers: what recompute costs
    layer_compute = 0.0
    n_attn = 0
    attn_node = None
    for _, a, w in nodes:
        kind = a["kind"]
        if kind == OpKind.VIEW:
            continue
        if kind == OpKind.ATTENTION:
            bwd = a["phase"] == "bwd"
            t = _attention_critical_time(profile, a, S, sp, strategy, layout, dtype, bwd, ulysses_degree)
            if bwd:
                attn_bwd += w * t
            else:
                attn_fwd += w * t
                n_attn += w
                attn_node = a
        elif kind == OpKind.MATMUL:
            t = profile.matmul_time(_ev(a["flops"], s_loc), a["dtypes"][0] if a["dtypes"] else dtype)
        else:
            t = profile.memory_bound_time(_ev(a["bytes_read"], s_loc) + _ev(a["bytes_written"], s_loc))
            if a["layer"] is not None and a["phase"] == "fwd":
                layer_fwd_pointwise += w * (t + profile.op_overhead_s)
        compute += w * (t + profile.op_overhead_s)
        if a["layer"] is not None:
            layer_compute += w * (t + profile.op_overhead_s)
        if a["layer"] is not None and a["phase"] == "fwd":
            layer_fwd += w * (t + profile.op_overhead_s)

    comm, exposed, details = _communication(graph, profile, attn_node, n_attn, attn_fwd, attn_bwd, S, sp, dp,
                                            strategy, inter, zero_stage, reduce_grads, ulysses_degree)
    memory = _memory(graph, profile, S, sp, dp, zero_stage, strategy, attn_node, ulysses_degree)
    model_flops = graph.total_flops(S) / (sp * dp) * dp          # per device: its share of one sequence
    total = compute + exposed
    peak_flops = _peak_flops(profile, dtype)
    return Prediction(strategy=strategy, sp=sp, dp=dp, seq_len=S, compute_s=compute, comm_s=comm,
                      exposed_comm_s=exposed, total_s=total, memory=memory, peak_bytes=memory["peak"],
                      model_flops=model_flops, mfu=model_flops / (total * peak_flops) if peak_flops else 0.0,
                      tokens_per_s=graph.batch_size * S / sp / total,
                      details={"attention_fwd_s": attn_fwd, "attention_bwd_s": attn_bwd,
                               "layer_forward_s": layer_fwd, "layer_forward_pointwise_s": layer_fwd_pointwise,
                               "layer_compute_s": layer_compute,
                               **details})


def _full_attention_flops(a: dict, S: float) -> float:
    q, k = a["in_shapes"][0], a["in_shapes"][1]
    out = 4.0
    for d in q[:-2]:
        out *= _ev(d, S)
    out *= _ev(q[-2], S) * _ev(k[-2], S) * _ev(q[-1], S)
    return out * (2 if a["phase"] == "bwd" else 1) - 1e-9


def _peak_flops(profile: HardwareProfile, dtype: str) -> float:
    """Best observed matmul rate of the profile: the denominator of MFU."""
    rows = profile.data["compute"]["matmul"].get(dtype) or next(iter(profile.data["compute"]["matmul"].values()))
    from autosp.costmodel.profile import _row_flops

    cited = profile.source.get("peak_flops")
    if cited:
        return float(cited)
    assumptions = profile.source.get("assumptions", {})
    eff = assumptions.get("efficiency", {}).get("matmul")
    best = max(_row_flops("matmul", r) / r["seconds"] for r in rows)
    return best / eff if eff else best


def _communication(graph, profile, attn, n_attn, attn_fwd, attn_bwd, S, sp, dp, strategy, inter, zero_stage,
                   reduce_grads, ulysses_degree) -> tuple[float, float, dict]:
    comm = exposed = 0.0
    details: dict[str, float] = {}
    if sp > 1 and attn is not None:
        b, h, hkv, d, e = _attention_shapes(attn, S)
        s_loc = S / sp
        q_bytes = b * h * s_loc * d * e
        ct = profile.collective_time
        if strategy == "ulysses":
            kv_bytes = b * hkv * ulysses_kv_repeat(int(h), int(hkv), sp) * s_loc * d * e
            per = 2 * (2 * ct("all_to_all", sp, q_bytes, inter) + 2 * ct("all_to_all", sp, kv_bytes, inter))
            layer_comm, layer_exposed = per, per
        elif strategy in ("ring", "zigzag_ring"):
            kv_block = 2 * b * hkv * s_loc * d * e
            t_kv = ct("send_recv", sp, kv_block, inter)
            t_dkv = ct("send_recv", sp, kv_block * 4 / e, inter)
            step_f, step_b = attn_fwd / n_attn / sp, attn_bwd / n_attn / sp
            layer_comm = 2 * (sp - 1) * t_kv + sp * t_dkv
            layer_exposed = (sp - 1) * (max(0.0, t_kv - step_f) + max(0.0, t_kv - step_b)) + sp * t_dkv
        elif strategy == "allgather_kv":
            shard = b * hkv * s_loc * d * e
            layer_comm = 2 * ct("all_gather", sp, shard, inter) + 2 * ct("reduce_scatter", sp, shard * sp, inter)
            layer_exposed = layer_comm
        elif strategy.startswith("hybrid"):
            u = ulysses_degree or int(strategy.split(":")[1].lower().split("x")[0])
            r = sp // u
            kv_bytes = b * hkv * ulysses_kv_repeat(int(h), int(hkv), u) * s_loc * d * e
            a2a = 2 * (2 * ct("all_to_all", u, q_bytes, False) + 2 * ct("all_to_all", u, kv_bytes, False))
            kv_block = 2 * kv_bytes            # after the all-to-all: u x tokens, 1/u of the heads
            t_kv = ct("send_recv", r, kv_block, sp > profile.devices_per_node)
            t_dkv = ct("send_recv", r, kv_block * 4 / e, sp > profile.devices_per_node)
            step_f, step_b = attn_fwd / n_attn / r, attn_bwd / n_attn / r
            layer_comm = a2a + 2 * (r - 1) * t_kv + r * t_dkv
            layer_exposed = a2a + (r - 1) * (max(0.0, t_kv - step_f) + max(0.0, t_kv - step_b)) + r * t_dkv
        else:
            raise AutospError(f"no cost model for strategy '{strategy}'")
        comm += n_attn * layer_comm
        exposed += n_attn * layer_exposed
        details["attention_comm_s"] = n_attn * layer_comm
        details["attention_exposed_s"] = n_attn * layer_exposed
    group = sp * dp
    if group > 1 and (reduce_grads or dp > 1):
        gbytes = graph.total_params * _BYTES.get(graph.dtype, 2)
        big = group > profile.devices_per_node
        if zero_stage >= 2:
            t = profile.collective_time("reduce_scatter", group, gbytes, big)
        else:
            t = profile.collective_time("all_reduce", group, gbytes, big)
        if zero_stage == 3:       # parameters all-gathered for forward and again for backward
            t += 2 * profile.collective_time("all_gather", group, gbytes / group, big)
        comm += t
        exposed += t
        details["gradient_comm_s"] = t
    return comm, exposed, details


def _liveness_peak(graph, s: float) -> tuple[float, float, float]:
    """(peak live bytes over the captured schedule, gradients alive at the end, most bytes live
    while an attention op runs)."""
    g = graph.graph
    order = list(g.nodes)
    idx = {n: i for i, n in enumerate(order)}
    base: dict[str, str] = {}
    size: dict[str, float] = {}
    tensor = {n: bool(g.nodes[n]["shapes"]) for n in order}     # sym_size & co. hold no memory
    for n in order:
        a = g.nodes[n]
        preds = [p for p in g.predecessors(n) if tensor[p]]
        if a["kind"] == OpKind.VIEW and preds:
            base[n] = base.get(preds[0], preds[0])
        else:
            base[n] = n
            size[n] = _ev(a["bytes_written"], s)
    last = {b: idx[b] for b in size}
    end = len(order)
    grads = 0.0
    for n in order:
        if not tensor[n]:
            continue
        succ = list(g.successors(n))
        b = base[n]
        if not succ and g.nodes[n]["phase"] == "bwd":
            last[b] = end                                      # a gradient: kept
        for u in succ:
            if tensor[u]:
                last[b] = max(last[b], idx[u])
    for b, i in last.items():
        if i == end:
            grads += size.get(b, 0.0)
    frees: dict[int, list[str]] = {}
    for b, i in last.items():
        frees.setdefault(i, []).append(b)
    live = peak = at_attention = 0.0
    for i, n in enumerate(order):
        if base[n] == n:
            live += size[n]
            peak = max(peak, live)
        if g.nodes[n]["kind"] == OpKind.ATTENTION:
            at_attention = max(at_attention, live)
        for b in frees.get(i, []):
            live -= size[b]
    return peak, grads, at_attention


def _memory(graph, profile, S, sp, dp, zero_stage, strategy, attn, ulysses_degree) -> dict[str, float]:
    p_bytes = _BYTES.get(graph.dtype, 2)
    n = graph.total_params
    group = sp * dp
    params = n * p_bytes / (group if zero_stage >= 3 else 1)
    opt = n * (8 + (4 if p_bytes < 4 else 0)) / (group if zero_stage >= 1 else 1)
    s_loc = S / sp
    step_peak, grads_traced, at_attention = _liveness_peak(graph, s_loc)
    # Layers that were not traced keep their saved activations across the forward/backward turn.
    extra_layers = 0.0
    for lc in graph.layer_classes.values():
        missing = lc.count - len(lc.captured)
        if missing > 0:
            extra_layers += missing * _ev(graph.block_sum(lc.captured[0], "bytes_saved", "fwd"), s_loc)
    grads_all = n * p_bytes / (group if zero_stage >= 2 else 1)
    workspace = 0.0
    if sp > 1 and attn is not None:
        b, h, hkv, d, e = _attention_shapes(attn, S)
        q_loc = b * h * s_loc * d * e
        kv_loc = b * hkv * s_loc * d * e
        if strategy == "ulysses":
            workspace = 2 * q_loc                      # all-to-all send and receive buffers
        elif strategy in ("ring", "zigzag_ring") or strategy.startswith("hybrid"):
            workspace = q_loc * 4 / e + 2 * 2 * kv_loc + 2 * q_loc    # fp32 accumulator, 2 K/V blocks, expanded
        elif strategy == "allgather_kv":
            workspace = 2 * kv_loc * sp + 2 * q_loc
    # The strategy's buffers exist only around attention: they raise the peak only if the
    # schedule is near its peak there (the peak is often at the loss, where they are gone).
    step = max(step_peak, at_attention + workspace) + extra_layers
    return {"parameters": params, "optimizer": opt, "gradients": grads_all,
            "activations": step_peak + extra_layers - grads_traced, "workspace": workspace,
            "step_peak": step, "peak": params + opt + step - grads_traced + grads_all}
