"""No function in ``ddpfab/`` longer than 60 lines (issue 41): a long loop is where the hardest
logic hides, and a long function cannot be read in one screen. The ones still longer are the
debt below, with their length: each may shrink, never grow, and leaves the list once it is 60
lines or less; a new long function fails."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddpfab"
LIMIT = 60
#: module:qualified name -> its length now (lines, decorators excluded).
DEBT: dict[str, int] = {}


def function_lengths(source: str, module: str = "<test>") -> dict[str, int]:
    """``module:Class.function`` -> its length in lines, for every function (nested ones too)."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found[f"{module}:{name}"] = child.end_lineno - child.lineno + 1
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(ast.parse(source), "")
    return found


def test_no_function_grows_past_60_lines_and_the_debt_only_shrinks():
    lengths: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lengths.update(function_lengths(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE))))
    long = {name: n for name, n in lengths.items() if n > LIMIT}
    new = {name: n for name, n in long.items() if name not in DEBT}
    grown = {name: (DEBT[name], n) for name, n in long.items() if name in DEBT and n > DEBT[name]}
    paid = sorted(name for name in DEBT if lengths.get(name, 0) <= LIMIT)
    assert not new, f"functions over {LIMIT} lines: {new}; split them into named steps"
    assert not grown, f"long functions grew (listed, now): {grown}; split them instead"
    assert not paid, f"{paid} are {LIMIT} lines or less now (or gone): take them off DEBT"


def test_the_checker_counts_methods_and_nested_functions():
    source = "class A:\n    def f(self):\n        def g():\n            pass\n        return g\n" + "x = 1\n"
    assert function_lengths(source, "m.py") == {"m.py:A.f": 4, "m.py:A.f.g": 2}
