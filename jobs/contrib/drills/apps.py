from django.apps import AppConfig


class DrillsConfig(AppConfig):
    name = "jobs.contrib.drills"
    label = "jobs_drills"
    verbose_name = "Jobs drills"

    def ready(self) -> None:
        from jobs.contrib.drills import burst

        # Every process of a project that installs the drills (its qclusters, the
        # drill's own workers) can run or re-drive the burst's jobs.
        burst.register_kind()
