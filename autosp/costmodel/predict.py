"""Predicted step time and peak memory per device for one SP configuration.

Inputs: a captured :class:`~autosp.graph.OpGraph` (sizes symbolic in the sequence
length S), a :class:`HardwareProfile`, and the configuration (SP degree P, the
attention strategy, token layout, DP degree, ZeRO stage). Identical layers are
costed once and multiplied.

Time (per device, one step):
  compute   sum over ops of table time, token-wise ops at S/P tokens; attention as
            the kernel calls the strategy declares for its busiest rank
            (:meth:`autosp.strategies.Strategy.cost`) and the token reorders it declares
            (memory-bound copies, forward and backward); plus the per-op floor
  comm      the strategy's transfers per attention op, and the gradient reduction
            over the SP x DP group
  exposed   comm not hidden behind compute: each attention op's transfers as its strategy
            declares them overlapped (blocking, beside a share of the kernels, pipelined in
            head groups, issued where the graph makes the inputs; the formulas are in
            :mod:`autosp.costmodel.overlap`), and the gradient reduction of ZeRO stages 0/1
            in buckets beside the backward (:func:`_gradient_comm`)
  total     compute + exposed
  TP        a tensor-parallel degree t divides the work of the blocks' attention and MLP modules
            and the attention's heads by t and adds its per-layer collectives, exposed
            (:mod:`autosp.costmodel.tensor_parallel`)
  mixers    a sequence mixer that runs gathered (a Mamba-2 or gated DeltaNet module) is costed
            at S tokens, its input's gather and gradient sum exposed
            (:mod:`autosp.costmodel.mixers`)
  sharing   more ranks on a node than the profile has devices (the launch's ranks per node
            above the profile's ``devices_per_node``: 4 processes on a 2-core CPU) share them:
            every compute time x (ranks on the node / devices), attention kernels at least the
            busiest rank's alone (:func:`kernel_time`); collectives are measured at their group
            size, sharing included

Memory (per device): model states (:func:`autosp.costmodel.memory.model_states`),
the liveness peak of the captured schedule at S/P tokens, activations saved by the
layers not traced, and the strategy's workspace around attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autosp.costmodel.memory import dtype_bytes, liveness_peak, model_states, tiled_region, untraced_layer_activations
from autosp.costmodel.mixers import at_sp_degree, mixer_comm
from autosp.costmodel.phases import decided_peak, peak_terms
from autosp.costmodel.overlap import transfer_times
from autosp.costmodel.profile import HardwareProfile
from autosp.costmodel.tensor_parallel import (local_attention, params_per_rank, saved_share, split_ops,
                                              splits_attention, tp_comm)
from autosp.errors import AutospError
from autosp.graph import OpGraph, OpKind, OpNode, evaluate
from autosp.strategies import AUTO, AttentionCost, AttentionShape, SPMesh, Strategy, pick, required_layout, resolve


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
    memory: dict[str, float]            # parameters, optimizer, gradients, activations, workspace, step_peak, peak
    peak_bytes: float
    model_flops: float
    mfu: float
    tokens_per_s: float
    attention_fwd_s: float = 0.0        # attention kernels of all layers, forward
    attention_bwd_s: float = 0.0
    layer_forward_s: float = 0.0        # forward compute inside layers: what full recompute costs
    layer_forward_pointwise_s: float = 0.0   # ... of memory-bound ops: what selective recompute costs
    layer_compute_s: float = 0.0        # all compute inside layers
    mlp_forward_s: float = 0.0          # forward compute of the layers' tileable MLPs: what tiling recomputes
    head_forward_s: float = 0.0         # forward matmuls and loss outside the layers: what a tiled loss recomputes
    phases: dict | None = None          # where the schedule peaks (autosp.costmodel.memory._phases)
    attention_comm_s: float = 0.0
    attention_exposed_s: float = 0.0
    attention_exposed_bwd_s: float = 0.0  # of it, the backward's (the forward's is the rest)
    attention_saved: dict | None = None  # per layer class: bytes one layer's strategy keeps for backward
    gradient_comm_s: float = 0.0
    gradient_exposed_s: float = 0.0     # of it, what the compute waits for (ZeRO gathers included)
    backward_s: float = 0.0             # of compute_s, the backward's: what the gradient reduction moves beside
    tp: int = 1                         # the TP degree
    tp_comm_s: float = 0.0              # TP collectives, all exposed (of exposed_comm_s)
    mixer_comm_s: float = 0.0           # sequence mixers' gathers and gradient sums, exposed (costmodel/mixers.py)
    tp_layer_s: float = 0.0             # ... of them the layers' (forward and backward)
    tp_layer_forward_s: float = 0.0     # ... and of those the forward's (what a full recompute repeats)


def attention_shape(node: OpNode, seq_len: float, dropout: bool = False,
                    documents: tuple[int, ...] = ()) -> AttentionShape:
    """The strategy-facing shape of a captured attention op at ``seq_len`` tokens; ``documents``:
    packed document lengths (the model then gets a causal mask within each)."""
    a = node.attention
    if a is None:
        raise AutospError(f"op {node.name} is not an attention op")
    if documents and sum(documents) != seq_len:
        raise AutospError(f"the documents hold {sum(documents)} tokens but the sequence has {int(seq_len)}; "
                          "give lengths that sum to the sequence length")
    ev = lambda x: evaluate(x, seq_len)  # noqa: E731
    return AttentionShape(heads=int(ev(a.heads)), kv_heads=int(ev(a.kv_heads)), head_dim=int(ev(a.head_dim)),
                          v_head_dim=int(ev(a.v_head_dim)), batch=ev(a.batch), seq_len=ev(a.q_len), elem_bytes=dtype_bytes(node.dtypes[0]),
                          causal=a.causal or bool(documents), masked=a.masked or bool(documents),
                          window=ev(a.window), documents=tuple(documents), dropout=dropout, written=a.written,
                          positional=a.positional, unsplit="reads token positions inside it" if a.positional else "",
                          score_saved=a.score_saved, score_live=a.score_live, score_traffic=a.score_traffic)


def kernel_time(profile: HardwareProfile, cost: AttentionCost, dtype: str, backward: bool,
                share: float = 1.0) -> float:
    """Attention kernel time of the busiest rank. Ranks sharing devices (``share`` ranks per
    device) finish together no sooner than the busiest rank alone and than their summed work
    spread over the devices: max(max_r t_r, share * mean_r t_r). A rank that waits for a
    busier one yields its device to it (causal imbalance costs less when devices are shared)."""
    per_rank = [sum(c.count * profile.attention_call_time(c.heads, c.q_len, c.kv_len, c.head_dim, c.causal,
                                                          dtype, backward) for c in calls)
                for calls in cost.kernels]
    return max(max(per_rank), share * sum(per_rank) / len(per_rank))


def made_before(graph: OpGraph, attention: OpNode, profile: HardwareProfile, s_loc: float, share: float,
                overhead: float, tp: int = 1) -> dict[str, float]:
    """Per input of a forward attention op ("q", "k", "v": its first three operands), the seconds
    of the layer's forward compute between the op that makes it and the attention, at ``s_loc``
    tokens a rank (what runs while an exchange issued where the input is made moves)."""
    made = {role: graph.op(name).index
            for role, name in zip(("q", "k", "v"), list(graph.graph.predecessors(attention.name))[:3])}
    first = min(made.values(), default=attention.index)
    # each op between the earliest input and the attention timed once, then summed per input
    split = split_ops(graph)[0] if tp > 1 else frozenset()
    between = [(n.index, _op_time(n, profile, s_loc, share, graph.dtype, tp, split) + overhead)
               for n in graph.nodes(phase="fwd", layer=attention.layer)
               if first < n.index < attention.index and n.kind not in (OpKind.VIEW, OpKind.ATTENTION)]
    return {role: sum(t for i, t in between if i > index) for role, index in made.items()}


def _op_time(a: OpNode, profile: HardwareProfile, s_loc: float, share: float, dtype: str, tp: int = 1,
             split: frozenset = frozenset()) -> float:
    # TP divides the work of the ops inside the split modules (tensor_parallel.split_ops)
    tp = tp if a.name in split else 1
    if a.kind == OpKind.MATMUL:
        return share * profile.matmul_time(evaluate(a.flops, s_loc) / tp, a.dtypes[0] if a.dtypes else dtype)
    return share * profile.memory_bound_time((evaluate(a.bytes_read, s_loc) + evaluate(a.bytes_written, s_loc)) / tp)


def predict(graph: OpGraph, profile: HardwareProfile, *, sp: int = 1, strategy: str | Strategy = "ulysses",
            layout: str | None = None, seq_len: int | None = None, dp: int = 1, zero_stage: int = 0,
            reduce_grads: bool = True, devices_per_node: int | None = None,
            documents: tuple[int, ...] = (), overlap: bool = True, zero_shard: int = 0,
            fused: bool = False, tp: int = 1) -> Prediction:
    """Time and memory of one training step of ``graph`` on ``sp`` x ``dp`` x ``tp`` devices under
    one strategy (``tp``: the tensor-parallel degree); memory as ``aot_eager`` runs the step, or, ``fused``, as Inductor does (a bf16
    model's fp32 transients never written: :mod:`autosp.costmodel.fusion`)."""
    S = seq_len or graph.seq_len
    if sp < 1 or S % sp:
        raise AutospError(f"sequence length {S} is not divisible by the SP degree {sp}; pad it to "
                          f"{-(-S // sp) * sp}")
    s_loc = S / sp
    dtype = graph.dtype
    if graph.first_attention() is None:
        raise AutospError(f"model '{graph.model_name}' has no attention op to parallelise")
    model_flops = graph.total_flops(S)
    graph = at_sp_degree(graph, sp)         # sequence mixers run on the whole sequence (costmodel/mixers.py)
    dpn = devices_per_node or profile.devices_per_node
    # One device runs attention as it is; otherwise the strategy named, on the layout it needs
    # unless one is given.
    if sp == 1:
        strat = pick(AUTO, AttentionShape(heads=1, kv_heads=1), SPMesh(1, "contiguous", dpn))
    else:
        strat = resolve(strategy)
    # a TP group fills dpn / tp ... of a node: the SP group has that many ranks on each
    mesh = SPMesh(sp, layout or required_layout([strat]) or "contiguous", max(1, dpn // tp))
    share = max(1.0, min(sp * dp * tp, dpn) / profile.devices_per_node)
    overhead = share * profile.op_overhead_s
    # Per attention shape: its cost and kernel times (forward, backward), computed once.
    # (cost, forward kernels, backward kernels, the backward's exposed transfers)
    costs: dict[AttentionShape, tuple[AttentionCost, float, float, float]] = {}
    p = Prediction(strategy=strat.spec, sp=sp, dp=dp, seq_len=S, compute_s=0.0, comm_s=0.0, exposed_comm_s=0.0,
                   total_s=0.0, memory={}, peak_bytes=0.0, model_flops=0.0, mfu=0.0, tokens_per_s=0.0)
    workspace = backward_s = 0.0
    mlps = {tiled_region(graph, lc.captured[0]) for lc in graph.layer_classes.values()} - {None}
    split = split_ops(graph)[0] if tp > 1 else frozenset()
    heads_tp = tp if tp > 1 and splits_attention(graph) else 1       # attention TP leaves whole: its heads all here
    for a, w in graph.weighted_nodes():
        if a.kind == OpKind.VIEW:
            continue
        if a.kind == OpKind.ATTENTION:
            shape = local_attention(attention_shape(a, S, graph.attention_dropout, documents), heads_tp)
            if shape not in costs:
                reason = strat.refuses(shape, mesh)
                if reason:
                    raise AutospError(f"strategy '{strat.spec}' cannot run {graph.model_name}'s attention: "
                                      f"it {reason}")
                cost = strat.cost(shape, mesh)
                copy = share * profile.memory_bound_time(cost.copy_bytes) if cost.copy_bytes else 0.0
                t_fwd = kernel_time(profile, cost, dtype, False, share) + copy
                t_bwd = kernel_time(profile, cost, dtype, True, share) + copy
                # the formulas group transfers by phase, so the backward's alone is its share; it
                # does not depend on where the forward makes q, k, v
                backward = dataclasses.replace(cost, transfers=[tr for tr in cost.transfers if tr.phase == "bwd"])
                costs[shape] = (cost, t_fwd, t_bwd, transfer_times(profile, backward, t_fwd, t_bwd)[1])
            cost, t_fwd, t_bwd, bwd_exposed = costs[shape]
            t = t_bwd if a.phase == "bwd" else t_fwd
            if a.phase == "bwd":
                p.attention_bwd_s += w * t
            else:
                p.attention_fwd_s += w * t
                early = made_before(graph, a, profile, s_loc, share, overhead, tp) \
                    if any(tr.lead for tr in cost.transfers) else None
                comm, exposed = transfer_times(profile, cost, t_fwd, t_bwd, early)
                p.attention_comm_s += w * comm
                p.attention_exposed_s += w * exposed
                p.attention_exposed_bwd_s += w * bwd_exposed
                workspace = cost.workspace_bytes if sp > 1 else 0.0
        elif a.kind == OpKind.MATMUL:
            t = _op_time(a, profile, s_loc, share, dtype, tp, split)
            if a.layer is None and a.phase == "fwd":
                p.head_forward_s += w * (t + overhead)
        else:
            t = _op_time(a, profile, s_loc, share, dtype, tp, split)
            if a.layer is not None and a.phase == "fwd":
                p.layer_forward_pointwise_s += w * (t + overhead)
        p.compute_s += w * (t + overhead)
        if a.phase == "bwd":
            backward_s += w * (t + overhead)
        if a.layer is not None:
            p.layer_compute_s += w * (t + overhead)
            if a.phase == "fwd":
                p.layer_forward_s += w * (t + overhead)
                if a.region in mlps:
                    p.mlp_forward_s += w * (t + overhead)

    p.attention_saved = {}
    for fp, lc in graph.layer_classes.items():
        p.attention_saved[fp] = sum(costs[local_attention(attention_shape(a, S, graph.attention_dropout, documents),
                                                          heads_tp)][0].saved_bytes
                                    for a in graph.nodes(phase="fwd", kind=OpKind.ATTENTION, layer=lc.captured[0])
                                    ) if sp > 1 else 0.0
    p.backward_s = backward_s
    p.gradient_comm_s, gradient_exposed = _gradient_comm(graph, profile, sp * dp, zero_stage,
                                                         reduce_grads or dp > 1, backward_s,
                                                         p.compute_s - backward_s, overlap, zero_shard, dpn, tp)
    tpc = tp_comm(graph, profile, tp, s_loc)
    p.tp, p.tp_comm_s, p.tp_layer_s, p.tp_layer_forward_s = tp, tpc.total_s, tpc.layer_s, tpc.layer_forward_s
    p.mixer_comm_s = mixer_comm(graph, profile, sp, S, sp > max(1, dpn // tp))
    p.comm_s = p.attention_comm_s + p.gradient_comm_s + p.tp_comm_s + p.mixer_comm_s
    p.gradient_exposed_s = gradient_exposed
    p.exposed_comm_s = p.attention_exposed_s + gradient_exposed + p.tp_comm_s + p.mixer_comm_s
    p.phases = {}
    p.memory = _memory(graph, S, sp, dp, zero_stage, workspace, p.phases, zero_shard, fused, tp)
    p.peak_bytes = p.memory["peak"]
    p.model_flops = model_flops / (sp * tp)    # per device: its share of one sequence
    p.total_s = p.compute_s + p.exposed_comm_s
    peak = profile.peak_flops(dtype)
    p.mfu = p.model_flops / (p.total_s * peak) if peak else 0.0
    p.tokens_per_s = graph.batch_size * S / (sp * tp) / p.total_s
    return p


BUCKET_BYTES = 25 * 2 ** 20         # autosp's gradient buckets (autosp.compile(bucket_mb=25))


def _gradient_comm(graph: OpGraph, profile: HardwareProfile, group: int, zero_stage: int, reduce: bool,
                   backward_s: float, forward_s: float = 0.0, overlap: bool = True, shard: int = 0,
                   devices_per_node: int | None = None, tp: int = 1) -> tuple[float, float]:
    """(communication, exposed) of the gradient reduction over the SP x DP group and ZeRO 3's
    parameter gathers.

    Stages 0 and 1 all-reduce buckets launched as each fills during the backward
    (:mod:`autosp.transform.zero.grad_reducer`): every bucket but the last moves beside the
    backward compute still to run, t = all buckets, t_last = the last one's, the backward
    beside them slowed by the profile's compute concurrency factor:
        exposed = t_last + max(0, s_comm * (t - t_last) - backward_s)
                  + (s_compute - 1) * min(backward_s, s_comm * (t - t_last))
    Stage 2 shards with one FSDP unit (the root): its gathers and its reduce-scatter run
    before the forward and after the backward, exposed in full.
    Stage 3 gathers per unit inside the graph (:mod:`autosp.transform.zero.gather`): U = the blocks
    + 2 units (embedding, head), each a gather g and a reduce-scatter r of 1/U of the
    parameters; the backward gathers each again, blocking (recomputed where it is needed).
    Overlapped (:mod:`autosp.transform.zero.prefetch`) unit k+1's gather moves beside unit k's
    forward f = forward_s / U, and unit k's reduce-scatter beside unit k-1's backward
    b = backward_s / U, each slowed by the profile's concurrency factors:
        hide(c, w) = max(0, s_comm * c - w) + (s_compute - 1) * min(w, s_comm * c)
        exposed = U * g + g + (U - 1) * hide(g, f) + r + (U - 1) * hide(r, b)
    and blocking, exposed = 2 * U * g + U * r. HSDP (``shard`` = k ranks per shard group, a node):
    g gathers over the k ranks, and r is a reduce-scatter over them plus an all-reduce of the
    reduced 1/k shard over the group / k replicas, across nodes.
    Under TP (degree t) the group is the SP x DP ranks of one TP rank, t to a node's group of
    devices: they move its parameters alone (:func:`params_per_rank`), and a shard group of k
    ranks of the world (a node) is k / t of them.
    """
    if group <= 1 or not reduce:
        return 0.0, 0.0
    gbytes = params_per_rank(graph, tp) * dtype_bytes(graph.dtype)
    dpn = max(1, (devices_per_node or profile.devices_per_node) // tp)
    big = group > dpn
    s_comm, s_compute = profile.concurrency()
    if zero_stage == 3:
        units = sum(lc.count for lc in graph.layer_classes.values()) + 2
        shard = max(1, shard // tp) if shard else 0
        k = shard if 0 < shard < group else group
        inside = k > dpn
        g = profile.collective_time("all_gather", k, gbytes / units / k, inside)
        r = profile.collective_time("reduce_scatter", k, gbytes / units, inside)
        if k < group:
            r += profile.collective_time("all_reduce", group // k, gbytes / units / k, True)
        t = units * (2 * g + r)
        if not overlap:
            return t, t

        def hide(c: float, w: float) -> float:
            return max(0.0, s_comm * c - w) + (s_compute - 1) * min(w, s_comm * c)
        return t, units * g + g + (units - 1) * hide(g, forward_s / units) + r + \
            (units - 1) * hide(r, backward_s / units)
    collective = "reduce_scatter" if zero_stage >= 2 else "all_reduce"
    t = profile.collective_time(collective, group, gbytes, big)
    if zero_stage >= 2:
        return t, t
    t_last = profile.collective_time(collective, group, min(gbytes, BUCKET_BYTES), big)
    rest = s_comm * (t - t_last)
    return t, t_last + max(0.0, rest - backward_s) + (s_compute - 1) * min(backward_s, rest)


def _memory(graph: OpGraph, S: float, sp: int, dp: int, zero_stage: int, workspace: float,
            phases: dict, zero_shard: int = 0, fused: bool = False, tp: int = 1) -> dict[str, float]:
    states = model_states(graph, sp * dp, zero_stage, zero_shard, tp)
    s_loc = S / sp
    # TP splits what its rule splits t ways (tensor_parallel.py)
    step_peak, grads_traced, at_attention = liveness_peak(graph, s_loc, phases, full=S, fused=fused, tp=tp,
                                                          split=split_ops(graph)[1] if tp > 1 else frozenset())
    extra_layers = untraced_layer_activations(graph, s_loc) * saved_share(graph, tp)
    # The strategy's buffers exist only around attention: they raise the peak only if the
    # schedule is near its peak there (the peak is often at the loss, where they are gone).
    step = max(step_peak, at_attention + workspace) + extra_layers
    phases["untraced"] = extra_layers
    activations = step_peak + extra_layers - grads_traced
    gathered = zero3_transient(graph, tp) if zero_stage == 3 and sp * dp > 1 else 0.0
    if gathered:        # ZeRO 3 in the graph: gradients leave as shards, a unit at a time whole
        step += gathered - grads_traced + states["gradients"]
        grads_traced = states["gradients"]
    return {**states, "activations": activations, "workspace": workspace,
            **({"gathered": gathered} if gathered else {}), "step_peak": step,
            "peak": states["parameters"] + states["optimizer"] + step - grads_traced + states["gradients"]}


def zero3_transient(graph: OpGraph, tp: int = 1) -> float:
    """ZeRO 3 gathered inside the graph (:mod:`autosp.transform.zero.gather`): besides its shards a rank
    holds about three copies of one unit at its backward's peak: blocking, the parameters gathered
    again, their whole gradients and the flat buffer the reduce-scatter sends; overlapped
    (:mod:`autosp.transform.zero.prefetch`), the gradients, their buffer and the unit after's buffer
    still in flight (the parameters are dead by then). A unit is a transformer block, or the
    embedding or the head (half the parameters outside the blocks)."""
    unit = max([lc.params for lc in graph.layer_classes.values()] + [graph.nonlayer_params / 2])
    return 3 * unit * dtype_bytes(graph.dtype) * params_per_rank(graph, tp) / graph.total_params


def step_peak(graph: OpGraph, profile: HardwareProfile, *, sp: int, strategy: str | Strategy, seq_len: int,
              checkpoint: str = "none", mlp_chunks: int = 1, loss_chunks: int = 1, layout: str | None = None,
              offload: bool = False, keep_mlp_input: bool = True, fused: bool = False) -> float:
    """Predicted peak bytes allocated during one step on one device, under the memory decisions
    (checkpointing, MLP and loss tiling, offload, whether a fully checkpointed layer's tiled MLP keeps
    its input; the same for every layer), as the planner's memory
    constraints count them: what the memory probe measures (``fused``: as Inductor runs the step,
    :mod:`autosp.costmodel.fusion`; else as ``aot_eager`` does)."""
    p = predict(graph, profile, sp=sp, strategy=strategy, seq_len=seq_len, layout=layout, fused=fused)
    graph = at_sp_degree(graph, sp)
    tokens = seq_len / sp
    terms = peak_terms(graph, tokens, p.phases, 0.0, p.phases["untraced"], p.memory["workspace"], loss_chunks)
    choice = {fp: (checkpoint, mlp_chunks, keep_mlp_input) for fp in graph.layer_classes}
    return decided_peak(graph, tokens, terms, choice,
                        p.attention_saved, frozenset(graph.layer_classes) if offload else frozenset(), fused)
