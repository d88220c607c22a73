"""A reusable Django app for background jobs with one outcome per job.

It imports nothing from the site; job kinds and providers register themselves
through ``jobs.registry``.
"""
