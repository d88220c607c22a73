"""Faults the soak injects inside the workers (installed by tests.testapp when the soak runs).

A kind's release check that raises: for the effects of one permit request in
twenty it fails on the first two attempts and then answers (the retry table must
retry it, within the budget), and for another one in twenty it always fails (the
effect must stop at its budget in ``needs_review``, never sent). The choice is a
pure function of the request's place among the soak's requests (all created before
the workers start), so the checker knows which effects were hit, and a run of 8
requests or more always has both kinds of fault (a hash of the effect's identity
left one run in CI without a transient one).
"""

from __future__ import annotations

TRANSIENT_FAILS = 2  # a transiently failing check raises on attempts 1 and 2
FAULTY_KIND = "permits.report"  # the kind whose release check the soak makes fail


def release_check_fault(job) -> str | None:
    """``transient``, ``always`` or None for the effects of ``job`` (only
    ``FAULTY_KIND``'s check is wrapped)."""
    from permits.models import PermitRequest

    if job.kind != FAULTY_KIND or not str(job.subject_id).isdigit():
        return None
    place = PermitRequest.objects.filter(pk__lt=int(job.subject_id)).count()
    return {3: "transient", 7: "always"}.get(place % 20)


class ReleaseCheckFault(RuntimeError):
    """Raised by the soak's release check fault (the class name is the error code)."""


def install_release_check_faults() -> None:
    """Wrap ``FAULTY_KIND``'s release check so that it raises for the chosen effects."""
    from jobs import registry

    kind = registry.get_kind(FAULTY_KIND)
    check = kind.authorize_release

    def faulty(effect) -> str | None:
        fault = release_check_fault(effect.job)
        if fault == "always" or (fault == "transient" and effect.attempts <= TRANSIENT_FAILS):
            raise ReleaseCheckFault("soak: the release check is failing")
        return check(effect) if check is not None else None

    # Everything else the site declared stays (its sequence per permit request too).
    registry.register_kind(
        kind.name,
        kind.handler,
        authorize_release=faulty,
        max_attempts=kind.max_attempts,
        redact_errors=kind.redact_errors,
        priority=kind.priority,
        queue=kind.queue,
        timeout=kind.timeout,
        labels=kind.labels,
        sequence=kind.sequence,
        on_failure="skip" if kind.sequence_skip else "hold",
    )
