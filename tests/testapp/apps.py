from django.apps import AppConfig
from django.conf import settings


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"

    def ready(self) -> None:
        from tests.testapp import kinds

        kinds.register()
        kinds.register_durable_steps()
        kinds.register_chains()
        kinds.register_debounced()
        if getattr(settings, "SOAK_RELEASE_CHECK_FAULTS", False):
            from tests.chaos.faults import install_release_check_faults

            install_release_check_faults()
