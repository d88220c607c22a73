"""What a site tells the jobs app about its subjects: how to name them and find their jobs.

The app knows nothing of the site's subjects (``jobs`` never imports the site). A
site registers each subject type once, e.g. in its ``admin.py`` or ``AppConfig.ready``::

    from jobs.hooks import register_subject

    register_subject("permits.permit", labels=permit_labels, search=permit_search)

so the operator screens (``jobs.ops``) label a job by its permit reference and
searching the jobs list for that reference finds its jobs. Engine-level: this module
imports nothing from ``jobs.ops``; the operator screens read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobs.models import Job


@dataclass(frozen=True)
class SubjectHooks:
    """How operator screens show and search one subject type (set by the site, not the app)."""

    labels: Callable[[list[str]], dict[str, str]]  # subject ids -> human labels
    search: Callable[[str], Iterable[object]]  # search term -> matching subject ids


SUBJECTS: dict[str, SubjectHooks] = {}


def register_subject(
    subject_type: str,
    *,
    labels: Callable[[list[str]], dict[str, str]],
    search: Callable[[str], Iterable[object]],
) -> None:
    """Let the jobs admin label ``subject_type`` subjects and find their jobs by those labels."""
    SUBJECTS[subject_type] = SubjectHooks(labels, search)


def subject_labels(jobs: Iterable[Job]) -> dict[tuple[str, str], str]:
    """Labels for the jobs' subjects, one query per subject type present."""
    wanted: dict[str, set[str]] = {}
    for job in jobs:
        if job.subject_type in SUBJECTS:
            wanted.setdefault(job.subject_type, set()).add(job.subject_id)
    found = {}
    for subject_type, ids in wanted.items():
        for subject_id, label in SUBJECTS[subject_type].labels(sorted(ids)).items():
            found[(subject_type, str(subject_id))] = label
    return found
