from django.apps import AppConfig
from django.db.models.signals import post_migrate
from django.utils.module_loading import autodiscover_modules


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Background jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from jobs import checks  # noqa: F401  (registers system checks)
        from jobs.backends import register_task_kind_if_configured
        from jobs.registry import register_builtin_providers
        from jobs.signals import install_dispatch_schedule

        register_builtin_providers()
        # Every installed app's jobkinds.py (``@jobs.kind``): every process that
        # starts Django (web, qcluster workers, commands) knows every kind.
        autodiscover_modules("jobkinds")
        register_task_kind_if_configured()
        post_migrate.connect(install_dispatch_schedule, sender=self)
