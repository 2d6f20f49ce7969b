"""The per-batch schedule of SP degrees (autosp.planner.assign), on stand-in costs."""

import pytest

from autosp.errors import AutospError
from autosp.planner.assign import assign, best_static, static


def lengths_cost(lengths, per_rank_cap, price_per_rank=0.0):
    def cost(i, k):
        n = lengths[i]
        return None if n / k > per_rank_cap else n / k + price_per_rank * (k - 1)
    return cost


def test_a_long_row_takes_every_rank_and_short_ones_run_beside_each_other():
    # One row needs all 4 ranks (memory); static must then run every row on 4 ranks in turn.
    lengths = [400, 100, 100, 100, 100]
    cost = lengths_cost(lengths, per_rank_cap=100, price_per_rank=5.0)
    mixed = assign(cost, len(lengths), 4, (1, 2, 4))
    assert mixed.degrees() == [4, 1, 1, 1, 1]
    assert sorted(p.group for p in mixed.placements if p.degree == 1) == [0, 1, 2, 3]
    assert mixed.makespan_s == pytest.approx(115 + 100) and mixed.balance == pytest.approx(1.0)
    fixed = best_static(cost, len(lengths), 4, (1, 2, 4))
    assert {p.degree for p in fixed.placements} == {4}
    assert fixed.makespan_s == pytest.approx(115 + 4 * 40)
    # a rank runs its placements in start order; its group's ranks in the same order
    assert [p.sequence for p in mixed.of_rank(2)] == [0, mixed.of_rank(2)[1].sequence]


def test_static_balances_groups_heaviest_first_and_refuses_what_does_not_fit():
    cost = lengths_cost([8, 7, 6, 5], per_rank_cap=8)
    a = static(cost, 4, 2, 1)
    assert sorted(a.busy_s) == [13, 13]
    with pytest.raises(AutospError, match="does not fit at SP degree 1"):
        static(lengths_cost([20], per_rank_cap=8), 1, 2, 1)


def test_bad_degrees_and_rows_that_fit_nowhere_are_refused_by_name():
    with pytest.raises(AutospError, match=r"SP degrees \[3\] must be positive divisors of the world size 4"):
        assign(lengths_cost([1], 8), 1, 4, (3,))
    with pytest.raises(AutospError, match="sequence 0 fits at none of the SP degrees"):
        assign(lengths_cost([100], 8), 1, 4, (1, 2, 4))


def test_the_per_batch_benchmark_predicts_a_cluster_step():
    """bench/per_batch.py's prediction runs (one small step): both schedules, several degrees."""
    import pathlib
    import re
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "bench/per_batch.py", "--steps", "1", "--tokens", "524288"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    row = next(line for line in run.stdout.splitlines() if line.strip().startswith("0 "))
    assert len(re.search(r"k=\[([\d, ]+)\]", row).group(1).split(",")) >= 3, row
    assert re.search(r"speed-up \d+\.\d\dx", run.stdout), run.stdout


def test_mixed_degree_refuses_a_mesh_or_zero_sharding_it_cannot_honour():
    import torch

    import autosp

    with pytest.raises(AutospError, match="it takes no mesh or zero"):
        autosp.MixedDegree(torch.nn.Linear(2, 2), lambda row, k: 1.0, mesh=2, zero=3)
