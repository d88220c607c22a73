"""The settings and system-check pages, generated from the code so they cannot drift.

- Settings: ``jobs.conf.SETTINGS`` (name, default, what it is for), the one table the
  app reads them from.
- Checks: every ``Error``/``Warning``/``Info``/``Critical`` built with an ``id="jobs.…"``
  anywhere in the ``jobs`` package, found by reading the source (``ast``), with its
  message, hint and the docstring of the function that returns it. Reading the source
  rather than a hand-kept list survives a check moving to another module (a part's own
  ``checks.py``), and it sees checks that only fire under settings a docs build does not
  have. ``tests/docs/test_reference.py`` also runs the registered checks under crafted
  settings and fails if one returns an id this catalogue does not list.

The directives ``jobs-settings`` and ``jobs-checks`` put the tables into
``docs/app/settings.md`` and ``docs/app/checks.md``.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

LEVELS = {"Critical": "critical", "Error": "error", "Warning": "warning", "Info": "info"}
JOBS = Path(__file__).resolve().parents[2] / "jobs"


@dataclass(frozen=True)
class CheckEntry:
    id: str
    level: str
    message: str
    hint: str
    module: str
    function: str
    why: str


def _text(node: ast.AST | None) -> str:
    """A message as written, with ``{name}`` where the code puts a value in."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return "{" + ast.unparse(node) + "}"


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return " ".join(textwrap.dedent(doc).strip().split("\n\n", 1)[0].split())


def collect_checks(package: Path = JOBS) -> list[CheckEntry]:
    """Every check message with a ``jobs.*`` id in the package's source, sorted by id."""
    found: dict[str, CheckEntry] = {}
    for path in sorted(package.rglob("*.py")):
        if "migrations" in path.parts or "testing" in path.relative_to(package).parts[:1]:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        module = ".".join(("jobs", *path.relative_to(package).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name not in LEVELS:
                continue
            ids = [k.value for k in node.keywords if k.arg == "id"]
            if not ids or not isinstance(ids[0], ast.Constant):
                continue
            check_id = str(ids[0].value)
            if not check_id.startswith("jobs."):
                continue
            hint = next((k.value for k in node.keywords if k.arg == "hint"), None)
            owner = min(
                (f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or 0)),
                key=lambda f: (f.end_lineno or 0) - f.lineno,
                default=None,
            )
            entry = CheckEntry(
                id=check_id,
                level=LEVELS[name],
                message=_text(node.args[0] if node.args else None),
                hint=_text(hint),
                module=module,
                function=owner.name if owner else "",
                why=_first_paragraph(ast.get_docstring(owner) if owner else None),
            )
            if check_id in found:  # one id, several messages (E002's variants): keep both
                old = found[check_id]
                entry = CheckEntry(
                    **{**old.__dict__, "message": f"{old.message} · {entry.message}"}
                )
            found[check_id] = entry
    return sorted(found.values(), key=lambda e: e.id)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: object) -> str:
    return f"`{value!r}`"


def settings_markdown() -> str:
    """The settings table: every entry of ``jobs.conf.SETTINGS``, in its order."""
    from jobs import conf

    rows = ["| setting | default | what it is for |", "|---|---|---|"]
    for s in conf.SETTINGS:
        rows.append(f"| `{s.name}` | {_code(s.default)} | {_cell(s.doc)} |")
    return "\n".join(rows) + "\n"


def checks_markdown() -> str:
    """One section per check id: level, message, hint, where it lives and why."""
    out = []
    for e in collect_checks():
        out.append(f"### `{e.id}` ({e.level})\n")
        out.append(f"**Message:** ``{_cell(e.message)}``\n")
        if e.hint:
            out.append(f"**Hint:** {_cell(e.hint)}\n")
        if e.why:
            out.append(f"{_cell(e.why)}\n")
        out.append(f"*Defined in* `{e.module}.{e.function}`.\n")
    return "\n".join(out)


def checks_summary_markdown() -> str:
    """A compact table of all ids (for the top of the checks page)."""
    rows = ["| id | level | message |", "|---|---|---|"]
    for e in collect_checks():
        rows.append(f"| [`{e.id}`](#{_anchor(e)}) | {e.level} | ``{_cell(e.message)}`` |")
    return "\n".join(rows) + "\n"


def _anchor(e: CheckEntry) -> str:
    # MyST's heading slug of "### `jobs.E001` (error)"
    return f"{e.id.replace('.', '')}-{e.level}".lower()


def setup(app):  # pragma: no cover - run by Sphinx
    from sphinx.util.docutils import SphinxDirective

    class _Generated(SphinxDirective):
        has_content = False
        render = staticmethod(settings_markdown)

        def run(self):
            return self.parse_text_to_nodes(self.render(), allow_section_headings=True)

    class JobsSettings(_Generated):
        render = staticmethod(settings_markdown)

    class JobsChecks(_Generated):
        render = staticmethod(checks_markdown)

    class JobsChecksSummary(_Generated):
        render = staticmethod(checks_summary_markdown)

    def drop_missing_optional(app, docname, source):
        """Navigation entries for pages other sessions write appear once the page exists."""
        if docname != app.config.root_doc:
            return
        srcdir = Path(app.srcdir)
        for name in app.config.optional_docs:
            if not (srcdir / f"{name}.md").exists():
                source[0] = "\n".join(
                    line for line in source[0].splitlines() if line.strip() != name
                )

    app.add_config_value("optional_docs", [], "env")
    app.add_directive("jobs-settings", JobsSettings)
    app.add_directive("jobs-checks", JobsChecks)
    app.add_directive("jobs-checks-summary", JobsChecksSummary)
    app.connect("source-read", drop_missing_optional)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
