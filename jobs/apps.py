from django.apps import AppConfig
from django.db.models.signals import post_migrate


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Background jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from jobs import checks  # noqa: F401  (registers system checks)
        from jobs.providers import register_builtin_providers
        from jobs.signals import install_dispatch_schedule

        register_builtin_providers()
        post_migrate.connect(install_dispatch_schedule, sender=self)
