"""Issue 42, part 1: weighted fair share across tenants inside the next-job claim.

``FlowRule.weight`` (a ``tenant:<key>`` rule's share; ``tenant:*`` the default), the
``TenantShare`` rows (each tenant's start-time fair queueing tags per queue), and the
claim's per-tenant index: the claim walks a queue's waiting tenants by it (a skip scan,
one probe per tenant) and reads each tenant's head from it (docs/app/fairness.md).
"""

import django.utils.timezone
from django.db import migrations, models

WAITING = "state IN ('queued', 'retry_wait') AND held_by = ''"
SINCE = "(COALESCE(next_attempt_at, created_at))"
TENANT_INDEX = (
    "CREATE INDEX jobs_job_claim_tenant_idx ON jobs_job "
    f"(queue, tenant_key, priority DESC, {SINCE}, id) WHERE {WAITING}"
)


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0028_reconcile_marks'),
    ]

    operations = [
        migrations.AddField(
            model_name='flowrule',
            name='weight',
            field=models.PositiveIntegerField(blank=True, help_text='tenant: its weight in the fair share (empty: default)', null=True),
        ),
        migrations.CreateModel(
            name='TenantShare',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('queue', models.CharField(max_length=64)),
                ('tenant_key', models.CharField(blank=True, default='', max_length=64)),
                ('start', models.FloatField(default=0.0)),
                ('finish', models.FloatField(default=0.0)),
                ('weight', models.FloatField(default=1.0, help_text='the weight its last claim was charged at')),
                ('claims', models.BigIntegerField(default=0)),
                ('updated_at', models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                'ordering': ['queue', 'tenant_key'],
                'indexes': [models.Index(fields=['queue', 'start'], name='jobs_share_vtime_idx')],
                'constraints': [models.UniqueConstraint(fields=('queue', 'tenant_key'), name='jobs_share_queue_tenant')],
            },
        ),
        migrations.RunSQL(TENANT_INDEX, "DROP INDEX IF EXISTS jobs_job_claim_tenant_idx"),
    ]
