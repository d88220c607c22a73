"""The kinds page's typed example, used as an adopter would (mypy checks this file too)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

import jobs
import jobs.testing
from tests.docs.typed_example.jobkinds import Counted, Totals


@pytest.mark.django_db
def test_totals__the_result_is_the_kinds_dataclass() -> None:
    ada = get_user_model().objects.create_user("ada")
    with jobs.testing.run_inline():
        handle = jobs.request("billing.totals", ada, params={"user_ids": [ada.pk]})
    totals: Totals | None = handle.result_as(Totals)
    assert totals == Totals(users=1, active=1)
    assert handle.result == totals  # the same value, untyped


@pytest.mark.django_db
def test_count__an_async_kinds_typed_dict() -> None:
    ada = get_user_model().objects.create_user("ada")
    with jobs.testing.run_inline():
        handle = jobs.request("billing.count", ada, params={"user_ids": [ada.pk]})
    counted = handle.result_as(Counted)
    assert counted == {"rows": 1}


@pytest.mark.django_db
def test_result_as__another_type_is_refused() -> None:
    ada = get_user_model().objects.create_user("ada")
    with jobs.testing.run_inline():
        handle = jobs.request("billing.totals", ada, params={"user_ids": [ada.pk]})
    with pytest.raises(TypeError, match="not a Counted"):
        handle.result_as(Counted)
