"""``autosp.plan``: build the ILP's candidates from the cost model, solve, explain.

Candidates are meshes (SP degree x token layout x hybrid shape); under each, every
layer class may take any feasible (strategy, checkpointing) option. The time and
memory of each option come from :func:`autosp.costmodel.predict.predict`; the
ILP (:mod:`autosp.planner.ilp`) picks the cheapest combination that fits.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from autosp.costmodel.predict import _ev, predict
from autosp.costmodel.profile import HardwareProfile, load_profile
from autosp.errors import AutospError
from autosp.planner.capture import capture
from autosp.planner.ilp import Candidate, Option, enumerate_all, solve
from autosp.planner.plan import Plan, model_fingerprint

CHECKPOINTS = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _heads(graph) -> tuple[int, int]:
    for _, a in graph.nodes(phase="fwd"):
        if a["in_shapes"]:
            return int(_ev(a["in_shapes"][0][1], graph.seq_len)), int(_ev(a["in_shapes"][1][1], graph.seq_len))
    raise AutospError(f"model '{graph.model_name}' has no attention op to parallelise")


def _layer_memory(graph, s_loc: float) -> dict[str, dict[str, float]]:
    """Per layer class: saved activation bytes of one layer under each checkpointing choice."""
    from autosp.costmodel.flops import OpKind

    out = {}
    emb = next((a for _, a in graph.nodes(phase="fwd") if a["kind"] == OpKind.EMBEDDING), None)
    hidden_bytes = _ev(emb["bytes_written"], s_loc) if emb else 0.0
    for fp, lc in graph.layer_classes.items():
        rep = lc.captured[0]
        saved = sel = 0.0
        for _, a in graph.nodes(phase="fwd", layer=rep):
            b = _ev(a["bytes_saved"], s_loc)
            saved += b
            if a["kind"] in (OpKind.MATMUL, OpKind.ATTENTION):
                sel += b
        out[fp] = {"none": saved, "selective": max(sel, hidden_bytes), "full": min(hidden_bytes, saved)}
    return out


def build_candidates(graph, prof: HardwareProfile, world: int, dpn: int, zero_stage: int,
                     seq_len: int, sp_degrees: tuple[int, ...] | None = None,
                     checkpoints: tuple[str, ...] = CHECKPOINTS) -> tuple[list[Candidate], dict]:
    n_heads, n_kv = _heads(graph)
    cands: list[Candidate] = []
    preds: dict = {}
    total_layers = sum(lc.count for lc in graph.layer_classes.values())
    for sp in _divisors(world):
        if sp_degrees is not None and sp not in sp_degrees:
            continue
        dp = world // sp
        for layout in ("contiguous", "zigzag") if sp > 1 else ("contiguous",):
            chunks = 2 * sp if layout == "zigzag" else sp
            if seq_len % chunks:
                continue
            hybrids = [u for u in _divisors(sp) if 1 < u < sp and u <= dpn and n_heads % u == 0] if sp > 1 else []
            for u in [None] + hybrids:
                strategies = []
                if sp == 1:
                    strategies = ["ulysses"]
                else:
                    if u is None:
                        if n_heads % sp == 0 and (sp <= dpn or True):
                            strategies.append("ulysses")
                        strategies += ["zigzag_ring" if layout == "zigzag" else "ring", "allgather_kv"]
                    else:
                        strategies = [f"hybrid:{u}x{sp // u}"]
                if not strategies:
                    continue
                mem = _layer_memory(graph, seq_len / sp)
                ps = {st: predict(graph, prof, sp=sp, strategy=st, layout=layout, seq_len=seq_len, dp=dp,
                                  zero_stage=zero_stage, ulysses_degree=u) for st in strategies}
                first = ps[strategies[0]]
                layer_time = {st: p.details["layer_compute_s"] + p.details.get("attention_exposed_s", 0.0)
                              for st, p in ps.items()}
                saved_total = sum(mem[fp]["none"] * lc.count for fp, lc in graph.layer_classes.items())
                key = (sp, layout, u)
                cand = Candidate(key=key, base_time_s=first.total_s - layer_time[strategies[0]],
                                 base_mem_bytes=first.peak_bytes - saved_total)
                for i, (fp, lc) in enumerate(graph.layer_classes.items()):
                    share = lc.count / total_layers
                    opts = []
                    for st, p in ps.items():
                        workspace_delta = p.peak_bytes - first.peak_bytes if i == 0 else 0.0
                        recompute = {"none": 0.0,
                                     "selective": p.details["layer_forward_pointwise_s"],
                                     "full": p.details["layer_forward_s"] + p.details["attention_fwd_s"]}
                        for k in checkpoints:
                            opts.append(Option(key=(st, k), time_s=share * (layer_time[st] + recompute[k]),
                                               mem_bytes=lc.count * mem[fp][k] + workspace_delta))
                    cand.options[fp] = opts
                cands.append(cand)
                preds[key] = ps
    return cands, preds


def plan(model: Any, *, seq_len: int, batch_size: int = 1, world_size: int = 1, devices_per_node: int | None = None,
         profile: str | HardwareProfile = "h100-sxm", memory_limit: float | None = None, zero_stage: int = 0,
         dtype: str = "bfloat16", graph: Any = None, alternatives: int = 5,
         sp_degrees: tuple[int, ...] | None = None, checkpoints: tuple[str, ...] = CHECKPOINTS) -> Plan:
    """Plan SP for ``model`` on ``world_size`` devices; see :mod:`autosp.planner.ilp` for the ILP."""
    if world_size < 1:
        raise AutospError(f"world size must be at least 1, got {world_size}")
    if zero_stage not in (0, 1, 2, 3):
        raise AutospError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    dpn = devices_per_node or prof.devices_per_node
    limit = memory_limit or prof.memory_bytes
    g = graph if graph is not None else capture(model, seq_len=seq_len, batch_size=batch_size, dtype=dtype)
    if limit == float("inf"):
        limit = float(2 ** 60)           # "no limit": the ILP still needs an (int64-sized) number
    t0 = time.perf_counter()
    cands, preds = build_candidates(g, prof, world_size, dpn, zero_stage, seq_len, sp_degrees, checkpoints)
    t_cost = time.perf_counter() - t0
    t1 = time.perf_counter()
    sol = solve(cands, limit)
    t_solve = time.perf_counter() - t1
    if sol is None:
        raise AutospError(_infeasible_hint(g, prof, world_size, dpn, zero_stage, seq_len, limit))
    ranked = enumerate_all(cands, limit)
    alts = [s for s in ranked if (s.mesh, s.choice) != (sol.mesh, sol.choice)][:alternatives]
    return _to_plan(g, prof, sol, alts, preds, world_size, dpn, limit, zero_stage, seq_len,
                    {"status": sol.status, "candidates": len(cands), "cost_s": t_cost, "solve_s": t_solve,
                     "variables": len(cands) + sum(len(o) for c in cands for o in c.options.values())})


def _summary(g, sol, preds) -> dict[str, Any]:
    sp, layout, u = sol.mesh
    st = next(iter(sol.choice.values()))[0]
    p = preds[sol.mesh][st]
    flops = g.total_flops(p.seq_len) / sp
    return {"sp": sp, "layout": layout, "ulysses_degree": u or (sp if st == "ulysses" else 1),
            "layers": {fp: {"strategy": s, "checkpoint": k} for fp, (s, k) in sol.choice.items()},
            "total_s": sol.time_s, "peak_bytes": sol.mem_bytes,
            "exposed_comm_s": p.exposed_comm_s, "compute_s": sol.time_s - p.exposed_comm_s,
            "mfu": flops / (sol.time_s * (p.model_flops / (p.total_s * p.mfu) if p.mfu else 1)) if p.mfu else 0.0}


def _to_plan(g, prof, sol, alts, preds, world, dpn, limit, zero_stage, seq_len, solver) -> Plan:
    sp, layout, u = sol.mesh
    main = _summary(g, sol, preds)
    st = next(iter(sol.choice.values()))[0]
    p = preds[sol.mesh][st]
    ring = sp // u if u else (1 if st == "ulysses" else sp)
    uly = u if u else (sp if st == "ulysses" else 1)
    layers = [{"class": lc.module_type, "fingerprint": fp, "count": lc.count,
               "strategy": sol.choice[fp][0], "checkpoint": sol.choice[fp][1]}
              for fp, lc in g.layer_classes.items()]
    base = {k: p.memory[k] for k in ("parameters", "optimizer", "gradients", "workspace")}
    # What the chosen checkpointing leaves of activations (the rest of the peak).
    memory = {**base, "activations": sol.mem_bytes - sum(base.values()), "peak": sol.mem_bytes}
    predicted = {"compute_s": main["compute_s"], "exposed_comm_s": p.exposed_comm_s, "total_s": sol.time_s,
                 "memory": memory, "peak_bytes": sol.mem_bytes,
                 "tokens_per_s_per_device": g.batch_size * seq_len / sp / sol.time_s, "mfu": main["mfu"]}
    return Plan(model=g.model_name, fingerprint=model_fingerprint(g), seq_len=seq_len, batch_size=g.batch_size,
                dtype=g.dtype, world_size=world, devices_per_node=dpn, sp_degree=sp, dp_degree=world // sp,
                ulysses_degree=uly, ring_degree=ring, layout=layout, layers=layers, predicted=predicted,
                profile=prof.name, memory_limit_bytes=limit, zero_stage=zero_stage,
                alternatives=[_summary(g, a, preds) for a in alts], solver=solver)


def _fits(g, prof, world, dpn, zero_stage, seq_len, limit) -> bool:
    cands, _ = build_candidates(g, prof, world, dpn, zero_stage, seq_len)
    return bool(cands) and solve(cands, limit) is not None


def _infeasible_hint(g, prof, world, dpn, zero_stage, seq_len, limit) -> str:
    gib = limit / 2 ** 30
    head = f"no plan fits {g.model_name} at {seq_len} tokens on {world} devices within {gib:.1f} GiB each"
    for z in range(zero_stage + 1, 4):
        if _fits(g, prof, world, dpn, z, seq_len, limit):
            return f"{head} with ZeRO stage {zero_stage}; ZeRO stage {z} fits (--zero-stage {z})"
    for w in (2 ** i for i in range(0, 13)):
        if w > world and _fits(g, prof, w, dpn, max(zero_stage, 3 if zero_stage else 0), seq_len, limit):
            return f"{head}; the smallest power-of-two world that fits is {w} devices"
    longest = 0
    lo, hi = 1, seq_len          # the longest sequence (a multiple of 2 x world) that fits here
    step = 2 * world
    while lo <= hi:
        mid = (lo + hi) // 2
        s = mid * step // step * step
        if s and _fits(g, prof, world, dpn, zero_stage, s, limit):
            longest, lo = s, mid + 1
        else:
            hi = mid - 1
        if hi - lo < step:
            break
    if longest:
        return f"{head}; the longest sequence that fits is about {longest} tokens"
    return f"{head}, on up to 4096 devices or at any length; raise the memory limit or the ZeRO stage"


def max_seq_len(model: Any, *, world_size: int, batch_size: int = 1, devices_per_node: int | None = None,
                profile: str | HardwareProfile = "h100-sxm", memory_limit: float | None = None, zero_stage: int = 0,
                dtype: str = "bfloat16", graph: Any = None, upper: int = 1 << 24) -> tuple[int, Plan]:
    """The longest sequence (a multiple of 2 x world size) with a plan that fits, and that plan."""
    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    dpn = devices_per_node or prof.devices_per_node
    limit = memory_limit or prof.memory_bytes
    step = 2 * world_size
    g = graph if graph is not None else capture(model, seq_len=step * 64, batch_size=batch_size, dtype=dtype)
    lo, hi, best = 1, upper // step, 0          # in units of `step`; sizes are symbolic: no re-capture
    with warnings.catch_warnings():             # probes far beyond any answer extrapolate tables
        warnings.simplefilter("ignore")
        while lo <= hi:
            mid = (lo + hi) // 2
            if _fits(g, prof, world_size, dpn, zero_stage, mid * step, limit):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
    if not best:
        raise AutospError(_infeasible_hint(g, prof, world_size, dpn, zero_stage, step, limit))
    s = best * step
    return s, plan(model, seq_len=s, batch_size=batch_size, world_size=world_size, devices_per_node=dpn,
                   profile=prof, memory_limit=limit, zero_stage=zero_stage, dtype=dtype, graph=g)
