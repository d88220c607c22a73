"""Start-up checks: lease < Q_CLUSTER timeout < retry, and the artifact storage exists."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, Warning, register

from jobs import conf


@register()
def check_timing(app_configs=None, **kwargs):
    errors = []
    q = getattr(settings, "Q_CLUSTER", {})
    lease = conf.lease_seconds()
    timeout, retry = q.get("timeout"), q.get("retry", 60)
    if timeout is None:
        errors.append(Error("Q_CLUSTER['timeout'] must be set", id="jobs.E001"))
    elif not (lease < timeout < retry):
        errors.append(
            Error(
                f"JOBS_LEASE_SECONDS ({lease}) < Q_CLUSTER['timeout'] ({timeout}) < "
                f"Q_CLUSTER['retry'] ({retry}) must hold",
                hint="django-q2 redelivers after 'retry'; a worker must lose its lease first.",
                id="jobs.E002",
            )
        )
    if q.get("orm") is None:
        errors.append(
            Warning(
                "Q_CLUSTER does not use the ORM broker: enqueue is not atomic with the job row",
                hint="The dispatcher still re-drives due jobs, but a crash between commit and "
                "enqueue delays a job until it is found.",
                id="jobs.W001",
            )
        )
    return errors


@register()
def check_storage(app_configs=None, **kwargs):
    alias = conf.get("JOBS_ARTIFACT_STORAGE")
    if alias not in getattr(settings, "STORAGES", {}):
        return [Error(f"STORAGES has no {alias!r} entry (JOBS_ARTIFACT_STORAGE)", id="jobs.E003")]
    return []
