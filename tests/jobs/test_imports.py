"""The engine's import graph, read from the source with ``ast`` (nothing is imported).

(a) No engine module imports drill or test code (``jobs.testing``, ``jobs.contrib``,
    ``django.test``, ``tests``), at any level: a project that installs the app gets
    none of it unless it asks.
(b) Module-level imports among the engine's modules form no cycle, so every module
    can be imported first (a cycle works only in some orders, and breaks on a reorder).
    Imports inside functions and under ``if TYPE_CHECKING:`` are not module-level.
(c) Nor do all imports together, those inside functions and for type checking
    included: a function-level import that closes a circle is a circle postponed, and
    shared types live below both sides (``jobs.engine.plan``). ``from jobs.engine
    import plan`` is an arrow to the submodule; the root ``jobs`` package is a lazy
    facade (``jobs.__getattr__``) and no arrow ends there.
"""

from __future__ import annotations

import ast
from pathlib import Path

JOBS = Path(__file__).resolve().parents[2] / "jobs"
NOT_ENGINE = ("jobs.testing", "jobs.contrib")
FORBIDDEN = ("jobs.testing", "jobs.contrib", "django.test", "tests")


def _module_name(path: Path) -> str:
    parts = path.relative_to(JOBS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def engine_modules() -> dict[str, Path]:
    found = {_module_name(p): p for p in sorted(JOBS.rglob("*.py"))}
    return {name: path for name, path in found.items() if not _within(name, NOT_ENGINE)}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Full names a statement imports: ``from jobs import a`` gives ``jobs.a``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def imports(path: Path, *, module_level: bool, module: str | None = None) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    module, is_package = module or _module_name(path), path.name == "__init__.py"
    if not module_level:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        return {name for node in nodes for name in _imported(node, module, is_package)}
    names: set[str] = set()

    def visit(statements) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(_imported(node, module, is_package))
            elif isinstance(node, ast.If):
                visit(node.orelse if _is_type_checking(node) else node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return names


def graph(*, module_level: bool = True) -> dict[str, set[str]]:
    modules = engine_modules()
    edges = {}
    for name, path in modules.items():
        found = {i for i in imports(path, module_level=module_level) if i in modules}
        # ``from pkg import sub`` names ``pkg`` too: the submodule is the arrow.
        found = {i for i in found if not any(j.startswith(i + ".") for j in found)}
        edges[name] = found - {name, "jobs"}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_imports__engine_imports_no_drill_or_test_code():
    bad = {
        name: sorted(i for i in imports(path, module_level=False) if _within(i, FORBIDDEN))
        for name, path in engine_modules().items()
    }
    assert {n: i for n, i in bad.items() if i} == {}


def test_imports__engine_module_graph_has_no_cycle():
    edges = graph()
    assert len(edges) > 30, sorted(edges)  # the walk found the engine
    assert "jobs.delivery.publish" in edges["jobs.delivery.runner"]  # and reads imports
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_imports__no_cycle_even_through_function_level_and_type_checking_imports():
    edges = graph(module_level=False)
    assert "jobs.delivery.runner" in edges["jobs.api"]  # a TYPE_CHECKING import is read
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_imports__the_checker_finds_a_cycle_and_a_forbidden_import(tmp_path):
    """The two checks above can fail: fed a cycle and a test import, they say so."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import jobs.ledger\n"
        "if TYPE_CHECKING:\n    from jobs import runner\n"
        "def f():\n    from django.test.utils import override_settings\n"
    )
    top = imports(src, module_level=True, module="m")
    assert "jobs.ledger" in top
    assert "jobs.runner" not in top
    assert "django.test.utils" not in top
    assert "django.test.utils" in imports(src, module_level=False, module="m")
