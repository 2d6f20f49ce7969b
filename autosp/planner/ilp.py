r"""The planning ILP, solved with OR-Tools CP-SAT.

Sets
  G            mesh candidates g = (TP degree t_g, SP degree P_g, DP degree W/(t_g P_g), token
               layout, Ulysses x ring shape of the hybrid option); t_g within a node, dividing
               the heads (TP's costs: :mod:`autosp.costmodel.tensor_parallel`)
  C            layer classes (structurally identical layers share variables, so the
               model's depth never enlarges the ILP)
  O_{g,c}      options for class c under g: (attention strategy s, checkpointing k, MLP chunks n,
               MLP input kept i, offload f), k in {none, selective, full}, i, f in {0, 1}
               (i = 0 only with k = full and n > 1); n in {1, 8, 32} and, where larger,
               ALST's ceil(tokens per rank / hidden size); strategies whose head/topology
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
  sum_g H0_g x_g + sum_{g,c,o} H_{g,c,o} y_{g,c,o} <= H_max
                                                     (host memory per rank: optimizer states stepped
                                                     there, what offloaded layers keep)

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
of M — see :func:`autosp.costmodel.phases.peak_terms`.
Under full checkpointing a tiled MLP either recomputes as a region of its own (i = 1: M counts its
input too, E in its MLP phase one chunk) or with its whole layer (i = 0: M the layer's input alone,
E in its MLP phase the layer's recomputed tensors beside the chunk); T is the same.
An offloaded option (f = 1) keeps its layers' saved bytes in host memory: H = count_c x kept, and
on the device M = kept (the one layer whose copy is in flight), its own backward phases holding its
kept bytes again (E + kept); its T adds the copies' exposed time, per layer
max(0, copy - forward) + max(0, copy - backward), copy = kept / host link bandwidth.
H_max is the node's host memory shared by its ranks, less the same margin.
A mesh candidate may step the optimizer on the host (its MeshChoice's ``host_optimizer``): then its
optimizer states (fp32 moments, and fp32 master weights for low-precision parameters, the rank's
ZeRO share) leave every device constant M0_g and P_{g,c,f} for H0_g, and T0_g adds the step on the
host and the copies of gradients down and parameters up (:func:`autosp.costmodel.offload.host_optimizer_step`).
M_max is the memory limit less the planner's margin, M_max = (1 - m) x limit with m = 5% by
default (:data:`autosp.planner.search.MEMORY_MARGIN`, the memory model's validated tolerance),
so that a plan predicted to fit still fits where the model is a few percent low.
Costs come from :mod:`autosp.costmodel.predict`, scaled to integers
(microseconds, KiB) because CP-SAT is an integer solver.

Runner-ups come from the solver too (per mesh, see :func:`solve_k_best`): after each optimum, a no-good cut
  sum_{l in L*} l <= |L*| - 1     (L* = the chosen x_g and y_{g,c,o})
excludes exactly that assignment and the model is solved again; the k-th solve
is the k-th best plan. Nothing enumerates the space (brute force lives in tests).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Hashable


@dataclass
class Option:
    key: Hashable              # e.g. ("ring", "none")
    time_s: float
    mem_bytes: float
    exposed_s: float = 0.0     # the part of time_s that is exposed communication (for reports)
    sp_exposed_s: float = 0.0  # of it, the layers' own SP collectives (the rest: DP beside them)
    tp_exposed_s: float = 0.0  # ... and their TP collectives
    # phase -> bytes that one layer of this option holds during its own backward beyond mem_bytes / count
    own_bytes: dict[str, float] = field(default_factory=dict)
    host_bytes: float = 0.0    # host memory its layers' offloaded saved tensors take, per rank
    copy_exposed_s: float = 0.0   # the part of time_s that is exposed device <-> host copying


@dataclass
class Candidate:
    key: Hashable              # the mesh g
    base_time_s: float
    base_mem_bytes: float
    base_exposed_s: float = 0.0
    base_host_bytes: float = 0.0   # host memory the mesh's own decisions take per rank (optimizer states)
    base_tp_exposed_s: float = 0.0  # of base_exposed_s, the TP collectives outside the layers (head, loss)
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


def solve(cands: list[Candidate], memory_limit: float, time_limit_s: float = 10.0,
          host_limit: float = 0.0) -> Solution | None:
    """Optimal plan under the memory limit, or None when nothing fits."""
    best = solve_k_best(cands, memory_limit, 1, time_limit_s, host_limit)
    return best[0] if best else None


def solve_k_best(cands: list[Candidate], memory_limit: float, k: int,
                 time_limit_s: float = 10.0, host_limit: float = 0.0,
                 per_mesh: list[Solution] | None = None) -> list[Solution]:
    """The ``k`` best plans under the memory limit (and ``host_limit`` bytes of host memory per rank
    for offloaded layers), best first (fewer when fewer fit); ``per_mesh``, where given, receives
    each mesh's best plan (what the other meshes would do at best).

    Exactly one mesh is chosen, so the ILP splits into one model per mesh (x_g = 1): the optimum is
    the best of their optima, and the next best plan is the next of a merge in which only the model
    whose plan was taken is solved again, with its no-good cut. Small models solve in milliseconds;
    one model over every mesh took seconds per re-solve."""
    import heapq

    models = [_MeshModel(prune(g), memory_limit, host_limit) for g in cands]
    heap = []
    for i, mm in enumerate(models):
        sol = mm.next(time_limit_s)
        if sol is not None:
            heap.append((mm.objective, i, sol))
            if per_mesh is not None:
                per_mesh.append(sol)
    heapq.heapify(heap)
    out: list[Solution] = []
    while heap and len(out) < k:
        _, i, sol = heapq.heappop(heap)
        out.append(sol)
        nxt = models[i].next(time_limit_s)
        if nxt is not None:
            heapq.heappush(heap, (models[i].objective, i, nxt))
    return out


class _MeshModel:
    """The ILP restricted to one mesh g (x_g = 1), solved again after each of its plans is taken."""

    def __init__(self, g: Candidate, memory_limit: float, host_limit: float):
        from ortools.sat.python import cp_model

        self.g, self.m, self.y = g, cp_model.CpModel(), {}
        m, limit = self.m, _mem_kib(memory_limit)
        time_terms, mem_terms, host_terms = [], [_mem_kib(g.base_mem_bytes)], [_mem_kib(g.base_host_bytes)]
        phases = {key: [_mem_kib(base)] for key, base in g.phase_mem_bytes.items()}
        for c, opts in g.options.items():
            vs = []
            for j, o in enumerate(opts):
                v = m.NewBoolVar(f"y_{c}_{j}")
                self.y[(c, o.key)] = (v, o)
                vs.append(v)
                time_terms.append(_time_us(o.time_s) * v)
                mem_terms.append(_mem_kib(o.mem_bytes) * v)
                if o.host_bytes:
                    host_terms.append(_mem_kib(o.host_bytes) * v)
                for (cls, phase), terms in phases.items():
                    extra = o.own_bytes.get(phase, 0.0) if c == cls else 0.0
                    terms.append(_mem_kib(o.mem_bytes + extra) * v)
            m.AddExactlyOne(vs)
        m.Add(sum(mem_terms) <= limit)
        if len(host_terms) > 1 or g.base_host_bytes:
            m.Add(sum(host_terms) <= _mem_kib(host_limit))
        for terms in phases.values():
            m.Add(sum(terms) <= limit)
        m.Minimize(sum(time_terms))
        self.objective = 0

    def next(self, time_limit_s: float) -> Solution | None:
        """This mesh's best plan not yet taken, or None."""
        from ortools.sat.python import cp_model

        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = 1        # a small model: one thread solves it fastest
        status = solver.Solve(self.m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        g = self.g
        sol = Solution(g.key, {}, g.base_time_s, g.base_mem_bytes,
                       "optimal" if status == cp_model.OPTIMAL else "feasible")
        chosen = []
        self.objective = _time_us(g.base_time_s)
        for (c, ok), (v, o) in self.y.items():
            if solver.Value(v):
                sol.choice[c] = ok
                sol.time_s += o.time_s
                self.objective += _time_us(o.time_s)
                chosen.append(v)
        sol.mem_bytes = peak_bytes(g, sol.choice)
        self.m.Add(sum(chosen) <= len(chosen) - 1)          # no-good cut: never this assignment again
        return sol


def _dominates(a: Option, b: Option) -> bool:
    """``a`` is no slower than ``b`` and holds no more memory in any constraint: b never needs choosing."""
    return (a.time_s <= b.time_s and a.mem_bytes <= b.mem_bytes and a.host_bytes <= b.host_bytes
            and a.own_bytes.keys() == b.own_bytes.keys()
            and all(a.own_bytes[ph] <= b.own_bytes[ph] for ph in a.own_bytes))


def prune(g: Candidate) -> Candidate:
    """g without the options another option of the same class dominates (ties: the first kept): the
    optimum is unchanged, and the solver's runner-ups are plans not strictly worse on every count."""
    kept: dict[Hashable, list[Option]] = {}
    for c, opts in g.options.items():
        kept[c] = [o for i, o in enumerate(opts)
                   if not any(_dominates(p, o) and (not _dominates(o, p) or j < i) for j, p in enumerate(opts) if j != i)]
    return replace(g, options=kept)


def phase_bytes(g: Candidate, choice: dict[Hashable, Hashable]) -> dict[Hashable, float]:
    """Predicted memory of an assignment on mesh g per memory constraint: ``"loss"`` and each
    (class, phase) of a layer's backward."""
    opts = {c: next(o for o in g.options[c] if o.key == k) for c, k in choice.items()}
    shared = sum(o.mem_bytes for o in opts.values())
    out: dict[Hashable, float] = {"loss": g.base_mem_bytes + shared}
    for (cls, phase), base in g.phase_mem_bytes.items():
        out[(cls, phase)] = base + shared + opts[cls].own_bytes.get(phase, 0.0)
    return out


def peak_bytes(g: Candidate, choice: dict[Hashable, Hashable]) -> float:
    """Predicted peak memory of an assignment on mesh g: the largest of its memory constraints."""
    return max(phase_bytes(g, choice).values())


def _fits(g: Candidate, choice: dict[Hashable, Hashable], memory_limit: float, host_limit: float = 0.0) -> bool:
    opts = {c: next(o for o in g.options[c] if o.key == k) for c, k in choice.items()}
    host = _mem_kib(g.base_host_bytes) + sum(_mem_kib(o.host_bytes) for o in opts.values() if o.host_bytes)
    if host > _mem_kib(host_limit):
        return False
    shared = [_mem_kib(o.mem_bytes) for o in opts.values()]
    if _mem_kib(g.base_mem_bytes) + sum(shared) > _mem_kib(memory_limit):
        return False
    for (cls, phase), base in g.phase_mem_bytes.items():
        lhs = _mem_kib(base) + sum(_mem_kib(o.mem_bytes + (o.own_bytes.get(phase, 0.0) if c == cls else 0.0))
                                   for c, o in opts.items())
        if lhs > _mem_kib(memory_limit):
            return False
    return True


def enumerate_all(cands: list[Candidate], memory_limit: float | None = None,
                  host_limit: float = 0.0) -> list[Solution]:
    """Every complete assignment with its cost: the brute force the tests check the ILP against
    (exponential in layer classes; the planner never calls it)."""
    out = []
    for g in cands:
        classes = list(g.options)
        for combo in itertools.product(*(g.options[c] for c in classes)):
            t = g.base_time_s + sum(o.time_s for o in combo)
            choice = {c: o.key for c, o in zip(classes, combo)}
            if memory_limit is None or _fits(g, choice, memory_limit, host_limit):
                out.append(Solution(g.key, choice, t, peak_bytes(g, choice), "enumerated"))
    return sorted(out, key=lambda s: s.time_s)


def integer_objective(cands: list[Candidate], sol: Solution) -> int:
    """The ILP's own (integer) objective of a solution: what brute force must match."""
    g = next(c for c in cands if c.key == sol.mesh)
    total = _time_us(g.base_time_s)
    for c, ok in sol.choice.items():
        total += next(_time_us(o.time_s) for o in g.options[c] if o.key == ok)
    return total
