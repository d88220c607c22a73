"""One SQLite recipe: the options ``jobs.W015``'s hint prints are the options
docs/app/deployment.md tells a project to add, the quickstart's SQLite section shows and
this repository's site uses on SQLite; adding them silences the check."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobs import checks

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = ROOT / "docs" / "app" / "deployment.md"
QUICKSTART = ROOT / "docs" / "app" / "quickstart.md"


def _documented_options(page: Path = DEPLOYMENT, heading: str = "## SQLite (one machine)") -> dict:
    section = page.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
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


def test_sqlite_recipe__the_quickstart_and_the_site_use_the_same_options():
    from permits import settings as site_settings

    recipe = _documented_options()
    assert recipe["timeout"] == 20 and "busy_timeout=20000" in recipe["init_command"]
    quickstart = _documented_options(QUICKSTART, "## Optional: SQLite instead of PostgreSQL")
    assert quickstart == recipe
    # The site's SQLite settings (permits/settings.py, DATABASE_URL unset): the same options.
    source = Path(site_settings.__file__).read_text()
    sqlite_branch = source.split('"ENGINE": "django.db.backends.sqlite3"', 1)[1]
    for option in ('"transaction_mode": "IMMEDIATE"', '"timeout": 20'):
        assert option in sqlite_branch, option
    init = recipe["init_command"]
    assert init in sqlite_branch, init
