"""The operator surface (``jobs.ops``) sits on top of the engine and apart from it.

Read from the source with ``ast`` (nothing imported): the engine never imports
``jobs.ops`` (at any level: in functions and under ``TYPE_CHECKING`` too), except
the entry points Django itself looks for; the site's hook registry (``jobs.hooks``)
is engine-level; ``jobs.ops`` has no import circle; its modules and functions stay
small enough to read at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[3] / "jobs"
OPS = "jobs.ops"
# Where Django looks (admin autodiscovery, include("jobs.urls"), {% load jobs_console %},
# manage.py commands): each only hands over to jobs.ops.
ENTRY_POINTS = {
    "jobs.admin",
    "jobs.urls",
    "jobs.templatetags.jobs_console",
    "jobs.management.commands.jobs_limits",
    "jobs.management.commands.jobs_redrive",
}
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def _name(path: Path) -> str:
    parts = path.relative_to(JOBS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(JOBS.rglob("*.py")) if "migrations" not in p.parts}


def _imports(path: Path, *, module_level: bool) -> set[str]:
    """Full names imported (``from jobs.ops import words`` gives ``jobs.ops.words`` too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if module_level else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _is_ops(name: str) -> bool:
    return name == OPS or name.startswith(OPS + ".")


def test_boundary__the_engine_never_imports_the_operator_surface():
    found = {
        module: sorted(n for n in _imports(path, module_level=False) if _is_ops(n))
        for module, path in _modules().items()
        if not _is_ops(module) and module not in ENTRY_POINTS
    }
    assert {m: names for m, names in found.items() if names} == {}


def test_boundary__the_subject_hooks_are_engine_level():
    names = _imports(JOBS / "hooks.py", module_level=False)
    assert not [n for n in names if _is_ops(n) or n.startswith("django.contrib.admin")]


def test_boundary__no_import_circle_in_the_operator_surface():
    modules = {m: p for m, p in _modules().items() if _is_ops(m) or m in ENTRY_POINTS}
    graph = {
        m: {n for n in _imports(p, module_level=True) if n in modules and n != m}
        for m, p in modules.items()
    }

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(graph[here])
        return False

    circles = sorted(m for m in graph for n in graph[m] if reaches(n, m))
    assert circles == []


@pytest.mark.parametrize("module", sorted(m for m in _modules() if _is_ops(m) or m in ENTRY_POINTS))
def test_boundary__modules_and_functions_stay_small(module):
    path = _modules()[module]
    source = path.read_text()
    assert source.count("\n") <= MAX_MODULE_LINES
    long = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []
