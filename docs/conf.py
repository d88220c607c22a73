"""Sphinx configuration of the documentation site (``make docs``; strict in ``.ci/run``).

Sphinx with MyST: the pages stay Markdown files that read well on a forge and in an
editor, while Sphinx gives what the site needs and MkDocs lacks without plugins:
autodoc (the API reference from the docstrings, importing the app under Django),
directives that render the settings and the checks from the code
(``_ext/jobs_reference.py``), and ``-W`` with ``nitpicky`` turning every broken
cross-reference or link between pages into a failed build.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

# autodoc imports the app: a minimal Django project (no database is opened).
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobs_docs_settings")
import django  # noqa: E402

django.setup()

import jobs  # noqa: E402

project = "django-jobs-ledger"
author = "Permit report jobs developers"
copyright = "2025, the Permit report jobs developers"
release = version = jobs.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "jobs_reference",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "README.md"]
# Written by other sessions and listed in the navigation once they exist (index.md).
optional_docs = ["architecture"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# A link to a page or a heading that does not exist fails the strict build.
nitpicky = True
nitpick_ignore_regex = [
    # Names from Django, django-q2 and the standard library: no intersphinx offline.
    (r"py:.*", r"(django|django_q|datetime|collections|typing|pathlib|enum|types)\..*"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Self|TypeVar|Exception)"),
    (r"py:class", r"timedelta"),  # jobs.kind's schedule=, where datetime is the class
    (r"py:.*", r"(django_tasks|django_q|jobs\.models|jobs\.delivery|jobs\.engine)\..*"),
    # Annotations under TYPE_CHECKING name the app's models and aliases by their short
    # name; the models are described in the prose, not as API.
    (r"py:class", r"(Job|Attempt|Artifact|Effect|EffectEvent|Notice|Handler|StageHook|JobKind)"),
    # Type variables of the public API (a handler's own type, a kind's declared result).
    (r"py:class", r"jobs\.(api|handles)\.(H|R)"),
]
suppress_warnings = ["myst.header"]
# Quotes in settings, messages and hints are code: keep them straight.
smartquotes = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True, "undoc-members": False}

html_theme = "furo"
html_title = f"django-jobs-ledger {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
