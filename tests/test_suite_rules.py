"""The suite's own rules (docs/development.md, "The rules"): a slow test says in its docstring what it
shows that a shorter test cannot, so the next person who wants the suite faster knows what a cut would
lose. Tests over 60 s that are not marked slow are listed at the end of every run (conftest.py)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def marked_slow(node: ast.expr) -> bool:
    """``pytest.mark.slow`` as a decorator or ``pytestmark``, or on one case (``pytest.param(marks=)``)."""
    return "mark.slow" in ast.unparse(node)


def slow_tests(tree: ast.Module) -> list[ast.FunctionDef]:
    module_slow = any(
        isinstance(node, ast.Assign)
        and any(getattr(target, "id", None) == "pytestmark" for target in node.targets)
        and marked_slow(node.value)
        for node in tree.body
    )
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test_")
        and (module_slow or any(marked_slow(d) for d in node.decorator_list))
    ]


def test_every_slow_test_says_why_it_is_long() -> None:
    found, undocumented = 0, []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in slow_tests(ast.parse(path.read_text())):
            found += 1
            if not ast.get_docstring(node):
                undocumented.append(f"{path.name}:{node.lineno} {node.name}")
    assert found >= 20, found  # the scan sees the slow tests (docs/development.md describes them)
    listing = "\n".join(undocumented)
    assert not undocumented, f"slow tests without a docstring saying what they show:\n{listing}"
