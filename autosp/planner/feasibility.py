"""Whether a problem has a plan that fits, and what would fit where none does.

Both answer in the space :func:`autosp.planner.search.plan` searches, with its feasibility (the
ILP's memory constraints over :func:`autosp.planner.candidates.build_candidates`' options), so a
length found to fit is one ``plan`` plans, and a change named to fit is one that does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from autosp.costmodel.offload import host_budget
from autosp.decisions import HOST_OPTIMIZERS, OFFLOADS
from autosp.planner.candidates import build_candidates
from autosp.planner.ilp import solve
from autosp.planner.problem import Problem, SearchSpace


def host_limit(problem: Problem) -> float:
    """Host memory a rank's plan may fill: the node's, shared by its ranks, less the margin."""
    return host_budget(problem.profile, problem.world_size, problem.devices_per_node, problem.memory_margin)


def fits(problem: Problem) -> bool:
    """Whether some plan of ``problem`` fits its budget (ZeRO 3 sharded over the whole mesh)."""
    cands = build_candidates(problem)
    return bool(cands) and solve(cands, problem.budget, host_limit=host_limit(problem)) is not None


def longest_fitting(fit: Callable[[int], bool], step: int, upper: int) -> int:
    """The largest multiple of ``step`` up to ``upper`` that fits (fitting is monotone in length), or 0."""
    lo, hi, best = 1, upper // step, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fit(mid * step):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best * step


def infeasible_hint(problem: Problem) -> str:
    """One line: what did not fit, and the nearest change that fits (offload or the optimizer on the
    host where they were left out, a higher ZeRO stage, more devices, a shorter sequence), each tried
    in the space the caller chose."""
    g, prof, space = problem.graph, problem.profile, problem.space
    limit, world, zero_stage, seq_len = problem.memory_limit, problem.world_size, problem.zero_stage, problem.seq_len
    size = f"{limit / 2 ** 30:.1f} GiB" if limit >= 2 ** 30 else f"{limit / 2 ** 20:.0f} MiB"
    kept = f" ({problem.memory_margin:.0%} of it kept free for the memory model's error)" if problem.memory_margin else ""
    host = "" if True in space.offloads or not prof.host_memory_bytes else ", without offload"
    stepped = "" if True in space.host_optimizers or not prof.steps_on_host else ", the optimizer on the device"
    head = (f"no plan fits {g.model_name} at {seq_len} tokens on {world} devices within {size} each{kept}, "
            f"with any checkpointing and MLP / loss tiling{host}{stepped}")
    # the hints search every choice (checkpointing, tiling, SP degree, strategy) but the host's,
    # which the caller may have left out on purpose, and say so when that is what fits
    wide = replace(problem, documents=(), space=SearchSpace(offloads=space.offloads,
                                                             host_optimizers=space.host_optimizers))

    if host and fits(wide.at(offloads=OFFLOADS)):
        return (f"{head}; offloading checkpoints to host memory fits (drop --no-offload; at the first call "
                f"autosp.Auto(offload=None))")
    if stepped and fits(wide.at(host_optimizers=HOST_OPTIMIZERS)):
        return (f"{head}; stepping the optimizer on the host fits (drop --no-host-optimizer; at the first call "
                f"autosp.Auto(host_optimizer=None))")
    for z in range(zero_stage + 1, 4):
        if fits(wide.at(zero_stage=z)):
            return f"{head} with ZeRO stage {zero_stage}; ZeRO stage {z} fits (--zero-stage {z})"
    for w in (2 ** i for i in range(0, 13)):
        if w > world and fits(wide.at(zero_stage=max(zero_stage, 3 if zero_stage else 0), world_size=w)):
            return f"{head}; the smallest power-of-two world that fits is {w} devices"
    longest = longest_fitting(lambda s: fits(wide.at(seq_len=s)), 2 * world, seq_len)
    if longest:
        return f"{head}; the longest sequence that fits is about {longest} tokens"
    return f"{head}, on up to 4096 devices or at any length; raise the memory limit or the ZeRO stage"
