"""The operator surface of ``jobs``: the admin, the console, the flow views, the words.

Everything here reads the engine and calls its service functions; nothing in the
engine imports this package. Django reaches it through the app's entry points:
``jobs/admin.py`` (admin autodiscovery), ``jobs/urls.py`` (``include("jobs.urls")``)
and ``jobs/templatetags/jobs_console.py`` (``{% load jobs_console %}``).
"""
