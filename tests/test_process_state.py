"""Module-level mutable state is only what a custom-op boundary needs, and each piece is documented.

A custom op's kernel can reach no Python object its caller holds, so what collectives and
kernels count, cache or hand from one op to the next lives at module level. The test finds every
module-level name that a function mutates (item assignment, append/pop/update/setdefault/clear,
augmented assignment) and requires it in the "Process state" table of docs/concepts.md, which
says why it must be there; a new one fails until it is documented (or moved onto an object)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MUTATORS = {"append", "extend", "pop", "popitem", "update", "setdefault", "clear", "add", "discard", "remove",
            "insert", "__setitem__"}


def _mutated_globals(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    out = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        local = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                out |= set(node.names) & names
            target = None
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    while isinstance(t, ast.Subscript):
                        t = t.value
                        target = t
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                target = node.func.value
                while isinstance(target, ast.Subscript):
                    target = target.value
            if isinstance(target, ast.Name) and target.id in names and target.id not in local:
                out.add(target.id)
    return out


def test_module_level_state_is_documented():
    found = {f"{p.relative_to(ROOT).with_suffix('').as_posix().replace('/', '.')}.{name}"
             for p in sorted((ROOT / "autosp").rglob("*.py")) for name in _mutated_globals(p)}
    doc = (ROOT / "docs" / "concepts.md").read_text().split("## Process state", 1)[1]
    documented = {cell.strip("` ") for line in doc.splitlines() if line.startswith("| `")
                  for cell in [line.split("|")[1]]}
    assert found == documented, {"not documented": found - documented, "documented, not found": documented - found}
    assert "autosp.strategies.collectives.TALLY" in found          # the check looks at real state
