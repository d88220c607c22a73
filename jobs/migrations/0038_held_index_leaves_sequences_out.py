"""The paused scopes' held index leaves a sequence's held jobs out.

A plan that believed the held jobs few (statistics taken before a burst of sequenced
requests, kept for a worker's connection) walked every held job through this index to
find one key's head; the sequence's own index (``jobs_job_sequence_held_idx``) finds it
by key. A pause's release reads ``held_by = <scope>``, which the new predicate still
covers.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0037_job_finished_index")]

    operations = [
        migrations.RemoveIndex(model_name="job", name="jobs_job_held_idx"),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                fields=["held_by"],
                name="jobs_job_held_idx",
                condition=~models.Q(held_by="") & ~models.Q(held_by="sequence"),
            ),
        ),
    ]
