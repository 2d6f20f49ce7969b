"""``autosp.plan``: build the ILP's candidates from the cost model, solve, explain.

Candidates are meshes (SP degree x token layout); under each, every layer class
may take any (strategy, checkpointing, MLP chunks, MLP input kept or recomputed under full
checkpointing, offload) option, where the strategies are the
registry's legal candidates for that mesh (:func:`autosp.strategies.candidates`:
Ulysses, ring, all-gather-KV, every Ulysses x ring shape, ...). The time and
memory of each option come from :func:`autosp.costmodel.predict`; the ILP
(:mod:`autosp.planner.ilp`) picks the cheapest combination that fits, and its
runner-ups.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, replace
from typing import Any

from autosp.costmodel.live_tensors import largest_live
from autosp.costmodel.memory import dtype_bytes, hidden_bytes, layer_saved, mlp_saved, model_states
from autosp.costmodel.phases import FIRST, first_layer_own, own_bytes, peak_terms, strategy_saved, with_strategy_own
from autosp.costmodel.offload import copy_exposed, host_budget, host_optimizer_bytes, host_optimizer_step, offloaded_own
from autosp.costmodel.predict import Prediction, attention_shape, predict
from autosp.costmodel.profile import HardwareProfile, load_profile
from autosp.decisions import (CHECKPOINTS, HOST_OPTIMIZERS, LOSS_CHUNKS, MLP_CHUNKS, OFFLOADS,
                              LayerChoice, MeshChoice, mlp_chunk_counts)
from autosp.errors import AutospError
from autosp.options import COMPILERS
from autosp.graph import OpGraph, capture
from autosp.planner.ilp import Candidate, Option, Solution, peak_bytes, phase_bytes, solve_k_best
from autosp.planner.plan import LayerPlan, Plan, model_fingerprint
from autosp.strategies import SPMesh, candidates, resolve
from autosp.strategies.layout import n_chunks, planned_layouts


# The share of the memory limit a plan leaves free: the memory model's tolerance (its predicted
# peaks are validated to within 5% of the measured ones), so that a plan predicted to fit fits.
MEMORY_MARGIN = 0.05


def _budget(limit: float, margin: float) -> float:
    """What the ILP may fill of ``limit`` bytes."""
    if not 0.0 <= margin < 1.0:
        raise AutospError(f"memory margin must be at least 0 and below 1 (a share of the limit), got {margin}")
    return limit * (1.0 - margin)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_candidates(graph: OpGraph, prof: HardwareProfile, world: int, dpn: int, zero_stage: int,
                     seq_len: int, sp_degrees: tuple[int, ...] | None = None,
                     checkpoints: tuple[str, ...] = CHECKPOINTS,
                     strategies: tuple[str, ...] | None = None,
                     documents: tuple[int, ...] = (), overlap: bool = True,
                     mlp_chunks: tuple[int, ...] = MLP_CHUNKS,
                     loss_chunks: tuple[int, ...] = LOSS_CHUNKS, zero_shard: int = 0,
                     offloads: tuple[bool, ...] = OFFLOADS, fused: bool = True,
                     host_optimizers: tuple[bool, ...] = HOST_OPTIMIZERS) -> tuple[list[Candidate], dict]:
    """The ILP's meshes and options (``fused``: as Inductor runs the step, :mod:`autosp.costmodel.fusion`);
    ``strategies`` restricts the strategy families, ``mlp_chunks``
    the token chunks a layer's MLP may run in, ``loss_chunks`` those of the LM head and loss (1: untiled),
    ``offloads`` whether layers may keep their saved tensors in host memory (only where the profile
    has host memory to offload into), ``host_optimizers`` whether the optimizer may step on the host
    (a mesh decision: where the profile can cost it)."""
    # where the profile cannot cost the host, only the device is planned; never when the caller fixed the host
    if not prof.host_memory_bytes:
        _host_refused(prof, "offloading checkpoints", offloads, "offload", "Decisions.of(offload=True)")
        offloads = (False,)
    if not prof.steps_on_host:
        _host_refused(prof, "the optimizer in host memory", host_optimizers, "host_optimizer",
                      "Decisions(mesh=autosp.MeshChoice(host_optimizer=True))")
        host_optimizers = (False,)
    optimizer = model_states(graph, world, zero_stage, zero_shard)["optimizer"]
    host_step = host_optimizer_step(prof, optimizer, dtype_bytes(graph.dtype))
    host_states = host_optimizer_bytes(optimizer, dtype_bytes(graph.dtype))
    nodes = graph.attention_nodes("fwd")
    if not nodes:
        raise AutospError(f"model '{graph.model_name}' has no attention op to parallelise")
    shape = attention_shape(nodes[0], seq_len, graph.attention_dropout, documents)
    cands: list[Candidate] = []
    preds: dict[tuple, dict[str, Prediction]] = {}
    total_layers = sum(lc.count for lc in graph.layer_classes.values())
    width = hidden_bytes(graph, 1.0) / dtype_bytes(graph.dtype)        # the hidden size, for ALST's MLP chunks
    for sp in _divisors(world):
        if sp_degrees is not None and sp not in sp_degrees:
            continue
        tokens = seq_len / sp
        tileable = {fp: bool(t["tileable"]) for fp, t in mlp_saved(graph, tokens).items()}
        # per (checkpointing, MLP chunks, MLP input kept): what one layer keeps, and holds beyond it
        # in its own backward
        memory_choices = [(k, c, keep) for k in checkpoints for c in mlp_chunk_counts(mlp_chunks, tokens, width)
                          for keep in ((True, False) if k == "full" and c > 1 else (True,))]
        untiled = [(k, 1, True) for k in checkpoints]       # a class whose MLP cannot be tiled
        everything = set(memory_choices) | set(untiled)
        kept = {m: layer_saved(graph, tokens, *m) for m in everything}
        own = {(fp, *m): own_bytes(graph, tokens, fp, *m, fused=fused)
               for fp in graph.layer_classes for m in everything}
        by_layout: dict[str, dict[str, Prediction]] = {}     # the loss's tiling does not change them
        layouts = planned_layouts(tuple(documents)) if sp > 1 else planned_layouts()[:1]
        for layout, kl in itertools.product(layouts, loss_chunks):
            if seq_len % n_chunks(layout, sp):
                continue
            mesh = SPMesh(sp, layout, dpn, overlap)
            strats = candidates(mesh, shape, strategies)
            if not strats:
                continue
            if layout not in by_layout:
                by_layout[layout] = {st.spec: predict(graph, prof, sp=sp, strategy=st, layout=layout, seq_len=seq_len,
                                                      dp=world // sp, zero_stage=zero_stage, devices_per_node=dpn,
                                                      documents=documents, overlap=overlap,
                                                      zero_shard=zero_shard, fused=fused) for st in strats}
            ps = by_layout[layout]
            first = ps[strats[0].spec]
            layer_time = {st: p.layer_compute_s + p.attention_exposed_s for st, p in ps.items()}
            # What lies outside the layers is not the same for every strategy: ZeRO/DP
            # communication hides behind the layers' compute, so a strategy with longer kernels
            # leaves less of it exposed. Each option carries its share of the difference from the
            # first strategy's, so a plan whose layers all take one strategy costs exactly what
            # `predict` says for it (mixed strategies: the layers' shares, linearly).
            outside = {st: (p.total_s - layer_time[st], p.exposed_comm_s - p.attention_exposed_s)
                       for st, p in ps.items()}
            # each strategy's workspace is its options' own: it exists in its layers' backward
            terms = peak_terms(graph, tokens, first.phases, first.peak_bytes - first.memory["step_peak"],
                               first.phases["untraced"], 0.0, kl)
            # A tiled loss recomputes the head (and its loss) in backward.
            base_time, base_exposed = outside[first.strategy]
            cand = Candidate(key=MeshChoice(sp, layout, kl, zero_shard),
                             base_time_s=base_time + (first.head_forward_s if kl > 1 else 0.0)
                             + _chunk_overhead(prof, graph.dtype, kl, LOSS_OPS),
                             base_mem_bytes=terms.pop("loss"), phase_mem_bytes=terms, base_exposed_s=base_exposed)
            for fp, lc in graph.layer_classes.items():
                share = lc.count / total_layers
                opts = []
                for st, p in ps.items():
                    recompute = {"none": 0.0, "selective": p.layer_forward_pointwise_s,
                                 "full": p.layer_forward_s + p.attention_fwd_s}
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
                                               exposed_s=share * (p.attention_exposed_s + d_exposed),
                                               sp_exposed_s=share * p.attention_exposed_s,
                                               own_bytes=first_layer_own(own_phases, lc.count, one)))
                            continue
                        copy = copy_exposed(prof, one, p, total_layers, recompute[k] + again)
                        opts.append(Option(key=choice,
                                           time_s=time_s + lc.count * copy,
                                           mem_bytes=one,           # the one layer whose copy is in flight
                                           exposed_s=share * (p.attention_exposed_s + d_exposed),
                                           sp_exposed_s=share * p.attention_exposed_s,
                                           own_bytes=offloaded_own(own_phases, one),
                                           host_bytes=lc.count * one, copy_exposed_s=lc.count * copy))
                cand.options[fp] = opts
            cands.extend(_where_optimizer_steps(cand, host_optimizers, optimizer, host_step, host_states))
            preds[(sp, layout)] = ps
    return cands, preds


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


def counts_fusion(compiler: str) -> bool:
    """Whether the memory model counts Inductor's fused kernels for ``compiler`` (refused if unknown)."""
    if compiler not in COMPILERS:
        raise AutospError(f"unknown compiler '{compiler}'; plan for one of {', '.join(COMPILERS)}")
    return compiler == "inductor"


def _chunk_overhead(prof: HardwareProfile, dtype: str, chunks: int, ops: int) -> float:
    """Seconds that running a region in ``chunks`` token chunks adds: a kernel floor per extra launch."""
    return (chunks - 1) * ops * prof.matmul_time(1.0, dtype) if chunks > 1 else 0.0


def plan(model: Any, *, seq_len: int, batch_size: int = 1, world_size: int = 1, devices_per_node: int | None = None,
         profile: str | HardwareProfile = "h100-sxm", memory_limit: float | None = None, zero_stage: int = 0,
         dtype: str = "bfloat16", graph: OpGraph | None = None, alternatives: int = 5,
         sp_degrees: tuple[int, ...] | None = None, checkpoints: tuple[str, ...] = CHECKPOINTS,
         strategies: tuple[str, ...] | None = None, documents: tuple[int, ...] | None = None,
         overlap: bool = True, mlp_chunks: tuple[int, ...] = MLP_CHUNKS,
         loss_chunks: tuple[int, ...] = LOSS_CHUNKS, memory_margin: float = MEMORY_MARGIN,
         zero_shard: int | None = None, offloads: tuple[bool, ...] = OFFLOADS, compiler: str = "inductor",
         host_optimizers: tuple[bool, ...] = HOST_OPTIMIZERS) -> Plan:
    """Plan SP for ``model`` on ``world_size`` devices; see :mod:`autosp.planner.ilp` for the ILP.

    The plan's predicted peak stays within ``memory_limit`` x (1 - ``memory_margin``): the margin
    (default 5%, the memory model's tolerance) absorbs the model's error.

    ``sp_degrees``, ``checkpoints``, ``mlp_chunks`` (token chunks of a layer's MLP, 1 = untiled),
    ``loss_chunks`` (of the LM head and loss), ``offloads`` (whether layers may keep their saved
    tensors in host memory), ``host_optimizers`` (whether the optimizer states may live and step in
    host memory) and ``strategies`` (strategy families) restrict the space,
    ``overlap=False`` to strategies that do not pipeline collectives with compute;
    ``documents``: lengths of the documents packed into each sequence (costed with the causal
    mask within each that the model builds from restarting position ids).
    ``zero_shard`` (ZeRO 3): 0 shards parameters over every rank, k over each k ranks (HSDP);
    ``None`` (default) lets the planner choose between the whole mesh and one node where the
    world spans several: within a node the gathers stay on the node's fast links, at k / N of
    the memory savings. ``compiler``: what will run the step (Inductor, the default, never writes a
    bf16 model's fp32 copies, which "aot_eager" and "eager" do)."""
    fused = counts_fusion(compiler)
    if world_size < 1:
        raise AutospError(f"world size must be at least 1, got {world_size}")
    if zero_stage not in (0, 1, 2, 3):
        raise AutospError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    dpn = devices_per_node or prof.devices_per_node
    limit = memory_limit or prof.tensor_memory_bytes
    g = graph if graph is not None else capture(model, seq_len=seq_len, batch_size=batch_size, dtype=dtype)
    if limit == float("inf"):
        limit = float(2 ** 60)           # "no limit": the ILP still needs an (int64-sized) number
    budget = _budget(limit, memory_margin)
    if zero_shard is None:
        zero_shard = 0
        shards = [0, dpn] if zero_stage == 3 and world_size > dpn and world_size % dpn == 0 else [0]
    else:
        shards = [zero_shard]
    t_cost = t_solve = 0.0
    best: tuple | None = None
    for shard in shards:      # per sharding group its own ILP; the faster plan that fits wins
        t0 = time.perf_counter()
        cands, preds = build_candidates(g, prof, world_size, dpn, zero_stage, seq_len, sp_degrees, checkpoints,
                                        strategies, tuple(documents or ()), overlap, tuple(mlp_chunks),
                                        tuple(loss_chunks), zero_shard=shard, offloads=tuple(offloads), fused=fused,
                                        host_optimizers=tuple(host_optimizers))
        t_cost += time.perf_counter() - t0
        t1 = time.perf_counter()
        host = host_budget(prof, world_size, dpn, memory_margin)
        ranked = solve_k_best(cands, budget, alternatives + 1, host_limit=host) if cands else []
        t_solve += time.perf_counter() - t1
        if best is None or (ranked and (not best[1] or ranked[0].time_s < best[1][0].time_s)):
            best = (shard, ranked, cands)
    zero_shard, ranked, cands = best
    if not ranked:
        if not cands:
            raise AutospError(f"no strategy in {', '.join(strategies or ())} can run {g.model_name} on "
                              f"{world_size} devices at {seq_len} tokens; allow more strategies or SP degrees")
        from autosp.planner.longest import _infeasible_hint   # it searches with plan's own feasibility

        raise AutospError(_infeasible_hint(g, prof, world_size, dpn, zero_stage, seq_len, limit, memory_margin,
                                           tuple(offloads), fused, tuple(host_optimizers)))
    sol = ranked[0]
    by_key = {c.key: c for c in cands}
    out = _to_plan(g, prof, sol, ranked[1:], by_key, world_size, dpn, limit, memory_margin, zero_stage, zero_shard,
                   seq_len,
                   {"status": sol.status, "candidates": len(cands), "cost_s": t_cost, "solve_s": t_solve,
                    "solves": len(ranked),
                    "variables": len(cands) + sum(len(o) for c in cands for o in c.options.values())})
    out.predicted["compiler"] = compiler        # what the memory model assumed runs the step
    if not memory_limit and prof.runtime_reserved_bytes:      # the limit is the device's, less the runtime's
        out.predicted["runtime_reserved_bytes"] = prof.runtime_reserved_bytes
    if documents:
        out.predicted["documents"] = list(documents)        # what the attention costs assumed
    return out


def _summary(g: OpGraph, prof: HardwareProfile, sol: Solution, cand: Candidate, seq_len: int) -> dict[str, Any]:
    mesh: MeshChoice = sol.mesh
    opts = {fp: {o.key: o for o in os} for fp, os in cand.options.items()}
    exposed = cand.base_exposed_s + sum(opts[fp][key].exposed_s for fp, key in sol.choice.items())
    copies = sum(opts[fp][key].copy_exposed_s for fp, key in sol.choice.items())
    host = cand.base_host_bytes + sum(opts[fp][key].host_bytes for fp, key in sol.choice.items())
    peak = prof.peak_flops(g.dtype)
    flops = g.total_flops(seq_len) / mesh.sp_degree
    # a report (JSON): the decisions as plain fields
    return {"sp": mesh.sp_degree, "layout": mesh.layout, "loss_chunks": mesh.loss_chunks,
            "host_optimizer": mesh.host_optimizer,
            "layers": {fp: {"class": g.layer_classes[fp].module_type, **asdict(choice)}
                       for fp, choice in sol.choice.items()},
            "total_s": sol.time_s, "peak_bytes": sol.mem_bytes, "exposed_comm_s": exposed,
            "exposed_copy_s": copies, "host_bytes": host,
            "compute_s": sol.time_s - exposed - copies, "mfu": flops / (sol.time_s * peak) if peak else 0.0}


def _to_plan(g: OpGraph, prof: HardwareProfile, sol: Solution, alts: list[Solution], cands: dict, world: int,
             dpn: int, limit: float, margin: float, zero_stage: int, zero_shard: int, seq_len: int,
             solver: dict) -> Plan:
    sp = sol.mesh.sp_degree
    main = _summary(g, prof, sol, cands[sol.mesh], seq_len)
    mesh = SPMesh(sp, sol.mesh.layout, dpn)
    layers = []
    for fp, lc in g.layer_classes.items():
        choice: LayerChoice = sol.choice[fp]
        strat = resolve(choice.strategy)
        u, r = strat.grid(mesh)
        chosen = next(o for o in cands[sol.mesh].options[fp] if o.key == choice)
        layers.append(LayerPlan(lc.module_type, fp, lc.count, choice, ulysses_degree=u, ring_degree=r,
                                overlap=strat.overlap, exposed_comm_s=chosen.sp_exposed_s))
    states = model_states(g, world, zero_stage, zero_shard)
    on_host = states["optimizer"] if sol.mesh.host_optimizer else 0.0
    states["optimizer"] -= on_host      # stepped on the host: its states hold no device memory
    memory = {**states, "activations": sol.mem_bytes - sum(states.values()), "peak": sol.mem_bytes}
    saved_by = _what_each_saves(cands, sol)
    if on_host:                         # they left every device constraint (ilp.py)
        saved_by["optimizer on the host"] = on_host
    predicted = {"compute_s": main["compute_s"], "exposed_comm_s": main["exposed_comm_s"], "total_s": sol.time_s,
                 # offload: host memory per rank its layers' saved tensors (and optimizer states, when
                 # stepped there) take, and the copies' exposed time
                 "host_bytes": main["host_bytes"], "exposed_copy_s": main["exposed_copy_s"],
                 "host_optimizer_bytes": cands[sol.mesh].base_host_bytes,
                 "host_optimizer_step_s": host_optimizer_step(prof, on_host, dtype_bytes(g.dtype)) if on_host else 0.0,
                 "memory": memory, "peak_bytes": sol.mem_bytes,
                 "tokens_per_s_per_device": g.batch_size * seq_len / sp / sol.time_s, "mfu": main["mfu"],
                 "saved_by": saved_by,
                 # what bounds the context: the captured step's largest tensors at its peak, per rank,
                 # before checkpointing and tiling (the decisions above shrink some of them)
                 "largest_live": largest_live(g, seq_len / sp, full=seq_len),
                 "bound_by": _bound_by(g, cands[sol.mesh], sol, main["host_bytes"],
                                       host_budget(prof, world, dpn, margin) if prof.host_memory_bytes else 0.0)}
    return Plan(model=g.model_name, fingerprint=model_fingerprint(g), seq_len=seq_len, batch_size=g.batch_size,
                dtype=g.dtype, world_size=world, devices_per_node=dpn, dp_degree=world // sp, mesh=sol.mesh,
                layers=layers, predicted=predicted, profile=prof.name, memory_limit_bytes=limit,
                memory_margin=margin, zero_stage=zero_stage,
                alternatives=[_summary(g, prof, a, cands[a.mesh], seq_len) for a in alts], solver=solver)


def _bound_by(g: OpGraph, cand: Candidate, sol: Solution, host: float, host_limit: float) -> dict[str, Any]:
    """Where the plan's device memory peaks (the constraint closest to the limit: what bounds a
    longer context), and how much of the host's budget its offloaded layers take."""
    phases = phase_bytes(cand, sol.choice)
    key = max(phases, key=phases.__getitem__)
    if key == "loss":
        where = "the LM head and loss"
    else:
        fp, phase = key
        part = "its MLP" if phase.startswith("mlp") else "the rest (attention)"
        first = ", the first layer (its class's others done)" if phase.endswith(FIRST) else ""
        where = f"a {g.layer_classes[fp].module_type}'s backward, {part}{first}"
    return {"phase": where, "bytes": phases[key], "host_bytes": host, "host_budget": host_limit}


def _what_each_saves(cands: dict, sol: Solution) -> dict[str, float]:
    """Peak bytes each memory decision of the plan saves: the plan's peak with that decision undone
    (checkpointing none, MLPs whole, the loss whole) minus its own, for the decisions taken."""
    cand = cands[sol.mesh]
    out: dict[str, float] = {}

    def undone(**change: Any) -> float | None:
        choice = {c: replace(k, **change) for c, k in sol.choice.items()}
        keys = {c: {o.key for o in cand.options[c]} for c in choice}
        if any(choice[c] not in keys[c] for c in choice):
            return None
        return peak_bytes(cand, choice) - sol.mem_bytes

    if any(k.checkpoint != "none" for k in sol.choice.values()):
        out["checkpointing"] = undone(checkpoint="none")
    if any(k.mlp_chunks > 1 for k in sol.choice.values()):
        out["MLP chunks"] = undone(mlp_chunks=1)
    whole = replace(sol.mesh, loss_chunks=1)
    if sol.mesh.loss_chunks > 1 and whole in cands:
        out["loss chunks"] = peak_bytes(cands[whole], sol.choice) - sol.mem_bytes
    return {k: v for k, v in out.items() if v is not None}
