"""What jobs left behind, in the admin: published artifacts (and whether they are intact),
in-app notices and archived jobs' identities. Read-only; "Verify" checks stored bytes
against their sha256.
"""

from __future__ import annotations

from django.contrib import admin, messages

from jobs import artifacts
from jobs.exceptions import ArtifactCorrupt, TemporaryFailure
from jobs.models import ArchivedJob, Artifact, Notice
from jobs.ops.admin_common import EngineAdmin


@admin.register(Artifact)
class ArtifactAdmin(EngineAdmin):
    """Published artifacts: the file the row names, its sha256, and whether it is lost (why)."""

    list_display = (
        "key",
        "job",
        "state",
        "size",
        "content_type",
        "sha256",
        "verified_at",
        "rewrites",
        "lost_reason",
    )
    list_filter = ("state",)
    readonly_fields = [f.name for f in Artifact._meta.fields]
    actions = ["verify"]

    @admin.action(description="Verify stored bytes against sha256", permissions=["operate"])
    def verify(self, request, queryset):
        bad, unread = [], []
        for artifact in queryset:
            try:
                artifacts.verify(artifact)
            except artifacts.ArtifactLost:
                bad.append(f"{artifact.key} (lost: {artifact.lost_reason or 'no reason recorded'})")
                self.log_change(request, artifact, "Verified: lost")
            except ArtifactCorrupt:
                bad.append(artifact.key)
                self.log_change(request, artifact, "Verified: missing or corrupt")
            except TemporaryFailure as exc:  # no verdict on the bytes: nothing recorded
                unread.append(f"{artifact.key} ({exc.detail or exc.code})")
            else:
                self.log_change(request, artifact, "Verified: intact")
        if unread:
            self.message_user(
                request,
                f"Could not be read now, so not judged (the storage failed; try again once "
                f"it answers): {', '.join(unread)}",
                messages.WARNING,
            )
        if bad:
            self.message_user(request, f"Missing or corrupt: {', '.join(bad)}", messages.ERROR)
        elif not unread:
            self.message_user(request, f"{queryset.count()} artifact(s) intact.", messages.SUCCESS)


@admin.register(Notice)
class NoticeAdmin(EngineAdmin):
    list_display = ("id", "recipient", "title", "created_at", "read_at")
    readonly_fields = [f.name for f in Notice._meta.fields]


@admin.register(ArchivedJob)
class ArchivedJobAdmin(EngineAdmin):
    """Jobs archived (``jobs.archive``): what stays of each, found by its id, uid or
    subject. Its history (attempts, errors, events) is gone; its artifact file is kept."""

    list_display = (
        "job_id", "kind", "subject_type", "subject_id", "output_revision", "state",
        "finished_at", "archived_at", "artifact_key",
    )  # fmt: skip
    list_filter = ("state", "kind")
    search_fields = ("=job_id", "=uid", "subject_id", "artifact_key")
    ordering = ("-archived_at",)
    readonly_fields = [f.name for f in ArchivedJob._meta.fields]
    show_full_result_count = False  # a count of years of identities is not worth its scan
