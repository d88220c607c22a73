"""Offices get their people: office admins and reviewers belong to one or more offices.

The demo's accounts get the offices the demo gives them (``seed_demo`` does the same on
a fresh database); any other site's office admins and reviewers start with none, and the
system check ``permits.W001`` names them until someone adds them to their offices.
"""

from django.conf import settings
from django.db import migrations, models

# username -> the offices (tenant keys) the demo gives them
DEMO_OFFICES = {
    "reviewer47": ["springfield"],
    "reviewer52": ["springfield", "shelbyville"],
    "officeadmin": ["springfield"],
}


def demo_offices(apps, schema_editor):
    Tenant = apps.get_model("permits", "Tenant")
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    for username, keys in DEMO_OFFICES.items():
        user = User.objects.filter(username=username).first()
        if user is None:
            continue
        for tenant in Tenant.objects.filter(key__in=keys):
            tenant.members.add(user)


class Migration(migrations.Migration):
    dependencies = [
        ("permits", "0004_reviewer_assignments_and_rebuilds"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="tenant",
            name="members",
            field=models.ManyToManyField(
                blank=True,
                help_text="office admins and reviewers of this office",
                related_name="offices",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        migrations.RunPython(demo_offices, migrations.RunPython.noop),
    ]
