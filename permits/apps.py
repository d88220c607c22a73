from django.apps import AppConfig


class PermitsConfig(AppConfig):
    name = "permits"
    verbose_name = "Permit review"

    def ready(self) -> None:
        from permits import jobkinds

        jobkinds.register()
