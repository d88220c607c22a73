"""Causes in plain words: what failed, said so an operator and a reviewer need no Python.

A failed try keeps its error class and code (``Job.last_error_code``), never private data.
A kind maps its codes to a ``Cause`` (``register_cause``): the operator's words, the
reviewer's words, the subject's field to correct, and which actions can help. The engine's
own codes have causes here; a code nobody explained reads as "an error the job does not
explain", with the code, so it is still named and never a bare exception class.

The operator pages offer only actions that can help (``jobs.ops.operations``): no "Fix the
subject" unless fixing it is the way, no requeue of a job whose parameters are the cause.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.models import Job

ANY_KIND = "*"


@dataclass(frozen=True)
class Cause:
    """One failure's cause as people read it, and what can help."""

    operator: str  # what failed, in the operator's words (no exception class needed)
    reviewer: str = ""  # what the reviewer reads, when the kind's pages show the failure
    field: str = ""  # the subject's field to correct ("" when the subject is not the way)
    requeue_helps: bool = True  # False: the same run fails the same way, whatever is fixed
    fix: str = ""  # the one thing that helps, as a sentence

    @property
    def subject_fix(self) -> bool:
        """Whether correcting the subject is the way (the page then offers the link)."""
        return bool(self.field)


_CAUSES: dict[tuple[str, str], Cause] = {
    (ANY_KIND, "payload_invalid"): Cause(
        "The job's own parameters are malformed (checked when it ran): nothing on its "
        "subject fixes them and a requeue fails the same way.",
        reviewer="This job cannot be done as it was asked for.",
        requeue_helps=False,
        fix="Leave it failed; ask for a new job with correct parameters if one is needed.",
    ),
    (ANY_KIND, "not_authorized"): Cause(
        "Current policy no longer allows the job to read its subject (withdrawn, moved "
        "elsewhere, or a revision never asked for).",
        reviewer="What this job was asked for changed, so it is no longer done.",
        requeue_helps=False,
        fix="Nothing to do for this job: it stopped as policy asks.",
    ),
    (ANY_KIND, "timeout"): Cause(
        "The job ran longer than its kind allows and was stopped; it is tried again.",
        fix="If it keeps timing out, look at what it waits for (the provider, storage).",
    ),
    (ANY_KIND, "db_unavailable"): Cause(
        "The database was unreachable for a moment; the job waits and is tried again.",
        fix="Nothing to do unless the database stays down.",
    ),
}


def register_cause(code: str, cause: Cause, *, kind: str = ANY_KIND) -> None:
    """Let a kind (or every kind) explain failures with ``code`` in people's words."""
    if not code or len(code) > 64:
        raise ValueError("a cause's code is 1 to 64 characters, as Job.last_error_code")
    _CAUSES[(kind, code)] = cause


def cause_of(job: Job) -> Cause | None:
    """The explained cause of ``job``'s last failure, or None (no failure, or unexplained)."""
    code = job.last_error_code
    if not job.last_error_class or not code:
        return None
    return _CAUSES.get((job.kind, code)) or _CAUSES.get((ANY_KIND, code))


def plain_words(job: Job) -> str:
    """What failed, for the operator: the cause's words, or a sentence naming the code."""
    cause = cause_of(job)
    if cause is not None:
        return cause.operator
    if not job.last_error_class:
        return ""
    if job.last_error_class == "unknown":
        return (
            f"An error the {job.kind} job does not explain ({job.last_error_code}): tried "
            "again up to its budget; the traceback tells a developer where."
        )
    return f"A {job.last_error_class.replace('_', ' ')} failure ({job.last_error_code})."


def requeue_helps(job: Job) -> bool:
    """Whether a requeue can end otherwise than the last run (False for a known cause
    that no requeue fixes, such as malformed parameters)."""
    cause = cause_of(job)
    return cause is None or cause.requeue_helps


def subject_fix_helps(job: Job) -> bool:
    """Whether "Fix the subject" is offered: the cause names a field of it, or the cause is
    unexplained (the subject may hold it); never for a cause that is not the subject's."""
    cause = cause_of(job)
    return cause is None or cause.subject_fix
