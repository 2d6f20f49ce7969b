r"""The planning ILP, solved with OR-Tools CP-SAT.

Sets
  G            mesh candidates g = (SP degree P_g, DP degree W/P_g, token layout,
               Ulysses x ring shape of the hybrid option)
  C            layer classes (structurally identical layers share variables, so the
               model's depth never enlarges the ILP)
  O_{g,c}      options for class c under g: (attention strategy s, checkpointing k),
               k in {none, selective, full}; strategies whose head/topology
               constraints fail under g are left out

Variables
  x_g      in {0,1}   mesh g is chosen
  y_{g,c,o} in {0,1}  class c uses option o under mesh g

Constraints
  sum_g x_g = 1                                      (one mesh)
  sum_{o in O_{g,c}} y_{g,c,o} = x_g    for all g, c (each class one option, on the chosen mesh)
  sum_g M0_g x_g + sum_{g,c,o} M_{g,c,o} y_{g,c,o} <= M_max
                                                     (per-device peak memory)

Objective
  minimise  sum_g T0_g x_g + sum_{g,c,o} T_{g,c,o} y_{g,c,o}

where T0_g / M0_g are the time / memory outside the layers (embedding, head,
loss, gradient reduction, parameters and optimizer states) and T_{g,c,o} /
M_{g,c,o} the time / activation memory of all ``count_c`` layers of class c.
Costs come from :mod:`autosp.costmodel.predict`, scaled to integers
(microseconds, KiB) because CP-SAT is an integer solver.

Runner-ups come from the solver too: after each optimum, a no-good cut
  sum_{l in L*} l <= |L*| - 1     (L* = the chosen x_g and y_{g,c,o})
excludes exactly that assignment and the model is solved again; the k-th solve
is the k-th best plan. Nothing enumerates the space (brute force lives in tests).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Hashable


@dataclass
class Option:
    key: Hashable              # e.g. ("ring", "none")
    time_s: float
    mem_bytes: float
    exposed_s: float = 0.0     # the part of time_s that is exposed communication (for reports)


@dataclass
class Candidate:
    key: Hashable              # the mesh g
    base_time_s: float
    base_mem_bytes: float
    base_exposed_s: float = 0.0
    options: dict[Hashable, list[Option]] = field(default_factory=dict)   # class -> options


@dataclass
class Solution:
    mesh: Hashable
    choice: dict[Hashable, Hashable]       # class -> option key
    time_s: float
    mem_bytes: float
    status: str


def _time_us(t: float) -> int:
    return int(round(t * 1e6))


def _mem_kib(b: float) -> int:
    return int(-(-b // 1024))


def solve(cands: list[Candidate], memory_limit: float, time_limit_s: float = 10.0) -> Solution | None:
    """Optimal plan under the memory limit, or None when nothing fits."""
    best = solve_k_best(cands, memory_limit, 1, time_limit_s)
    return best[0] if best else None


def solve_k_best(cands: list[Candidate], memory_limit: float, k: int,
                 time_limit_s: float = 10.0) -> list[Solution]:
    """The ``k`` best plans under the memory limit, best first (fewer when fewer fit)."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    x = {g.key: m.NewBoolVar(f"x{i}") for i, g in enumerate(cands)}
    y: dict[tuple, Any] = {}
    mem_terms, time_terms = [], []
    for i, g in enumerate(cands):
        time_terms.append(_time_us(g.base_time_s) * x[g.key])
        mem_terms.append(_mem_kib(g.base_mem_bytes) * x[g.key])
        for c, opts in g.options.items():
            vs = []
            for j, o in enumerate(opts):
                v = m.NewBoolVar(f"y{i}_{c}_{j}")
                y[(g.key, c, o.key)] = (v, o)
                vs.append(v)
                time_terms.append(_time_us(o.time_s) * v)
                mem_terms.append(_mem_kib(o.mem_bytes) * v)
            m.Add(sum(vs) == x[g.key])
    m.AddExactlyOne(x.values())
    m.Add(sum(mem_terms) <= _mem_kib(memory_limit))
    m.Minimize(sum(time_terms))
    out: list[Solution] = []
    for _ in range(k):
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = 2
        status = solver.Solve(m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        mesh = next(key for key, v in x.items() if solver.Value(v))
        g = next(c for c in cands if c.key == mesh)
        sol = Solution(mesh, {}, g.base_time_s, g.base_mem_bytes,
                       "optimal" if status == cp_model.OPTIMAL else "feasible")
        chosen = [x[mesh]]
        for (gk, c, ok), (v, o) in y.items():
            if gk == mesh and solver.Value(v):
                sol.choice[c] = ok
                sol.time_s += o.time_s
                sol.mem_bytes += o.mem_bytes
                chosen.append(v)
        out.append(sol)
        m.Add(sum(chosen) <= len(chosen) - 1)          # no-good cut: never this assignment again
    return out


def enumerate_all(cands: list[Candidate], memory_limit: float | None = None) -> list[Solution]:
    """Every complete assignment with its cost: the brute force the tests check the ILP against
    (exponential in layer classes; the planner never calls it)."""
    out = []
    for g in cands:
        classes = list(g.options)
        for combo in itertools.product(*(g.options[c] for c in classes)):
            t = g.base_time_s + sum(o.time_s for o in combo)
            mem = g.base_mem_bytes + sum(o.mem_bytes for o in combo)
            if memory_limit is None or _mem_kib(g.base_mem_bytes) + sum(_mem_kib(o.mem_bytes) for o in combo) \
                    <= _mem_kib(memory_limit):
                out.append(Solution(g.key, {c: o.key for c, o in zip(classes, combo)}, t, mem, "enumerated"))
    return sorted(out, key=lambda s: s.time_s)


def integer_objective(cands: list[Candidate], sol: Solution) -> int:
    """The ILP's own (integer) objective of a solution: what brute force must match."""
    g = next(c for c in cands if c.key == sol.mesh)
    total = _time_us(g.base_time_s)
    for c, ok in sol.choice.items():
        total += next(_time_us(o.time_s) for o in g.options[c] if o.key == ok)
    return total
