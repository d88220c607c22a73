"""The documentation site: the settings and checks pages cover the code, and it builds strict.

The pages are rendered from the code (``docs/_ext/jobs_reference.py``); these tests fail
when a setting or a check exists in code but not on its built page, when a check returns
an id the catalogue does not know (the catalogue reads the source; the registry is what
runs), or when the strict build (``make docs``: ``-W -n``) warns.
"""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.checks.registry import registry
from django.test import override_settings

from jobs import conf

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _reference():
    spec = importlib.util.spec_from_file_location(
        "jobs_reference", DOCS / "_ext" / "jobs_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["jobs_reference"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


reference = _reference()
SPHINX = [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-W", "--keep-going", "-n", "-q"]
SOURCE_IDS = sorted(
    {
        m
        for path in (ROOT / "jobs").rglob("*.py")
        if "migrations" not in path.parts and "testing" not in path.parts
        for m in re.findall(r"""id=["'](jobs\.[CEWI]\d{3})["']""", path.read_text())
    }
)


def test_settings_page__renders_every_setting_of_jobs_conf():
    page = reference.settings_markdown()
    missing = [s.name for s in conf.SETTINGS if f"| `{s.name}` | `{s.default!r}`" not in page]
    assert missing == []
    assert "```{jobs-settings}" in (DOCS / "app" / "settings.md").read_text()


def test_checks_page__lists_every_check_id_in_the_source():
    assert len(SOURCE_IDS) >= 20, SOURCE_IDS  # the scan itself works
    catalogue = {e.id: e for e in reference.collect_checks()}
    assert sorted(catalogue) == SOURCE_IDS
    page = reference.checks_markdown()
    assert [i for i in SOURCE_IDS if f"### `{i}`" not in page] == []
    assert all(e.message and e.level in ("error", "warning", "info") for e in catalogue.values())
    text = (DOCS / "app" / "checks.md").read_text()
    assert "```{jobs-checks}" in text and "```{jobs-checks-summary}" in text


def test_checks_page__finds_a_check_wherever_it_is_defined(tmp_path):
    """A check moved to a part's own module is still listed (issue 28 may move them)."""
    part = tmp_path / "jobs" / "flowpart"
    part.mkdir(parents=True)
    (part / "checks.py").write_text(
        "from django.core import checks\n\n"
        "@checks.register()\n"
        "def check_rules(app_configs=None, **kwargs):\n"
        '    """Flow rules are seeded from settings."""\n'
        '    return [checks.Warning(f"rule {1} is odd", hint="fix it", id="jobs.W099")]\n'
    )
    [entry] = reference.collect_checks(tmp_path / "jobs")
    assert (entry.id, entry.level, entry.module, entry.function) == (
        "jobs.W099",
        "warning",
        "jobs.flowpart.checks",
        "check_rules",
    )
    assert (entry.message, entry.hint, entry.why) == (
        "rule {1} is odd",
        "fix it",
        "Flow rules are seeded from settings.",
    )


# Settings under which the registered checks return their messages (each variant
# provokes some); whatever id comes back must be in the catalogue.
CRAFTED = [
    {"Q_CLUSTER": {"orm": "default"}},
    {"Q_CLUSTER": {"orm": "default", "timeout": 1, "retry": 2}, "JOBS_LEASE_SECONDS": 5},
    {"Q_CLUSTER": {"timeout": 5, "retry": 7}},
    {"Q_CLUSTER": {"orm": "other", "timeout": 5, "retry": 7}},
    {"JOBS_ARTIFACT_STORAGE": "nowhere", "JOBS_MAX_ATTEMPTS": "five"},
    {"JOBS_TRANSACTION_IDLE_SECONDS": 100, "JOBS_LOCK_TIMEOUT_SECONDS": 100},
    {"NOTICE_PROVIDER_URL": "ftp:", "NOTICE_PROVIDER_TOKEN": "t"},
    {"NOTICE_PROVIDER_URL": "http://127.0.0.1:9", "NOTICE_PROVIDER_TOKEN": ""},
    {"NOTICE_PROVIDER_URL": "http://127.0.0.1:9", "NOTICE_PROVIDER_READ_TIMEOUT": 100},
    {"NOTICE_EMAIL_TIMEOUT": 100, "Q_CLUSTER": {"orm": "default", "timeout": 5, "retry": 7}},
]


@pytest.mark.django_db
def test_checks_page__every_id_the_registered_checks_return_is_listed():
    catalogue = {e.id for e in reference.collect_checks()}
    seen: set[str] = set()
    for overrides in CRAFTED:
        with override_settings(**overrides):
            for check in registry.get_checks(include_deployment_checks=True):
                try:
                    messages = check(app_configs=None, databases=["default"])
                except Exception:  # a crafted setting another app's check cannot read
                    continue
                seen |= {m.id for m in messages if str(m.id).startswith("jobs.")}
    assert seen - catalogue == set()
    assert len(seen) >= 12, sorted(seen)  # the crafted settings do provoke the checks


@pytest.mark.drill
@pytest.mark.slow
def test_docs_site__builds_strict_and_the_generated_pages_hold_every_setting_and_check(
    tmp_path,
):
    out = tmp_path / "html"
    done = subprocess.run(
        [*SPHINX, str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr.strip() == "", done.stderr[-4000:]
    settings_page = html.unescape((out / "app" / "settings.html").read_text())
    checks_page = html.unescape((out / "app" / "checks.html").read_text())
    assert [s.name for s in conf.SETTINGS if s.name not in settings_page] == []
    assert [i for i in SOURCE_IDS if i not in checks_page] == []
    for page in ("app/quickstart", "app/kinds", "app/artifacts", "app/effects", "app/retries"):
        assert (out / f"{page}.html").is_file(), page
    for page in ("app/flow", "app/tasks", "app/console", "app/operations", "app/deployment"):
        assert (out / f"{page}.html").is_file(), page
    api = (out / "app" / "api.html").read_text()
    assert 'id="jobs.request"' in api and 'id="jobs.JobContext"' in api  # from docstrings


def test_docs_requirements__the_same_tools_as_the_dev_extras():
    """Read the Docs installs docs/requirements.txt; make docs the root pyproject's dev extras."""
    import tomllib

    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {
        line.strip()
        for line in (DOCS / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert wanted and wanted <= set(dev["dev"]), wanted - set(dev["dev"])
