"""The module map holds: each stage imports only what README's "Layout" allows, no module outside
``autosp/strategies/`` compares strategy names, and no file grows past 400 lines without a reason."""

import ast
import pathlib

import pytest

from autosp.strategies import names

ROOT = pathlib.Path(__file__).resolve().parents[1] / "autosp"
_STAGES = ("autosp.graph", "autosp.costmodel", "autosp.planner", "autosp.transform", "autosp.strategies", "autosp.tools")
# folder (or top-level module) -> autosp subpackages/modules it may not import (prefix match on the dotted name)
FORBIDDEN = {
    "graph": ("autosp.costmodel", "autosp.planner", "autosp.transform", "autosp.strategies", "autosp.tools"),
    "strategies": ("autosp.costmodel", "autosp.planner", "autosp.transform", "autosp.tools"),
    "costmodel": ("autosp.planner", "autosp.transform", "autosp.tools"),
    "planner": ("autosp.transform", "autosp.tools"),
    "transform": ("autosp.planner.search", "autosp.planner.ilp", "autosp.costmodel", "autosp.tools"),
    # leaves every stage may import: the typed decisions, the option groups, the step timers
    "decisions.py": _STAGES,
    "options.py": _STAGES,
    "timing.py": _STAGES,
}


def _modules():
    return sorted(p for p in ROOT.rglob("*.py"))


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):                  # function-level imports count too
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_stage_imports(path):
    folder = path.relative_to(ROOT).parts[0]
    bad = [m for m in _imports(ast.parse(path.read_text())) for f in FORBIDDEN.get(folder, ()) if m.startswith(f)]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def _compared_strings(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for c in ast.walk(side):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        out.add(c.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith"):
            out |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def test_no_strategy_names_compared_outside_the_strategies():
    specs = {n.split(":")[0].split("[")[0] for n in names()} | set(names())
    offenders = {}
    for path in _modules():
        if path.relative_to(ROOT).parts[0] == "strategies":
            continue
        hits = _compared_strings(ast.parse(path.read_text())) & specs
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, offenders
    assert {"ulysses", "ring", "hybrid"} <= specs        # the check looks for real names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_short_or_say_why(path):
    lines = path.read_text().splitlines()
    if len(lines) > 400:
        assert any("over 400 lines" in ln.lower() for ln in lines[:20]), f"{path} has {len(lines)} lines"


def _module_name(path: pathlib.Path) -> str:
    parts = ("autosp",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circles():
    """No module of the package imports one that imports it back, however far round (function-level
    imports count: a circle hidden in a function is still a circle in the design)."""
    import networkx as nx

    names = {_module_name(p): p for p in _modules()}
    graph = nx.DiGraph()
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in names and t != name)
    circles = sorted(nx.simple_cycles(graph), key=len)
    assert not circles, f"{len(circles)} import circles, e.g. {' -> '.join(circles[0] + circles[0][:1])}"


def test_predictions_are_read_as_typed_fields():
    """A plan's prediction is a frozen dataclass: nothing in the package reads it by string key."""
    offenders = [str(p.relative_to(ROOT)) for p in _modules()
                 if any(s in p.read_text() for s in ('predicted["', "predicted['", "predicted.get("))]
    assert not offenders, offenders


def test_the_planning_entry_points_take_the_problem():
    """``plan`` and ``max_seq_len`` take the one planning problem (and at most 3 other parameters)."""
    import inspect

    from autosp.planner.longest import max_seq_len
    from autosp.planner.search import plan

    for fn in (plan, max_seq_len):
        params = list(inspect.signature(fn).parameters)
        assert params[0] == "problem" and len(params) <= 4, (fn.__name__, params)
