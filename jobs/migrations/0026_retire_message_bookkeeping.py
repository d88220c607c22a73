"""The jobs table is the queue (issue 41): no message per job, so nothing records when one
was sent. Dropping a nullable column is a catalogue change on PostgreSQL (no rewrite)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("jobs", "0025_step_begun_and_lookup_event")]

    operations = [
        migrations.RemoveField(model_name="job", name="enqueued_for"),
        migrations.RemoveField(model_name="effect", name="enqueued_for"),
    ]
