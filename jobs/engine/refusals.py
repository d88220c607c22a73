"""The database refusals the engine gives way on, by SQLSTATE name.

A refusal is not an error: the job's row locked by another transaction
(``lock_not_available``: a lock timeout or ``NOWAIT``) or a recipient deleted
between the check and the insert (``foreign_key_violation``). The caller then
takes its documented other path. A lost connection or anything else is an error.
"""

from __future__ import annotations


def refusal(exc: BaseException) -> str | None:
    """The SQLSTATE name of a refusal the engine means to give way on, else None."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return _NAMES.get(code)


_NAMES = {"55P03": "lock_not_available", "23503": "foreign_key_violation"}
