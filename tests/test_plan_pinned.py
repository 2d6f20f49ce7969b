"""The plans of three fixed problems, pinned: a change to how a plan is made or carried (the
planning problem, the plan's typed prediction) leaves its decisions and predictions as they were.

The JSON under ``tests/data/plans/`` was written by the planner before the planning problem became
one frozen value (schema 3: read back through :meth:`Plan.from_dict`'s upgrade); the solver's
timings (``solver``) are left out, everything else must match.
A change that is meant to alter plans rewrites them with ``python tests/test_plan_pinned.py``
and says why in its commit.
"""

import json
import math
import pathlib
import sys

import pytest

from autosp.planner.plan import Plan
from autosp.planner.problem import Problem
from autosp.planner.search import plan

DATA = pathlib.Path(__file__).parent / "data" / "plans"
CASES = {
    "llama3-8b": dict(model="llama3-8b", seq_len=131072, world_size=8, profile="h100-sxm", zero_stage=3),
    "llama3-70b": dict(model="llama3-70b", seq_len=131072, world_size=64, devices_per_node=8, profile="h100-sxm",
                       zero_stage=3),
    # a budget that binds: full checkpointing, tiled MLP and loss
    "tiny": dict(model="tiny", seq_len=4096, world_size=2, profile="cpu-gloo", memory_limit=64 * 2 ** 20,
                 dtype="float32", offloads=(False,), host_optimizers=(False,), compiler="aot_eager"),
}


def _planned(name: str) -> dict:
    kw = dict(CASES[name])
    out = json.loads(plan(Problem.of(kw.pop("model"), **kw)).to_json())
    out["solver"] = None
    return out


def _same(a, b, path="plan"):
    """Equal, floats to 1e-12 relative (JSON round trips them exactly; the tolerance is for sums
    taken in another order)."""
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12), f"{path}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert sorted(a) == sorted(b), f"{path}: keys {sorted(set(a) ^ set(b))} differ"
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} entries != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_is_as_pinned(name):
    pinned = Plan.from_dict(json.loads((DATA / f"{name}.json").read_text()))
    _same(_planned(name), json.loads(pinned.to_json()))


if __name__ == "__main__":      # rewrite the pins (a change meant to alter plans)
    for name in sys.argv[1:] or CASES:
        (DATA / f"{name}.json").write_text(json.dumps(_planned(name), indent=1, sort_keys=True))
