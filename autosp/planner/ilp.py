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
                                                     (per-device peak memory at the loss)
  sum_g P_{g,c,f} x_g + sum_{g,c',o} M_{g,c',o} y_{g,c',o} + sum_{g,o in O_{g,c}} E_{g,c,o,f} y_{g,c,o} <= M_max
                                        for all c, f (... and during the backward of a layer of
                                                     class c, in its phase f: its MLP, the rest)

Objective
  minimise  sum_g T0_g x_g + sum_{g,c,o} T_{g,c,o} y_{g,c,o}

where T0_g / M0_g are the time / memory outside the layers (embedding, head,
loss, gradient reduction, parameters and optimizer states) and T_{g,c,o} /
M_{g,c,o} the time / activation memory of all ``count_c`` layers of class c.
What lies outside the layers depends on their strategy where DP/ZeRO communication hides
behind their compute (longer kernels hide more), so T0_g is the first strategy s_0's and
each option carries its class's share of the difference:
  T_{g,c,o} = (count_c / L) (T_layers(s) + recompute(k) + T_out(s) - T_out(s_0))
(L layers in all): a plan whose layers all take one strategy costs exactly what
:func:`autosp.costmodel.predict.predict` says for it; mixed strategies mix it linearly.
During one layer's backward the other layers hold what their options keep (M), and
that layer its recomputed activations: P_{g,c,f} is the rest of the memory then, and
E_{g,c,o,f} what option o of that one layer holds beyond its share of M (its whole
recompute under checkpointing, one chunk of a tiled MLP, its strategy's workspace); the
phases f include those of the class's first layer, where E also removes the other layers' share
of M — see :func:`autosp.costmodel.memory.peak_terms`.
M_max is the memory limit less the planner's margin, M_max = (1 - m) x limit with m = 5% by
default (:data:`autosp.planner.search.MEMORY_MARGIN`, the memory model's validated tolerance),
so that a plan predicted to fit still fits where the model is a few percent low.
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
    sp_exposed_s: float = 0.0  # of it, the layers' own SP collectives (the rest: DP beside them)
    # phase -> bytes that one layer of this option holds during its own backward beyond mem_bytes / count
    own_bytes: dict[str, float] = field(default_factory=dict)


@dataclass
class Candidate:
    key: Hashable              # the mesh g
    base_time_s: float
    base_mem_bytes: float
    base_exposed_s: float = 0.0
    options: dict[Hashable, list[Option]] = field(default_factory=dict)   # class -> options
    # (class, phase) -> memory outside the options while a layer of that class runs its backward
    phase_mem_bytes: dict[tuple[Hashable, str], float] = field(default_factory=dict)


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
    for terms in _phase_terms(cands, x, y).values():
        m.Add(sum(terms) <= _mem_kib(memory_limit))
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
        sol.mem_bytes = peak_bytes(g, sol.choice)
        out.append(sol)
        m.Add(sum(chosen) <= len(chosen) - 1)          # no-good cut: never this assignment again
    return out


def _phase_terms(cands: list[Candidate], x: dict, y: dict) -> dict[tuple, list]:
    """The left-hand sides of the per-(class, phase) memory constraints, as integer terms (a mesh
    without that phase adds nothing: its own constraints bound it)."""
    out: dict[tuple, list] = {}
    for g in cands:
        for key, base in g.phase_mem_bytes.items():
            cls, phase = key
            terms = out.setdefault(key, [])
            terms.append(_mem_kib(base) * x[g.key])
            for c, opts in g.options.items():
                for o in opts:
                    extra = o.own_bytes.get(phase, 0.0) if c == cls else 0.0
                    terms.append(_mem_kib(o.mem_bytes + extra) * y[(g.key, c, o.key)][0])
    return out


def peak_bytes(g: Candidate, choice: dict[Hashable, Hashable]) -> float:
    """Predicted peak memory of an assignment on mesh g: the largest of its memory constraints."""
    opts = {c: next(o for o in g.options[c] if o.key == k) for c, k in choice.items()}
    shared = sum(o.mem_bytes for o in opts.values())
    peaks = [g.base_mem_bytes + shared]
    for (cls, phase), base in g.phase_mem_bytes.items():
        peaks.append(base + shared + opts[cls].own_bytes.get(phase, 0.0))
    return max(peaks)


def _fits(g: Candidate, choice: dict[Hashable, Hashable], memory_limit: float) -> bool:
    opts = {c: next(o for o in g.options[c] if o.key == k) for c, k in choice.items()}
    shared = [_mem_kib(o.mem_bytes) for o in opts.values()]
    if _mem_kib(g.base_mem_bytes) + sum(shared) > _mem_kib(memory_limit):
        return False
    for (cls, phase), base in g.phase_mem_bytes.items():
        lhs = _mem_kib(base) + sum(_mem_kib(o.mem_bytes + (o.own_bytes.get(phase, 0.0) if c == cls else 0.0))
                                   for c, o in opts.items())
        if lhs > _mem_kib(memory_limit):
            return False
    return True


def enumerate_all(cands: list[Candidate], memory_limit: float | None = None) -> list[Solution]:
    """Every complete assignment with its cost: the brute force the tests check the ILP against
    (exponential in layer classes; the planner never calls it)."""
    out = []
    for g in cands:
        classes = list(g.options)
        for combo in itertools.product(*(g.options[c] for c in classes)):
            t = g.base_time_s + sum(o.time_s for o in combo)
            choice = {c: o.key for c, o in zip(classes, combo)}
            if memory_limit is None or _fits(g, choice, memory_limit):
                out.append(Solution(g.key, choice, t, peak_bytes(g, choice), "enumerated"))
    return sorted(out, key=lambda s: s.time_s)


def integer_objective(cands: list[Candidate], sol: Solution) -> int:
    """The ILP's own (integer) objective of a solution: what brute force must match."""
    g = next(c for c in cands if c.key == sol.mesh)
    total = _time_us(g.base_time_s)
    for c, ok in sol.choice.items():
        total += next(_time_us(o.time_s) for o in g.options[c] if o.key == ok)
    return total
