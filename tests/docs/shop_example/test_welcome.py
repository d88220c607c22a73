"""The testing page's example tests (docs/app/testing.md includes this file).

Both modes, with pytest-django and with Django's ``TestCase``; no worker process runs.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.test import TestCase

import jobs
import jobs.testing
from tests.docs.shop_example import jobkinds  # noqa: F401  (registers shop.welcome)


@pytest.mark.django_db
def test_welcome__inline() -> None:
    user = get_user_model().objects.create_user("ada", email="ada@example.org")

    with jobs.testing.run_inline():
        handle = jobs.request("shop.welcome", user, params={"user_id": user.pk})

    assert handle.state == "succeeded"
    assert [e.state for e in jobs.testing.effects("shop.welcome")] == ["applied"]
    assert [m.to for m in mail.outbox] == [["ada@example.org"]]


@pytest.mark.django_db
def test_welcome__manual() -> None:
    user = get_user_model().objects.create_user("ada", email="ada@example.org")

    handle = jobs.request("shop.welcome", user, params={"user_id": user.pk})
    assert [h.id for h in jobs.testing.requested("shop.welcome", state="queued")] == [handle.id]
    assert mail.outbox == []  # nothing runs until the test says so

    jobs.testing.drain()

    assert handle.refresh().state == "succeeded"
    assert [e.state for e in jobs.testing.effects("shop.welcome")] == ["applied"]
    assert [m.to for m in mail.outbox] == [["ada@example.org"]]


class WelcomeTests(TestCase):
    @jobs.testing.run_inline()
    def test_welcome__inline(self) -> None:
        user = get_user_model().objects.create_user("ada", email="ada@example.org")

        handle = jobs.request("shop.welcome", user, params={"user_id": user.pk})

        self.assertEqual(handle.state, "succeeded")
        self.assertEqual(len(jobs.testing.effects("shop.welcome", state="applied")), 1)
        self.assertEqual(len(mail.outbox), 1)

    def test_welcome__withheld_when_the_account_is_closed(self) -> None:
        user = get_user_model().objects.create_user("ada", email="ada@example.org")
        handle = jobs.request("shop.welcome", user, params={"user_id": user.pk})
        user.is_active = False  # closed after the request, before any worker ran
        user.save()

        jobs.testing.drain()

        self.assertEqual(handle.refresh().state, "succeeded")
        self.assertEqual([e.state for e in jobs.testing.effects("shop.welcome")], ["withheld"])
        self.assertEqual(mail.outbox, [])
