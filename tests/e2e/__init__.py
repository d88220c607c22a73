"""End-to-end tests: real ``manage.py qcluster`` and ``jobs_dispatcher`` processes."""
