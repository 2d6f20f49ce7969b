"""Per-batch SP degrees: which ranks run each sequence of a global batch.

A global batch holds sequences of different lengths and document mixes. One static plan runs
every sequence at one SP degree ``k`` (the degree the longest needs), ``world / k`` groups in
data parallel; a group that draws the heavy sequences finishes last and the others wait. Here
each sequence gets its own degree and group, from the cost model.

Groups are aligned blocks: degree ``k`` has groups ``g = 0 .. world/k - 1`` of ranks
``g*k .. g*k + k - 1``, formed once at start. Given ``t(i, k)`` (seconds sequence ``i`` takes at
degree ``k``; ``None`` where it does not fit in memory):

    k_i         argmin_k  k * t(i, k)        the degree spending the fewest rank-seconds on i
    schedule    widest k_i first, then longest t: i on the group g of degree k_i whose ranks are
                free first; start_i = max_{r in g} busy_r, busy_r = start_i + t(i, k_i) for r in g
    makespan    max_i start_i + t(i, k_i)
    improve     while it shortens the makespan: give the sequence that ends last a wider degree
                and schedule again

The first step minimises the rank-seconds spent (their sum over the world bounds the makespan
from below); the last spreads a sequence that alone would hold the step up over more ranks.

Every rank runs its placements in start-time order; ranks of a group meet each collective in
the same order, so mixed groups never wait on each other in a cycle. Gradients of all
sequences are summed over the world once per step (each rank's partial sums of its groups),
so the step equals one process on the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from autosp.errors import AutospError

Cost = Callable[[int, int], "float | None"]


@dataclass(frozen=True)
class Placement:
    sequence: int        # index in the global batch
    degree: int          # SP degree it runs at
    group: int           # which aligned group of that degree: ranks group*degree ..
    start_s: float       # predicted start and duration within the step
    time_s: float

    @property
    def ranks(self) -> range:
        return range(self.group * self.degree, (self.group + 1) * self.degree)


@dataclass
class Assignment:
    world: int
    placements: list[Placement] = field(default_factory=list)

    @property
    def busy_s(self) -> list[float]:
        busy = [0.0] * self.world
        for p in self.placements:
            for r in p.ranks:
                busy[r] += p.time_s
        return busy

    @property
    def makespan_s(self) -> float:
        return max((p.start_s + p.time_s for p in self.placements), default=0.0)

    @property
    def balance(self) -> float:
        """Busiest rank's time over the mean rank's (1.0: even)."""
        busy = self.busy_s
        mean = sum(busy) / len(busy)
        return max(busy) / mean if mean else 1.0

    def of_rank(self, rank: int) -> list[Placement]:
        """What ``rank`` runs, in the order it runs it (every rank orders by start, then sequence)."""
        return sorted((p for p in self.placements if rank in p.ranks), key=lambda p: (p.start_s, p.sequence))

    def degrees(self) -> list[int]:
        """Per sequence, its SP degree."""
        return [p.degree for p in sorted(self.placements, key=lambda p: p.sequence)]


def _check(world: int, degrees: Sequence[int]) -> list[int]:
    bad = [k for k in degrees if k < 1 or world % k]
    if bad or not degrees:
        raise AutospError(f"SP degrees {list(degrees)} must be positive divisors of the world size {world}")
    return sorted(set(degrees))


def _fits(cost: Cost, i: int, degrees: list[int]) -> list[tuple[int, float]]:
    options = [(k, t) for k in degrees if (t := cost(i, k)) is not None]
    if not options:
        raise AutospError(f"sequence {i} fits at none of the SP degrees {degrees}; allow a larger degree or "
                          "split the sequence (autosp.data.pack(..., split_long=True))")
    return options


def assign(cost: Cost, n: int, world: int, degrees: Sequence[int], rounds: int = 64) -> Assignment:
    """Each of ``n`` sequences at its own degree and group (module docstring)."""
    degrees = _check(world, degrees)
    options = {i: dict(_fits(cost, i, degrees)) for i in range(n)}
    # the degree that spends the fewest rank-seconds on each sequence
    chosen = {i: min(opts, key=lambda k: (k * opts[k], k)) for i, opts in options.items()}
    best = _list_schedule(options, chosen, world)
    for _ in range(rounds):     # widen the sequence that ends last while that shortens the step
        last = max(best.placements, key=lambda p: (p.start_s + p.time_s, -p.sequence))
        wider = [k for k in options[last.sequence] if k > last.degree]
        trials = [_list_schedule(options, {**chosen, last.sequence: k}, world) for k in wider]
        better = min(trials, key=lambda a: a.makespan_s, default=None)
        if better is None or better.makespan_s >= best.makespan_s - 1e-12:
            break
        best, chosen = better, {p.sequence: p.degree for p in better.placements}
    return best


def _list_schedule(options: dict[int, dict[int, float]], chosen: dict[int, int], world: int) -> Assignment:
    """Widest first, then longest: each sequence on the group of its degree that is free first."""
    busy = [0.0] * world
    out = Assignment(world)
    for i in sorted(options, key=lambda i: (-chosen[i], -options[i][chosen[i]], i)):
        k, t = chosen[i], options[i][chosen[i]]
        g = min(range(world // k), key=lambda g: (max(busy[g * k:(g + 1) * k]), g))
        p = Placement(i, k, g, max(busy[g * k:(g + 1) * k]), t)
        for r in p.ranks:
            busy[r] = p.start_s + t
        out.placements.append(p)
    return out


def static(cost: Cost, n: int, world: int, degree: int) -> Assignment:
    """Every sequence at one ``degree``, the ``world / degree`` groups in data parallel (heaviest
    sequence to the least busy group: the best a static plan's data loader can do)."""
    _check(world, [degree])
    out = Assignment(world)
    busy = [0.0] * (world // degree)
    times = {}
    for i in range(n):
        t = cost(i, degree)
        if t is None:
            raise AutospError(f"sequence {i} does not fit at SP degree {degree}")
        times[i] = t
    for i in sorted(range(n), key=lambda i: (-times[i], i)):
        g = min(range(len(busy)), key=lambda g: (busy[g], g))
        out.placements.append(Placement(i, degree, g, busy[g], times[i]))
        busy[g] += times[i]
    return out


def best_static(cost: Cost, n: int, world: int, degrees: Sequence[int]) -> Assignment:
    """The fastest single degree that fits every sequence."""
    best = None
    for k in _check(world, degrees):
        if all(cost(i, k) is not None for i in range(n)):
            a = static(cost, n, world, k)
            if best is None or a.makespan_s < best.makespan_s:
                best = a
    if best is None:
        raise AutospError(f"no single SP degree of {list(degrees)} fits every sequence")
    return best
