"""A release that can be pinned: one install line on every page that installs the app, a
dated changelog entry for the version the package carries, and no made-up address."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import jobs
from tests.e2e.test_wheel import INSTALL_LINE, PYPROJECT, SUPPORTED

ROOT = Path(__file__).resolve().parents[2]
# Where a newcomer looks for how to install: each shows the one line.
INSTALL_PAGES = [
    ROOT / "README.md",
    ROOT / "packaging" / "django-jobs-ledger" / "README.md",
    ROOT / "docs" / "index.md",
    ROOT / "docs" / "app" / "quickstart.md",
]
# Every page: the app's (docs/app/), the site's (docs/), the READMEs and the changelog.
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "packaging").rglob("*.md")]
PAGES += sorted((ROOT / "docs").rglob("*.md"))
# The one line, where a page needs more extras than postgres: the same line with them added.
INSTALL_FORM = re.compile(
    r'pip install "\$JOBS_LEDGER/packaging/django-jobs-ledger\[postgres(,[a-z0-9]+)*\]"'
)


def test_install__every_install_page_shows_the_one_line():
    for page in INSTALL_PAGES:
        assert INSTALL_LINE in page.read_text(), f"{page.relative_to(ROOT)} lacks {INSTALL_LINE}"


def test_install__the_form_is_the_one_line():
    assert INSTALL_FORM.fullmatch(INSTALL_LINE)
    assert INSTALL_FORM.fullmatch(INSTALL_LINE.replace("[postgres]", "[postgres,s3]"))
    assert not INSTALL_FORM.search("pip install 'django-jobs-ledger[s3]'")


def test_install__no_page_spells_it_another_way():
    other = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if (
                "pip install" in line
                and "django-jobs-ledger" in line
                and not INSTALL_FORM.search(line)
            ):
                other.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()}")
            if "<repository>" in line:
                other.append(f"{page.relative_to(ROOT)}:{number}: a placeholder: {line.strip()}")
    assert other == []


def test_changelog__the_version_has_a_dated_entry():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+) \((.+?)\)$", changelog, re.M)
    assert first, "no release heading in CHANGELOG.md"
    assert first[1] == jobs.__version__ == "0.2.0"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", first[2]), f"not a date: {first[2]}"


def test_metadata__classifiers_and_no_made_up_urls():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert SUPPORTED == {"python": ["3.11", "3.12", "3.13"], "django": ["5.2", "6.0", "6.1"]}
    assert "urls" not in project  # the repository has no public address yet
    assert project["requires-python"] == ">=3.11"
