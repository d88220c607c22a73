"""The smallest Django project that lets autodoc import the app (no database is opened)."""

SECRET_KEY = "docs-build-only"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.admin",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_q",
    "jobs",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
Q_CLUSTER = {"name": "docs", "orm": "default", "timeout": 120, "retry": 180}
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
