"""Drills for the engine: ``manage.py burst`` and the stand-in provider ``manage.py fake_provider``.

Add ``"jobs.contrib.drills"`` to INSTALLED_APPS to get the commands and the
synthetic job kind ``jobs.burst``; a project without it has neither.
"""
