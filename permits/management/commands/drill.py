"""The practice drill, in a scratch database it creates and drops (see permits.drill)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from jobs.testing import scratchdb


class Command(BaseCommand):
    help = "Run the practice drill on real code paths; exit 0 only if every verification holds."

    def add_arguments(self, parser):
        parser.add_argument(
            "--here",
            action="store_true",
            help="run in the configured database instead of a scratch one (it must be empty)",
        )
        parser.add_argument("--keep", action="store_true", help="keep the scratch database")

    def handle(self, *args, here: bool, keep: bool, **options):
        if here:
            from permits.drill import run

            if not run(self.stdout.write):
                raise CommandError("the drill found a broken guarantee")
            return
        name = f"drill_{uuid.uuid4().hex[:10]}"
        work = Path(settings.VAR_DIR) / "drill" / name
        work.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "ARTIFACT_ROOT": str(work / "artifacts"), "JOBS_LEASE_SECONDS": "1"}
        env.setdefault("DJANGO_SETTINGS_MODULE", "permits.settings")
        server = scratchdb.url_from_settings(settings.DATABASES["default"])
        if connection.vendor == "postgresql":
            env["DATABASE_URL"] = scratchdb.create(server, name)
        elif connection.vendor == "sqlite":
            env["DATABASE_URL"] = f"sqlite:///{work / 'db.sqlite3'}"
        else:
            raise CommandError(f"the drill supports PostgreSQL and SQLite, not {connection.vendor}")
        try:
            manage = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py")]
            migrate = subprocess.run(
                [*manage, "migrate", "-v0"], env=env, capture_output=True, text=True
            )
            if migrate.returncode:
                raise CommandError(f"scratch database could not be migrated:\n{migrate.stderr}")
            drill = subprocess.run(
                [*manage, "drill", "--here"], env=env, text=True, capture_output=True
            )
            self.stdout.write(drill.stdout.rstrip())
            if drill.returncode:
                self.stderr.write(drill.stderr[-4000:])
                raise CommandError("the drill found a broken guarantee")
        finally:
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
                if connection.vendor == "postgresql":
                    scratchdb.drop(server, name)
