"""gunicorn settings for ``make serve`` (``gunicorn -c python:permits.gunicorn_conf``).

Environment: ``BIND`` (default ``127.0.0.1:$PORT``, ``PORT`` 8000), ``WEB_CONCURRENCY``
(worker processes, default 2), ``WEB_TIMEOUT`` (seconds, default 30). Anything else can
be given in ``GUNICORN_CMD_ARGS`` (e.g. ``--certfile``/``--keyfile`` when gunicorn itself
terminates TLS).
"""

import os

bind = os.environ.get("BIND") or f"127.0.0.1:{os.environ.get('PORT', '8000')}"
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
timeout = int(os.environ.get("WEB_TIMEOUT", "30"))
accesslog = "-"
# The path without its query string, and no referrer: an admin URL's query (a lookup value,
# a search term) is nothing the access log should keep.
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(m)s %(U)s %(H)s" %(s)s %(b)s "%(a)s"'
errorlog = "-"
# Django alone decides whether a request came over HTTPS (SECURE_PROXY_SSL_HEADER, set
# only with BEHIND_PROXY=1): gunicorn must not trust X-Forwarded-Proto on its own.
secure_scheme_headers: dict[str, str] = {}
