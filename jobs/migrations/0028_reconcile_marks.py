"""Issue 47 (jobs_reconcile): the timeline last reconciled after, and jobs marked reconciled."""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0027_job_trace_context'),
    ]

    operations = [
        migrations.CreateModel(
            name='ReconcileMark',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=32, unique=True)),
                ('timeline', models.BigIntegerField(help_text='the timeline last reconciled after')),
                ('claimed_by', models.CharField(blank=True, default='', max_length=200)),
                ('claimed_until', models.DateTimeField(blank=True, null=True)),
                ('updated_at', models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                'ordering': ['name'],
            },
        ),
        migrations.AddField(
            model_name='job',
            name='reconciled_at',
            field=models.DateTimeField(blank=True, help_text='jobs_reconcile found the outside world may have its effects: looked up first', null=True),
        ),
    ]
