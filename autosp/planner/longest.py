"""The longest sequence a world fits, with the plan for it.

It searches the problem's space with :func:`autosp.planner.search.plan`'s feasibility
(:mod:`autosp.planner.feasibility`), so a length found to fit is one ``plan`` plans, and one
step longer is refused.
"""

from __future__ import annotations

import warnings

from autosp.errors import AutospError
from autosp.planner.feasibility import fits, infeasible_hint, longest_fitting
from autosp.planner.plan import Plan
from autosp.planner.problem import Problem
from autosp.planner.search import plan


def max_seq_len(problem: Problem, *, upper: int = 1 << 26) -> tuple[int, Plan]:
    """The longest sequence (a multiple of 2 x world size, up to ``upper``) with a plan of
    ``problem`` that fits, and that plan; ``problem.seq_len`` is not read (give
    ``Problem.of(model, world_size=...)`` without one)."""
    step = 2 * problem.world_size
    with warnings.catch_warnings():             # probes far beyond any answer extrapolate tables
        warnings.simplefilter("ignore")         # sizes are symbolic: no re-capture per probe
        s = longest_fitting(lambda s: fits(problem.at(seq_len=s)), step, upper)
    if not s:
        raise AutospError(infeasible_hint(problem.at(seq_len=step)))
    return s, plan(problem.at(seq_len=s))
