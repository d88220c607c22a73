from django.apps import AppConfig
from django.contrib.admin.apps import AdminConfig
from django.db.models.signals import post_migrate


class PermitsConfig(AppConfig):
    name = "permits"
    verbose_name = "Permit review"

    def ready(self) -> None:
        from django.core import checks

        from permits import jobkinds
        from permits.offices import check_offices
        from permits.signals import connect_assignment_audit, create_groups

        jobkinds.register()
        checks.register(check_offices, "permits")
        connect_assignment_audit()
        # After every app's migrate, so all permissions exist.
        post_migrate.connect(create_groups, dispatch_uid="permits.create_groups")


class SiteAdminConfig(AdminConfig):
    """``django.contrib.admin`` whose default site is ``permits.adminsite.SiteAdmin``."""

    default_site = "permits.adminsite.SiteAdmin"
