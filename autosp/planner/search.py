"""``autosp.plan``: solve the ILP over a problem's candidates, and explain the answer.

:mod:`autosp.planner.candidates` costs every mesh and layer option of a :class:`Problem`;
:mod:`autosp.planner.ilp` picks the cheapest combination that fits, and its runner-ups; here
they become a :class:`autosp.planner.plan.Plan` (its decisions, what it predicts, what each memory
decision saves and what binds).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from autosp.costmodel.live_tensors import largest_live
from autosp.costmodel.memory import dtype_bytes, model_states
from autosp.costmodel.mixers import at_sp_degree
from autosp.costmodel.offload import host_optimizer_step
from autosp.costmodel.phases import FIRST
from autosp.decisions import LayerChoice, MeshChoice
from autosp.errors import AutospError
from autosp.graph import OpGraph
from autosp.planner.candidates import build_candidates
from autosp.planner.feasibility import host_limit, infeasible_hint
from autosp.planner.ilp import Candidate, Solution, peak_bytes, phase_bytes, solve_k_best
from autosp.planner.plan import (BoundBy, LayerPlan, LiveTensor, Memory, Plan, Predicted, RunnerUp, RunnerUpLayer,
                                 Solver, model_fingerprint)
from autosp.planner.problem import Problem
from autosp.strategies import SPMesh, resolve


def plan(problem: Problem, *, alternatives: int = 5) -> Plan:
    """Plan ``problem`` (:meth:`Problem.of`); see :mod:`autosp.planner.ilp` for the ILP. The plan
    keeps ``alternatives`` runner-ups.

    The plan's predicted peak stays within the memory limit x (1 - margin): the margin (default
    5%, the memory model's tolerance) absorbs the model's error. ZeRO 3's sharding group, where the
    space leaves it open, is the whole mesh or one node where the world spans several (within a
    node the gathers stay on the node's fast links, at k / N of the memory savings): each its own
    ILP, the faster plan that fits wins."""
    if not problem.seq_len:
        raise AutospError("the problem has no sequence length to plan at; give Problem.of(..., seq_len=...) "
                          "(max_seq_len finds the longest that fits)")
    world, dpn = problem.world_size, problem.devices_per_node
    shards = problem.space.zero_shards
    if shards is None:
        shards = (0, dpn) if problem.zero_stage == 3 and world > dpn and world % dpn == 0 else (0,)
    t_cost = t_solve = 0.0
    best: tuple | None = None
    for shard in shards:
        t0 = time.perf_counter()
        cands = build_candidates(problem, shard)
        t_cost += time.perf_counter() - t0
        t1 = time.perf_counter()
        firsts: list[Solution] = []
        ranked = solve_k_best(cands, problem.budget, alternatives + 1, host_limit=host_limit(problem),
                              per_mesh=firsts) if cands else []
        t_solve += time.perf_counter() - t1
        if best is None or (ranked and (not best[1] or ranked[0].time_s < best[1][0].time_s)):
            best = (shard, ranked, cands, firsts)
    _, ranked, cands, firsts = best
    if not ranked:
        if not cands:
            raise AutospError(f"no strategy in {', '.join(problem.space.strategies or ())} can run "
                              f"{problem.graph.model_name} on {world} devices at {problem.seq_len} tokens; allow "
                              "more strategies or SP degrees")
        raise AutospError(infeasible_hint(problem))
    sol = ranked[0]
    solver = Solver(status=sol.status, candidates=len(cands), solves=len(ranked), cost_s=t_cost, solve_s=t_solve,
                    variables=len(cands) + sum(len(o) for c in cands for o in c.options.values()))
    return _to_plan(problem, sol, ranked[1:] + _other_tp_degrees(ranked, firsts), {c.key: c for c in cands}, solver)


def _other_tp_degrees(ranked: list[Solution], firsts: list[Solution]) -> list[Solution]:
    """The best plan at each TP degree none of the runner-ups has (what TP 2 or 1 would do at best)."""
    seen = {s.mesh.tp_degree for s in ranked}
    best: dict[int, Solution] = {}
    for s in firsts:
        t = s.mesh.tp_degree
        if t not in seen and (t not in best or s.time_s < best[t].time_s):
            best[t] = s
    return sorted(best.values(), key=lambda s: s.time_s)


def _runner_up(problem: Problem, sol: Solution, cand: Candidate) -> RunnerUp:
    g = problem.graph
    mesh: MeshChoice = sol.mesh
    opts = {fp: {o.key: o for o in os} for fp, os in cand.options.items()}
    exposed = cand.base_exposed_s + sum(opts[fp][key].exposed_s for fp, key in sol.choice.items())
    copies = sum(opts[fp][key].copy_exposed_s for fp, key in sol.choice.items())
    host = cand.base_host_bytes + sum(opts[fp][key].host_bytes for fp, key in sol.choice.items())
    peak = problem.profile.peak_flops(g.dtype)
    flops = g.total_flops(problem.seq_len) / (mesh.sp_degree * mesh.tp_degree)
    return RunnerUp(mesh=mesh, layers=tuple(RunnerUpLayer(fp, g.layer_classes[fp].module_type, choice)
                                            for fp, choice in sol.choice.items()),
                    total_s=sol.time_s, peak_bytes=sol.mem_bytes, exposed_comm_s=exposed, exposed_copy_s=copies,
                    host_bytes=host, compute_s=sol.time_s - exposed - copies,
                    mfu=flops / (sol.time_s * peak) if peak else 0.0)


def _to_plan(problem: Problem, sol: Solution, alts: list[Solution], cands: dict, solver: Solver) -> Plan:
    g, prof, seq_len = problem.graph, problem.profile, problem.seq_len
    sp, tp = sol.mesh.sp_degree, sol.mesh.tp_degree
    main = _runner_up(problem, sol, cands[sol.mesh])
    mesh = SPMesh(sp, sol.mesh.layout, max(1, problem.devices_per_node // tp))
    layers = []
    for fp, lc in g.layer_classes.items():
        choice: LayerChoice = sol.choice[fp]
        strat = resolve(choice.strategy)
        u, r = strat.grid(mesh)
        chosen = next(o for o in cands[sol.mesh].options[fp] if o.key == choice)
        layers.append(LayerPlan(lc.module_type, fp, lc.count, choice, ulysses_degree=u, ring_degree=r,
                                overlap=strat.overlap, exposed_comm_s=chosen.sp_exposed_s))
    states = model_states(g, problem.world_size // tp, problem.zero_stage, sol.mesh.zero_shard, tp)
    on_host = states["optimizer"] if sol.mesh.host_optimizer else 0.0
    states["optimizer"] -= on_host      # stepped on the host: its states hold no device memory
    saved_by = _what_each_saves(cands, sol)
    if on_host:                         # they left every device constraint (ilp.py)
        saved_by["optimizer on the host"] = on_host
    host_budget = host_limit(problem) if prof.host_memory_bytes else 0.0
    predicted = Predicted(
        total_s=sol.time_s, compute_s=main.compute_s, exposed_comm_s=main.exposed_comm_s,
        **_exposed_by(cands[sol.mesh], sol),
        # offload: host memory per rank its layers' saved tensors (and optimizer states, when
        # stepped there) take, and the copies' exposed time
        host_bytes=main.host_bytes, exposed_copy_s=main.exposed_copy_s,
        host_optimizer_bytes=cands[sol.mesh].base_host_bytes,
        host_optimizer_step_s=host_optimizer_step(prof, on_host, dtype_bytes(g.dtype)) if on_host else 0.0,
        memory=Memory(**states, activations=sol.mem_bytes - sum(states.values()), peak=sol.mem_bytes),
        peak_bytes=sol.mem_bytes, tokens_per_s_per_device=g.batch_size * seq_len / (sp * tp) / sol.time_s,
        mfu=main.mfu,
        saved_by=tuple(saved_by.items()),
        # what bounds the context: the captured step's largest tensors at its peak, per rank,
        # before checkpointing and tiling (the decisions above shrink some of them)
        largest_live=tuple(LiveTensor(**{**t, "shape": tuple(t["shape"])})
                           for t in largest_live(at_sp_degree(g, sp), seq_len / sp, full=seq_len)),
        bound_by=_bound_by(g, cands[sol.mesh], sol, main.host_bytes, host_budget),
        compiler=problem.compiler, runtime_reserved_bytes=problem.runtime_reserved_bytes,
        documents=problem.documents)
    return Plan(model=g.model_name, fingerprint=model_fingerprint(g), seq_len=seq_len, batch_size=g.batch_size,
                dtype=g.dtype, world_size=problem.world_size, devices_per_node=problem.devices_per_node,
                dp_degree=problem.world_size // (sp * tp), mesh=sol.mesh, layers=tuple(layers), predicted=predicted,
                profile=prof.name, memory_limit_bytes=problem.memory_limit, memory_margin=problem.memory_margin,
                alternatives=tuple(_runner_up(problem, a, cands[a.mesh]) for a in alts), solver=solver)


def _exposed_by(cand: Candidate, sol: Solution) -> dict[str, float]:
    """The plan's exposed communication by axis: TP's collectives, the layers' SP collectives, and
    the rest (the gradient reduction over SP x DP, ZeRO's gathers)."""
    opts = {fp: {o.key: o for o in os} for fp, os in cand.options.items()}
    chosen = [opts[fp][key] for fp, key in sol.choice.items()]
    return {"exposed_tp_s": cand.base_tp_exposed_s + sum(o.tp_exposed_s for o in chosen),
            "exposed_sp_s": sum(o.sp_exposed_s for o in chosen)}


def _bound_by(g: OpGraph, cand: Candidate, sol: Solution, host: float, budget: float) -> BoundBy:
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
    return BoundBy(phase=where, bytes=phases[key], host_bytes=host, host_budget=budget)


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
