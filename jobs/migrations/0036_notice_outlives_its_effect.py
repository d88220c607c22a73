"""Issue 46: an in-app notice outlives its effect. The archive deletes a long-finished
job's effects (their keys stay in its record) and keeps the recipients' notices, their
``effect`` then empty. ``DROP NOT NULL`` only: no row is rewritten."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0035_fair_pick_v2'),
    ]

    operations = [
        migrations.AlterField(
            model_name='notice',
            name='effect',
            field=models.OneToOneField(null=True, on_delete=django.db.models.deletion.PROTECT, related_name='notice', to='jobs.effect'),
        ),
    ]
