"""Small factories for the permit domain."""

from __future__ import annotations

from decimal import Decimal
from itertools import count

from permits.models import PermitRequest, Tenant
from permits.services import assign_reviewer

_n = count(1)

PRIVATE = {
    "applicant_name": "Zelda Quartermaine",
    "applicant_phone": "+1 555 0199",
    "applicant_email": "zelda.q@example.net",
    "applicant_id_number": "XQ-4417-2209",
}


def tenant(key: str = "springfield") -> Tenant:
    return Tenant.objects.get_or_create(key=key, defaults={"name": f"{key.title()} Permit Office"})[
        0
    ]


def permit(office: Tenant | None = None, *, reviewer=None, **fields) -> PermitRequest:
    n = next(_n)
    values = {
        "tenant": office or tenant(),
        "reference": f"T-{n:05d}",
        "site_address": f"{n} Test Street",
        "parcel": f"P-{n}",
        "work_type": PermitRequest.WorkType.ALTERATION,
        "description": "Interior alteration",
        "valuation": Decimal("32000"),
        **PRIVATE,
    }
    values.update(fields)
    made = PermitRequest.objects.create(**values)
    if reviewer is not None:
        assign_reviewer(made, reviewer)
    return made
