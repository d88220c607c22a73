"""The request's trace context on the job row (issue 43): an attempt's span joins the request's trace."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0026_retire_message_bookkeeping'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='trace_context',
            field=models.CharField(blank=True, db_default='', default='', max_length=120),
        ),
    ]
