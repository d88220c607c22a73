"""The console in the adopter's words: a fresh project's admin shows no word of the permit site.

The wheel (built from a clean copy, as ``make release`` builds it) is installed with
Django 6.1 on Python 3.12 into a fresh virtualenv and a fresh ``django-admin startproject``
without ``permits``: the testing page's example app (``shop``) with kinds that end in every
job state (done, failed, stopped, retrying, waiting, cancelled) and effects applied and
withheld, on the one SQLite recipe. Its ``runserver`` serves the admin; Debian's Chromium
(``/usr/bin/chromium``, driven by Playwright) logs in and walks every page of the app it
can reach from the admin index and the operations console (lists, filters, each job and
effect page, the operate confirmations), and the rendered text of each is searched for the
permit site's words. A labelled kind (``labels=``) shows its own words where its jobs are.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from urllib.parse import urlsplit

import pytest

from jobs.testing.processes import Processes
from tests.e2e.test_browser import CHROMIUM, CHROMIUM_ARGS, SCREENSHOTS
from tests.e2e.test_wheel import (  # noqa: F401  (clone, dists: fixtures)
    PIP_CACHE,
    SHOP_SETTINGS,
    _python,
    _run,
    clone,
    dists,
)

pytestmark = [pytest.mark.drill, pytest.mark.e2e, pytest.mark.wheel]

# The permit site's words (its domain: requests, reports, reviewers, notices, offices).
PERMIT_WORDS = re.compile(
    r"\b(permits?|reports?|reviewers?|notices?|offices?|applicants?|inspections?)\b", re.I
)

SHOP_KINDS = """
from django.contrib.auth import get_user_model

import jobs


@jobs.kind("shop.welcome", max_attempts=3)
def welcome(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    users = ctx.read(get_user_model().objects.filter(pk=ctx.params["user_id"]))
    if not users:
        raise jobs.PayloadInvalid("params.user_id names no user")
    ctx.store_artifact(b"Welcome!\\n", content_type="text/plain", extension="txt")
    return [
        jobs.EffectSpec("welcome-mail", "email", str(users[0].pk)),
        jobs.EffectSpec("welcome-inbox", "inapp", str(users[0].pk), {"title": "Welcome"}),
    ]


def closed_account(effect):
    return "the account is closed"


@jobs.kind(
    "shop.invoice",
    max_attempts=3,
    authorize_release=closed_account,
    labels={"job": "invoice", "effect": "receipt", "succeeded": "Invoice sent"},
)
def invoice(ctx: jobs.JobContext) -> list[jobs.EffectSpec]:
    if ctx.params.get("flaky"):
        raise jobs.TemporaryFailure("the tax service answered 503", code="tax_unavailable")
    return [jobs.EffectSpec("receipt", "email", str(ctx.params["user_id"]))]


@jobs.kind("shop.export", max_attempts=1, labels={"job": "export", "dead": "Gave up"})
def export(ctx: jobs.JobContext) -> None:
    raise RuntimeError("the export's disk is full")
"""

SEED = """
import json
import jobs
import jobs.testing
from django.contrib.auth import get_user_model

User = get_user_model()
admin = User.objects.create_superuser("shop-admin", "", "shop-password")
bea = User.objects.create_user("bea")
ids = {}
ids["done"] = jobs.request("shop.welcome", ("shop.user", 1), params={"user_id": bea.pk}).id
ids["failed"] = jobs.request("shop.welcome", ("shop.user", 2), params={"user_id": 0}).id
ids["labelled"] = jobs.request("shop.invoice", ("shop.order", 1), params={"user_id": bea.pk}).id
ids["retrying"] = jobs.request(
    "shop.invoice", ("shop.order", 2), params={"user_id": bea.pk, "flaky": True}).id
ids["stopped"] = jobs.request("shop.export", ("shop.user", 1)).id
jobs.testing.drain()
ids["waiting"] = jobs.request("shop.welcome", ("shop.user", 3), params={"user_id": bea.pk}).id
ids["cancelled"] = jobs.request("shop.export", ("shop.user", 2)).id
jobs.cancel(ids["cancelled"], actor="shop-admin")
from jobs.models import Effect, Job
print("SEED " + json.dumps({
    "ids": ids,
    "states": {name: Job.objects.get(pk=pk).state for name, pk in ids.items()},
    "effects": sorted(Effect.objects.values_list("provider", "state")),
}))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def fresh_shop(dists, tmp_path):  # noqa: F811 - the fixture imported above
    """A fresh Django 6.1 project with the wheel, seeded; its runserver's base URL."""
    from tests.docs.test_sqlite_recipe import DEPLOYMENT

    venv, project = tmp_path / "venv", tmp_path / "project"
    project.mkdir()
    env = {
        "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "VIRTUAL_ENV": str(venv),
        "PIP_CACHE_DIR": str(PIP_CACHE),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    _run([_python("3.12"), "-m", "venv", venv], cwd=tmp_path, env=env)
    _run(
        ["pip", "install", "--quiet", str(dists["wheel"]), "Django>=6.1,<6.2"],
        cwd=tmp_path,
        env=env,
    )
    _run(["django-admin", "startproject", "shop_site", "."], cwd=project, env=env)
    _run(["python", "manage.py", "startapp", "shop"], cwd=project, env=env)
    section = DEPLOYMENT.read_text().split("## SQLite (one machine)", 1)[1].split("\n## ", 1)[0]
    [recipe] = re.findall(r"```python\n(.*?)```", section, re.S)
    settings = project / "shop_site" / "settings.py"
    settings.write_text(settings.read_text() + SHOP_SETTINGS + recipe)
    (project / "shop" / "jobkinds.py").write_text(SHOP_KINDS)
    _run(["python", "manage.py", "migrate", "-v0"], cwd=project, env=env)
    seeded = json.loads(
        _run(["python", "manage.py", "shell", "-c", SEED], cwd=project, env=env).split("SEED ", 1)[
            1
        ]
    )
    port = _free_port()
    procs = Processes(env, tmp_path, command=(str(venv / "bin" / "python"),), cwd=project)
    try:
        procs.start("web", "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                procs.check_alive()
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", seeded, project
    finally:
        procs.stop_all()


def _reachable(href: str, base: str) -> str | None:
    """The path of an app page worth reading (no logout, no delete confirmation)."""
    parts = urlsplit(href)
    if parts.netloc and f"{parts.scheme}://{parts.netloc}" != base:
        return None
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    if not parts.path.startswith("/admin/jobs/") or "/delete/" in parts.path:
        return None
    if parts.path.endswith((".csv", ".json", "/follow/", "/download/")):
        return None
    # One filter, the state's, stands for the lists' filters (no sort orders, facets,
    # pages or combinations: they repeat the same words).
    if parts.query and not re.fullmatch(r"state__exact=\w+", parts.query):
        return None
    return path


def test_console_words__a_fresh_projects_admin_shows_no_permit_word(fresh_shop, monkeypatch):
    from playwright.sync_api import sync_playwright

    base, seeded, _project = fresh_shop
    states = seeded["states"]
    assert states == {
        "done": "succeeded",
        "failed": "failed",
        "labelled": "succeeded",
        "retrying": "retry_wait",
        "stopped": "dead",
        "waiting": "queued",
        "cancelled": "cancelled",
    }, states
    assert {"applied", "withheld"} <= {state for _, state in seeded["effects"]}, seeded
    ids = seeded["ids"]
    start = [
        "/admin/",
        "/admin/jobs/",
        "/admin/jobs/job/dashboard/",
        "/admin/jobs/job/",
        "/admin/jobs/effect/",
        *(f"/admin/jobs/job/{pk}/change/" for pk in ids.values()),
        f"/admin/jobs/job/{ids['stopped']}/operate/requeue/",
        f"/admin/jobs/job/{ids['waiting']}/operate/cancel/",
    ]
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    seen: dict[str, str] = {}
    found: dict[str, list[str]] = {}
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = chromium.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(20_000)
            page.goto(base + "/admin/login/")
            page.fill("input[name=username]", "shop-admin")
            page.fill("input[name=password]", "shop-password")
            with page.expect_navigation():
                page.locator("input[name=password]").press("Enter")
            queue = list(start)
            queued = set(start)
            while queue and len(seen) < 300:
                path = queue.pop(0)
                if path in seen:
                    continue
                response = page.goto(base + path)
                assert response is not None and response.status == 200, (path, response)
                links = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
                text = page.locator("html").inner_text() + " " + page.title()
                seen[path] = text
                if hits := sorted({m.lower() for m in PERMIT_WORDS.findall(text)}):
                    found[path] = hits
                for href in links:
                    if (reach := _reachable(href, base)) and reach not in queued:
                        queued.add(reach)
                        queue.append(reach)
            page.goto(base + "/admin/jobs/job/dashboard/")
            page.screenshot(path=str(SCREENSHOTS / "fresh-project-console.png"), full_page=True)
            page.goto(base + f"/admin/jobs/job/{ids['labelled']}/change/")
            page.screenshot(path=str(SCREENSHOTS / "fresh-project-labelled-job.png"))
        finally:
            chromium.close()
    listing = seen["/admin/jobs/job/"]
    words: dict[str, list[str]] = {}
    for path, hits in found.items():
        for hit in hits:
            words.setdefault(hit, []).append(path)
    print(f"\n{len(seen)} pages of the fresh project's admin read (jobs' pages, the console,")
    print(f"every job and effect, filters, operate confirmations; {len(queue)} links left")
    print("unread at the cap); permit words found:")
    for word, paths in sorted(words.items()):
        print(f"  {word!r} on {len(paths)} pages, e.g. {paths[:3]}")
    assert len(seen) >= 30, sorted(seen)
    assert found == {}, found
    # The neutral words, and the labelled kind's own where its job is.
    for word in ("Done", "Failed", "Retrying soon", "Waiting", "Cancelled", "Gave up"):
        assert word in listing, word
    assert "Invoice sent" in listing
    assert "Invoice sent" in seen[f"/admin/jobs/job/{ids['labelled']}/change/"]
    assert "Invoice sent" not in seen[f"/admin/jobs/job/{ids['done']}/change/"]
    assert "Effects by state" in seen["/admin/jobs/job/dashboard/"]
    # The dead export in the console's failures, in its kind's words.
    assert "shop.export (export)" in seen["/admin/jobs/job/dashboard/"]
    assert "Gave up · dead" in seen["/admin/jobs/job/dashboard/"]
