"""In-app notices: a database row committed with its ledger row."""

from __future__ import annotations

from jobs.models import Effect, Notice
from jobs.providers import Provider


class InAppProvider(Provider):
    name = "inapp"
    transactional = True
    supports_idempotency = True  # the notice's one-to-one on the effect

    @property
    def notice_in_plan(self) -> bool:
        """A subclass with its own ``apply`` is applied by it, in the ORM transaction."""
        return type(self).apply is InAppProvider.apply

    def notice_for(self, effect: Effect) -> Notice:
        """The unsaved notice of ``effect``: what the one-statement publish inserts."""
        return Notice(
            effect=effect if effect.pk else None,
            recipient_id=int(effect.recipient),
            title=str(effect.data.get("title", "A job finished"))[:200],
            link=str(effect.data.get("link", ""))[:300],
        )

    def apply(self, effect: Effect) -> str:
        notice = self.notice_for(effect)
        notice.save()
        return f"notice:{notice.pk}"
