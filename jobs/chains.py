"""Follow-up work a handler returns with its effects (docs/app/chains.md)::

    @jobs.kind("office.digest")
    def digest(ctx):
        parts = [jobs.then("office.section", params={"part": p}, name=p) for p in "abc"]
        return [jobs.group(parts, join=jobs.then("office.bind"), name="sections")]

    @jobs.kind("office.bind", on_child_failure="fail")
    def bind(ctx):
        pages = sum(child.result["pages"] for child in ctx.joined())
        return [jobs.result({"pages": pages})]

Nothing is requested when the handler returns: the follow-ups are written by the
publish that makes the job succeeded, in its transaction, so they exist exactly when
it succeeded, once (``jobs.engine.groups``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jobs.registry import FollowUp, GroupSpec, ResultSpec


def then(
    kind: str,
    *,
    params: dict[str, Any] | None = None,
    name: str = "",
    priority: int | None = None,
    queue: str | None = None,
) -> FollowUp:
    """A job of ``kind`` to request when this one succeeds: a chain's next link.

    Its identity is (kind, this job and ``name``): ``name`` (1-24 letters, digits, ``_``
    or ``-``; default its position) must be unique among this job's follow-ups.
    ``params`` hold references only; ``priority`` and ``queue`` default to the kind's.
    """
    return FollowUp(kind, dict(params or {}), name, priority, queue)


def group(children: Iterable[FollowUp], *, join: FollowUp, name: str = "") -> GroupSpec:
    """Children (``then(...)``) that run side by side and one ``join`` requested once,
    when the last child ended; the join reads their results with ``ctx.joined()``.

    A child that did not succeed (failed, dead or cancelled) makes the join follow its
    kind's ``on_child_failure`` rule: ``"fail"`` (default) or ``"skip"`` it (it never
    runs), or ``"run"`` it anyway.
    """
    return GroupSpec(tuple(children), join, name)


def result(value: Any) -> ResultSpec:
    """This job's small JSON result (at most 32 KiB), stored with its publish: a join
    reads its children's. References and counts, never private data."""
    return ResultSpec(value)
