"""Forms of the reviewer pages; every error reads as a sentence a reviewer can act on."""

from __future__ import annotations

from django import forms

from permits.models import PermitRequest, ReviewDecision


class NewRevisionForm(forms.Form):
    """Ask for a new report revision; carries the revision the reviewer was looking at."""

    seen_revision = forms.IntegerField(min_value=1, widget=forms.HiddenInput)


class DecisionForm(forms.Form):
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
        widget=forms.Textarea(attrs={"rows": 4}),
        help_text="Required when you request changes or reject: the applicant reads it.",
    )
    revision = forms.IntegerField(min_value=1, widget=forms.HiddenInput)

    def __init__(self, *args, permit: PermitRequest, **kwargs):
        super().__init__(*args, **kwargs)
        self.permit = permit
        self.fields["revision"].initial = permit.output_revision

    def clean_revision(self) -> int:
        revision = self.cleaned_data["revision"]
        if revision != self.permit.output_revision:
            raise forms.ValidationError(
                f"The report moved to revision {self.permit.output_revision} after you opened "
                f"revision {revision}. Look at the new revision, then decide again."
            )
        return revision

    def clean(self):
        cleaned = super().clean()
        decision = cleaned.get("decision")
        needs_reason = (ReviewDecision.Decision.REQUEST_CHANGES, ReviewDecision.Decision.REJECT)
        if decision in needs_reason and not cleaned.get("comment", "").strip():
            label = ReviewDecision.Decision(decision).label.lower()
            self.add_error("comment", f"Say why you {label}: the applicant needs a reason.")
        if self.permit.is_withdrawn:
            raise forms.ValidationError("The applicant withdrew this request: no decision needed.")
        return cleaned
