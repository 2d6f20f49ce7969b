"""The ILP's candidates: meshes, and under each every layer class's options, costed.

Candidates are meshes (TP degree x SP degree x token layout x loss chunks, ZeRO 3's sharding
group, where the optimizer steps; DP takes the rest of the world); under each, every layer class may take any (strategy, checkpointing, MLP
chunks, MLP input kept or recomputed under full checkpointing, offload) option, where the
strategies are the registry's legal candidates for that mesh (:func:`autosp.strategies.candidates`:
Ulysses, ring, all-gather-KV, every Ulysses x ring shape, ...). The time and memory of each option
come from :func:`autosp.costmodel.predict`; :mod:`autosp.planner.ilp` picks among them.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from autosp.costmodel.memory import dtype_bytes, hidden_bytes, layer_saved, mlp_saved, model_states
from autosp.costmodel.mixers import at_sp_degree
from autosp.costmodel.offload import copy_exposed, host_optimizer_bytes, host_optimizer_step
from autosp.costmodel.phases import (first_layer_own, offloaded_own, own_bytes, peak_terms, strategy_saved,
                                    with_strategy_own)
from autosp.costmodel.predict import Prediction, attention_shape, predict
from autosp.costmodel.profile import HardwareProfile
from autosp.costmodel.tensor_parallel import (TP_DEGREES, check_tp_degree, legal_tp_degrees, local_attention,
                                              saved_share, splits_attention, tp_refused_for)
from autosp.decisions import LayerChoice, MeshChoice, mlp_chunk_counts
from autosp.errors import AutospError
from autosp.planner.ilp import Candidate, Option
from autosp.planner.problem import Problem
from autosp.strategies import SPMesh, candidates
from autosp.strategies.layout import n_chunks, planned_layouts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_candidates(problem: Problem, zero_shard: int = 0) -> list[Candidate]:
    """The ILP's meshes and options for ``problem`` with ZeRO 3 sharded per ``zero_shard`` ranks
    (0: every rank). Memory is counted as the problem's compiler runs the step (Inductor's fused
    kernels: :mod:`autosp.costmodel.fusion`); layers may keep their saved tensors in host memory,
    and the optimizer step on the host (a mesh decision), only where the profile can cost the host."""
    graph, prof, world, dpn = problem.graph, problem.profile, problem.world_size, problem.devices_per_node
    zero_stage, seq_len, space, documents = problem.zero_stage, problem.seq_len, problem.space, problem.documents
    overlap, fused, mlp_chunks, loss_chunks = space.overlap, problem.fused, space.mlp_chunks, space.loss_chunks
    checkpoints, offloads, host_optimizers = space.checkpoints, space.offloads, space.host_optimizers
    # where the profile cannot cost the host, only the device is planned; never when the caller fixed the host
    if not prof.host_memory_bytes:
        _host_refused(prof, "offloading checkpoints", offloads, "offload", "Decisions.of(offload=True)")
        offloads = (False,)
    if not prof.steps_on_host:
        _host_refused(prof, "the optimizer in host memory", host_optimizers, "host_optimizer",
                      "Decisions(mesh=autosp.MeshChoice(host_optimizer=True))")
        host_optimizers = (False,)
    nodes = graph.attention_nodes("fwd")
    if not nodes:
        raise AutospError(f"model '{graph.model_name}' has no attention op to parallelise")
    whole = attention_shape(nodes[0], seq_len, graph.attention_dropout, documents)
    cands: list[Candidate] = []
    total_layers = sum(lc.count for lc in graph.layer_classes.values())
    width = hidden_bytes(graph, 1.0) / dtype_bytes(graph.dtype)        # the hidden size, for ALST's MLP chunks
    # TP splits the heads only where it splits the attention (0 heads: no head constraint)
    by_heads = splits_attention(graph)
    for tp, sp in _tp_by_sp(problem, whole.heads if by_heads else 0, whole.kv_heads if by_heads else 0):
        shape = local_attention(whole, tp if by_heads else 1)
        optimizer = model_states(graph, world // tp, zero_stage, zero_shard, tp)["optimizer"]
        host_step = host_optimizer_step(prof, optimizer, dtype_bytes(graph.dtype))
        host_states = host_optimizer_bytes(optimizer, dtype_bytes(graph.dtype))
        # what a rank's layers keep, at its SP shard's tokens, of which TP splits a share
        tokens = seq_len / sp * saved_share(graph, tp)
        sized = at_sp_degree(graph, sp)       # its sequence mixers' sizes at the whole sequence
        tileable = {fp: bool(t["tileable"]) for fp, t in mlp_saved(sized, tokens).items()}
        # per (checkpointing, MLP chunks, MLP input kept): what one layer keeps, and holds beyond it
        # in its own backward
        memory_choices = [(k, c, keep) for k in checkpoints for c in mlp_chunk_counts(mlp_chunks, tokens, width)
                          for keep in ((True, False) if k == "full" and c > 1 else (True,))]
        untiled = [(k, 1, True) for k in checkpoints]       # a class whose MLP cannot be tiled
        everything = set(memory_choices) | set(untiled)
        kept = {m: layer_saved(sized, tokens, *m) for m in everything}
        own = {(fp, *m): own_bytes(sized, tokens, fp, *m, fused=fused)
               for fp in graph.layer_classes for m in everything}
        by_layout: dict[str, dict[str, Prediction]] = {}     # the loss's tiling does not change them
        layouts = planned_layouts(tuple(documents)) if sp > 1 else planned_layouts()[:1]
        for layout, kl in itertools.product(layouts, loss_chunks):
            if seq_len % n_chunks(layout, sp):
                continue
            mesh = SPMesh(sp, layout, max(1, dpn // tp), overlap)
            strats = candidates(mesh, shape, space.strategies)
            if not strats:
                continue
            if layout not in by_layout:
                by_layout[layout] = {st.spec: predict(graph, prof, sp=sp, strategy=st, layout=layout, seq_len=seq_len,
                                                      dp=world // (sp * tp), zero_stage=zero_stage,
                                                      devices_per_node=dpn, documents=documents, overlap=overlap,
                                                      zero_shard=zero_shard, fused=fused, tp=tp) for st in strats}
            ps = by_layout[layout]
            first = ps[strats[0].spec]
            # the layers' TP collectives are theirs (a full recompute repeats the forward's)
            layer_time = {st: p.layer_compute_s + p.attention_exposed_s + p.tp_layer_s for st, p in ps.items()}
            # What lies outside the layers is not the same for every strategy: ZeRO/DP
            # communication hides behind the layers' compute, so a strategy with longer kernels
            # leaves less of it exposed. Each option carries its share of the difference from the
            # first strategy's, so a plan whose layers all take one strategy costs exactly what
            # `predict` says for it (mixed strategies: the layers' shares, linearly).
            outside = {st: (p.total_s - layer_time[st], p.exposed_comm_s - p.attention_exposed_s - p.tp_layer_s)
                       for st, p in ps.items()}
            # each strategy's workspace is its options' own: it exists in its layers' backward
            terms = peak_terms(sized, tokens, first.phases, first.peak_bytes - first.memory["step_peak"],
                               first.phases["untraced"], 0.0, kl)
            # A tiled loss recomputes the head (and its loss) in backward.
            base_time, base_exposed = outside[first.strategy]
            cand = Candidate(key=MeshChoice(sp, layout, kl, zero_shard, zero_stage=zero_stage, tp_degree=tp),
                             base_time_s=base_time + (first.head_forward_s if kl > 1 else 0.0)
                             + _chunk_overhead(prof, graph.dtype, kl, LOSS_OPS),
                             base_mem_bytes=terms.pop("loss"), phase_mem_bytes=terms, base_exposed_s=base_exposed,
                             base_tp_exposed_s=first.tp_comm_s - first.tp_layer_s)
            for fp, lc in graph.layer_classes.items():
                share = lc.count / total_layers
                opts = []
                for st, p in ps.items():
                    recompute = {"none": 0.0, "selective": p.layer_forward_pointwise_s,
                                 "full": p.layer_forward_s + p.attention_fwd_s + p.tp_layer_forward_s}
                    d_time, d_exposed = outside[st][0] - base_time, outside[st][1] - base_exposed
                    for (k, chunks, keep), off in itertools.product(memory_choices if tileable[fp] else untiled,
                                                                    offloads):
                        # A tiled MLP recomputes its forward in backward, unless the layer's
                        # full recompute does already; it saves none of its intermediates.
                        again = p.mlp_forward_s if chunks > 1 and k != "full" else 0.0
                        again += lc.count * _chunk_overhead(prof, graph.dtype, chunks, MLP_OPS) / share

                        ours = strategy_saved(p.attention_saved[fp], k)
                        one = kept[(k, chunks, keep)][fp] + ours["kept"]         # what one layer keeps
                        choice = LayerChoice(st, k, chunks, offload=off, keep_mlp_input=keep)
                        own_phases = with_strategy_own(own[(fp, k, chunks, keep)], ours["own"], p.memory["workspace"],
                                                       choice.mlp_with_layer)
                        time_s = share * (layer_time[st] + recompute[k] + again + d_time)
                        if not off:
                            opts.append(Option(key=choice, time_s=time_s,
                                               mem_bytes=lc.count * one,
                                               exposed_s=share * (p.attention_exposed_s + p.tp_layer_s + d_exposed),
                                               sp_exposed_s=share * p.attention_exposed_s,
                                               tp_exposed_s=share * p.tp_layer_s,
                                               own_bytes=first_layer_own(own_phases, lc.count, one)))
                            continue
                        copy = copy_exposed(prof, one, p, total_layers, recompute[k] + again)
                        opts.append(Option(key=choice,
                                           time_s=time_s + lc.count * copy,
                                           mem_bytes=one,           # the one layer whose copy is in flight
                                           exposed_s=share * (p.attention_exposed_s + p.tp_layer_s + d_exposed),
                                           sp_exposed_s=share * p.attention_exposed_s,
                                           tp_exposed_s=share * p.tp_layer_s,
                                           own_bytes=offloaded_own(own_phases, one),
                                           host_bytes=lc.count * one, copy_exposed_s=lc.count * copy))
                cand.options[fp] = opts
            cands.extend(_where_optimizer_steps(cand, host_optimizers, optimizer, host_step, host_states))
    return cands


def _tp_by_sp(problem: Problem, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """The (TP degree, SP degree) pairs the space allows: TP inside a node and dividing the heads
    (:func:`autosp.costmodel.tensor_parallel.tp_refusal`), SP dividing the rest of the world."""
    space, world, dpn = problem.space, problem.world_size, problem.devices_per_node
    allowed = space.tp_degrees if space.tp_degrees is not None else TP_DEGREES
    nothing = tp_refused_for(problem.graph)
    for t in space.tp_degrees or ():        # degrees the caller fixed: each one must run
        if t > 1 and nothing:
            raise AutospError(f"TP degree {t} cannot help: {nothing}; use TP 1")
        check_tp_degree(t, heads, kv_heads, dpn, world)
    if nothing:
        allowed = (1,)
    return [(tp, sp) for tp in legal_tp_degrees(heads, kv_heads, dpn, world, allowed)
            for sp in _divisors(world // tp) if space.sp_degrees is None or sp in space.sp_degrees]


def _host_refused(prof: HardwareProfile, what: str, allowed: tuple[bool, ...], option: str, fixed: str) -> None:
    """A plan asked to use the host (only True allowed) on a profile that cannot cost it: refused."""
    if False in allowed:
        return
    why = "no host memory apart from the device's" if not prof.host_memory_bytes else \
        "no host optimizer step rate (host.optimizer_params_per_s)"
    raise AutospError(f"{what} was asked for, but profile {prof.name} has {why} to plan it; let the planner "
                      f"decide (autosp.Auto({option}=None), or drop it), or fix the decision yourself "
                      f"(autosp.{fixed})")


def _where_optimizer_steps(cand: Candidate, host_optimizers: tuple[bool, ...], optimizer: float,
                           host_step: float, host_states: float) -> list[Candidate]:
    """The mesh candidate as allowed: optimizer states on the device, and/or on the host, where they
    leave every device memory constant (``optimizer`` bytes) for the host's (``host_states``: with
    fp32 masters) and the step adds its time (ilp.py)."""
    out = [cand] if False in host_optimizers else []
    if True in host_optimizers:
        out.append(replace(cand, key=replace(cand.key, host_optimizer=True),
                           base_time_s=cand.base_time_s + host_step, base_mem_bytes=cand.base_mem_bytes - optimizer,
                           phase_mem_bytes={k: v - optimizer for k, v in cand.phase_mem_bytes.items()},
                           base_host_bytes=host_states))
    return out


# kernels a chunk of a tiled region runs (forward, recompute, backward): each chunk beyond the first
# launches them again, which the FLOP-based times do not see (small chunks run slower per FLOP)
MLP_OPS = 15
LOSS_OPS = 10


def _chunk_overhead(prof: HardwareProfile, dtype: str, chunks: int, ops: int) -> float:
    """Seconds that running a region in ``chunks`` token chunks adds: a kernel floor per extra launch."""
    return (chunks - 1) * ops * prof.matmul_time(1.0, dtype) if chunks > 1 else 0.0


