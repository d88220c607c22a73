"""Forms of the reviewer pages; every error reads as a sentence a reviewer can act on.

Fields carry the GOV.UK error pattern's wiring: a hint (``<name>-hint``) and, once
the form is invalid, an error message (``<name>-error``) that the control names in
``aria-describedby``, with ``aria-invalid`` set. Radio groups are described by their
fieldset instead (see the template), since each radio is its own control.
"""

from __future__ import annotations

from django import forms

from permits.models import PermitRequest, ReviewDecision


class NewRevisionForm(forms.Form):
    """Rebuild the report as a new revision; carries the revision the reviewer was looking at."""

    seen_revision = forms.IntegerField(min_value=1, widget=forms.HiddenInput)


class DescribedErrorsMixin:
    """Tie each field's hint and error message to its control (``aria-describedby``)."""

    hinted: tuple[str, ...] = ()

    def full_clean(self) -> None:
        super().full_clean()
        for name, field in self.fields.items():
            if isinstance(field.widget, (forms.HiddenInput, forms.RadioSelect)):
                continue
            ids = [f"{name}-hint"] if name in self.hinted else []
            if name in self.errors:
                ids.append(f"{name}-error")
                field.widget.attrs["aria-invalid"] = "true"
            if ids:
                field.widget.attrs["aria-describedby"] = " ".join(ids)


_STALE = "This form is out of date. Reload the page and decide again."
STALE_FORM_ERRORS = {"required": _STALE, "invalid": _STALE, "min_value": _STALE}


class DecisionForm(DescribedErrorsMixin, forms.Form):
    hinted = ("comment",)

    decision = forms.ChoiceField(
        choices=ReviewDecision.Decision.choices,
        widget=forms.RadioSelect,
        error_messages={
            "required": "Choose a decision: approve, request changes or reject.",
            "invalid_choice": "“%(value)s” is not a decision. Choose approve, request changes "
            "or reject.",
        },
    )
    comment = forms.CharField(
        required=False,
        max_length=4000,
        widget=forms.Textarea(attrs={"rows": 4, "aria-describedby": "comment-hint"}),
        help_text="Required when you request changes or reject: the applicant reads it.",
        error_messages={"max_length": "Keep the comment under %(limit_value)d characters."},
    )
    revision = forms.IntegerField(
        min_value=1, widget=forms.HiddenInput, error_messages=STALE_FORM_ERRORS
    )
    # The decision this one changes; empty for a first decision on the revision.
    replaces = forms.IntegerField(
        required=False, min_value=1, widget=forms.HiddenInput, error_messages=STALE_FORM_ERRORS
    )

    def __init__(
        self, *args, permit: PermitRequest, current: ReviewDecision | None = None, **kwargs
    ):
        if current is not None and not args and "data" not in kwargs:
            kwargs.setdefault("initial", {"decision": current.decision, "comment": current.comment})
        super().__init__(*args, **kwargs)
        self.permit = permit
        self.fields["revision"].initial = permit.output_revision
        if current is not None:
            self.fields["replaces"].initial = current.pk

    @property
    def changing(self) -> bool:
        """Whether this form changes an earlier decision (the page words it so)."""
        value = self["replaces"].value()
        return value not in (None, "")

    def clean(self):
        cleaned = super().clean()
        decision = cleaned.get("decision")
        needs_reason = (ReviewDecision.Decision.REQUEST_CHANGES, ReviewDecision.Decision.REJECT)
        if decision in needs_reason and not cleaned.get("comment", "").strip():
            label = ReviewDecision.Decision(decision).label.lower()
            self.add_error("comment", f"Say why you {label}: the applicant needs a reason.")
        return cleaned

    def error_summary(self) -> list[tuple[str, str]]:
        """(anchor id, message) for each error, in page order, for the error summary."""
        anchors = {
            "decision": self["decision"].subwidgets[0].id_for_label,
            "comment": self["comment"].id_for_label,
        }
        summary = [("decision-form", str(e)) for e in self.non_field_errors()]
        for name in ("revision", "replaces", "decision", "comment"):
            for e in self.errors.get(name, []):
                summary.append((anchors.get(name, "decision-form"), str(e)))
        return summary
