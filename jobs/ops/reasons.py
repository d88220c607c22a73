"""An operator's reason for an action ("Fail it"), checked once at the edge.

The reason is the history row's note (``JobEvent.note``): the column's length is the limit.
"""

from __future__ import annotations

from jobs.models import JobEvent

REASON_MAX = JobEvent._meta.get_field("note").max_length


def check_reason(text: str) -> tuple[str, str]:
    """An operator's reason as the history row keeps it, or the error that refuses it.

    Checked once here at the edge: required, at most ``REASON_MAX`` characters (the
    column's), printable; a refusal says which, never echoing the text in a log."""
    reason = " ".join(text.split())
    if not reason:
        return "", "Say why: the reason is kept in the job's history."
    if len(reason) > REASON_MAX:
        return reason, f"The reason is {len(reason)} characters; at most {REASON_MAX} are kept."
    if not reason.isprintable():
        return reason, "The reason has characters that cannot be shown."
    return reason, ""
