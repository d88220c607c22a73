"""Sequences (issue 42, docs/app/sequences.md): a job's sequence key, whether a failure of it
lets its sequence go on (``on_failure="skip"``) and who released its sequence after a failure.

The three columns have database defaults, so adding them rewrites no row on PostgreSQL
11+. Two partial indexes, both empty while no job has a sequence: a sequence's items in
request order (the item before a head is one probe), and the waiting items a sequence
holds (``held_by = 'sequence'``), whose first row per key is that key's head: the claim
reads one row per blocked key, never a sequence's backlog.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0031_job_debounce")]

    operations = [
        migrations.AddField(
            model_name="job",
            name="sequence_key",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
        migrations.AddField(
            model_name="job",
            name="sequence_skip",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddField(
            model_name="job",
            name="sequence_released_by",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(("sequence_key", ""), _negated=True),
                fields=["sequence_key", "id"],
                name="jobs_job_sequence_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(("held_by", "sequence"), ("state", "queued")),
                fields=["sequence_key", "id"],
                name="jobs_job_sequence_held_idx",
            ),
        ),
    ]
