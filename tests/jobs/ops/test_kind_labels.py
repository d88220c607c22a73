"""A kind names its jobs in its project's words (``labels=``); the app's own words are neutral.

The console, the admin's tags and the job page's follow answer say a labelled kind's words
for its jobs and the neutral ones for every other kind; the permit site keeps its report's
words ("Ready", "Could not be built") through its kind's labels, not the app's tables.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

import jobs
from jobs import registry
from jobs.models import EFFECT_STATES, JOB_STATES, Job
from jobs.ops import words
from tests.jobs.helpers import request_job

PERMIT_WORDS = ("report", "reviewer", "permit", "notice", "office", "applicant")
PERMIT_WORD = re.compile(
    r"\b(permits?|reports?|reviewers?|notices?|offices?|applicants?|inspections?)\b", re.I
)


def _labelled(ctx):
    return []


@pytest.fixture
def invoice_kind():
    kind = registry.register_kind(
        "test.invoice",
        _labelled,
        labels={"job": "invoice", "effect": "receipt", "succeeded": "Sent", "dead": "Given up"},
    )
    yield kind
    registry._kinds.pop("test.invoice", None)


def test_kind_labels__the_keys_are_the_nouns_and_the_engines_job_states():
    assert list(registry.LABEL_STATES) == JOB_STATES
    assert ("job", "result", "effect", *JOB_STATES) == registry.LABEL_KEYS


@pytest.mark.parametrize(
    ("labels", "says"),
    [
        ({"succeded": "Sent"}, "'succeded' is not a label key"),
        ({"job": ""}, "labels['job'] must be a word"),
        ({"succeeded": 3}, "labels['succeeded'] must be a word"),
        (["job"], "labels must be a dict"),
    ],
)
def test_kind_labels__refused_at_registration__naming_the_key(labels, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        jobs.kind("test.badly-labelled", labels=labels)(_labelled)
    assert "test.badly-labelled" not in registry.kinds()


def test_kind_labels__the_apps_own_words_name_nothing_of_the_site():
    said = " ".join(
        [w.word for w in words.JOB_STATE_WORDS.values()]
        + [w.word for w in words.EFFECT_STATE_WORDS.values()]
    ).lower()
    assert list(words.JOB_STATE_WORDS) == JOB_STATES
    assert list(words.EFFECT_STATE_WORDS) == EFFECT_STATES
    assert not [w for w in PERMIT_WORDS if w in said], said


def test_kind_labels__a_labelled_kinds_state_and_nouns__others_neutral(invoice_kind):
    assert words.job_state_word("succeeded", "test.invoice") == words.StateWord("Sent", "ready")
    assert words.job_state_word("dead", "test.invoice").word == "Given up"
    assert words.job_state_word("failed", "test.invoice").word == "Failed"  # not labelled
    assert words.job_state_word("succeeded", "test.short").word == "Done"
    assert words.job_state_word("succeeded").word == "Done"
    assert words.kind_noun("test.invoice", "effect") == "receipt"
    assert words.kind_noun("test.invoice", "result") == "result"
    assert words.kind_noun("no.such-kind", "job") == "job"
    assert "Sent" in words.state_tag("succeeded", kind="test.invoice")
    assert "· succeeded" in words.state_tag("succeeded", kind="test.invoice")


@pytest.mark.django_db
def test_kind_labels__the_admin_and_the_follow_answer_say_the_kinds_words(client, invoice_kind):
    operator = get_user_model().objects.create_superuser("labels-operator", password="x")
    client.force_login(operator)
    invoice, _ = request_job("test.invoice", subject_type="auth.user", subject_id=1)
    plain, _ = request_job("test.short", subject_type="auth.user", subject_id=2)
    Job.objects.filter(pk__in=[invoice.pk, plain.pk]).update(state=Job.State.SUCCEEDED)
    listing = client.get("/admin/jobs/job/").content.decode()
    assert 'jobs-tone--ready">Sent <span class="jobs-state__engine">· succeeded<' in listing
    assert 'jobs-tone--ready">Done <span class="jobs-state__engine">· succeeded<' in listing
    page = client.get(f"/admin/jobs/job/{invoice.pk}/change/").content.decode()
    assert 'jobs-tone--ready">Sent <span' in page
    assert client.get(f"/admin/jobs/job/{invoice.pk}/follow/").json()["state_word"] == "Sent"
    assert client.get(f"/admin/jobs/job/{plain.pk}/follow/").json()["state_word"] == "Done"


def test_kind_labels__the_permit_report_keeps_its_words_through_the_hook():
    from permits import reports

    labels = registry.get_kind(reports.KIND).labels
    assert labels == reports.LABELS
    assert words.job_state_word("succeeded", reports.KIND).word == "Ready"
    assert words.job_state_word("failed", reports.KIND).word == "Could not be built"
    assert words.kind_noun(reports.KIND, "effect") == "notice"


def test_kind_labels__the_apps_templates_and_printed_words_hold_no_permit_word():
    """The source side of the same promise: the shipped templates, scripts and the words
    the ops modules print (string literals) name nothing of the permit site."""
    import ast

    root = Path(__file__).resolve().parents[3] / "jobs"
    hits = []
    for path in [*root.glob("templates/**/*.html"), *root.glob("templates/**/*.txt")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PERMIT_WORD.search(re.sub(r"{#.*?#}", "", line)):
                hits.append(f"{path.relative_to(root)}:{n}: {line.strip()[:100]}")
    for path in (root / "ops").glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and PERMIT_WORD.search(node.value)
            ):
                hits.append(f"ops/{path.name}:{node.lineno}: {node.value[:100]!r}")
    assert hits == [], "\n".join(hits)
