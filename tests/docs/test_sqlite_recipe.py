"""One SQLite recipe: the options ``jobs.W015``'s hint prints are the options
docs/app/deployment.md tells a project to add, and adding them silences the check."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobs import checks

DEPLOYMENT = Path(__file__).resolve().parents[2] / "docs" / "app" / "deployment.md"


def _documented_options() -> dict:
    section = DEPLOYMENT.read_text().split("## SQLite (one machine)", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)
    scope: dict = {"DATABASES": {"default": {}}}
    exec(code, scope)  # the page's snippet, as a settings.py would run it
    return scope["DATABASES"]["default"]["OPTIONS"]


def _check_on_sqlite(monkeypatch, options: dict) -> list:
    conn = SimpleNamespace(
        vendor="sqlite", settings_dict={"NAME": "db.sqlite3", "OPTIONS": options}
    )
    monkeypatch.setattr(checks, "connections", {"default": conn})
    monkeypatch.setattr(checks.router, "db_for_write", lambda model, **hints: "default")
    return checks.check_sqlite()


def _hinted_options(warning) -> dict:
    literal = re.search(r"\['OPTIONS'\] = (\{.*\})", warning.hint, re.S)
    assert literal, warning.hint
    return ast.literal_eval(literal.group(1))


def test_sqlite_recipe__the_check_hints_what_the_deployment_page_says(monkeypatch):
    [warning] = _check_on_sqlite(monkeypatch, {})
    assert warning.id == "jobs.W015"
    assert _hinted_options(warning) == _documented_options()


@pytest.mark.parametrize("source", ["page", "hint"])
def test_sqlite_recipe__following_it_silences_the_check(monkeypatch, source):
    if source == "page":
        options = _documented_options()
    else:
        options = _hinted_options(_check_on_sqlite(monkeypatch, {})[0])
    assert _check_on_sqlite(monkeypatch, options) == []
