"""The admin's entry point: Django's autodiscovery imports ``jobs.admin``.

The operator screens live in ``jobs.ops`` (the operation framework in
``jobs.ops.operations``, one module per screen); importing them registers them.
A site names its subjects through ``jobs.hooks.register_subject``.
"""

from jobs.ops import admin_artifacts, admin_effects, admin_flow, admin_jobs, admin_queue  # noqa: F401
