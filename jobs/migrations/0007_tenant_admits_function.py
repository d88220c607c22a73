"""The tenant bound of the one-statement claim (``jobs.sql.claim``), PostgreSQL only.

A VOLATILE function takes a fresh snapshot for each query it runs, so the count
below, taken after the tenant's lock, sees every claim committed before it: the
bound holds although the claim is a single statement. The lock key is the one
the ORM claim takes (``jobs.transitions._lock_tenant``), so both paths take turns.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION jobs_tenant_admits(
    p_tenant varchar, p_job bigint, p_bound integer
) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1785684595, hashtext(p_tenant));
    RETURN (
        SELECT count(*) FROM jobs_job
        WHERE tenant_key = p_tenant AND state = 'running'
          AND lease_expires_at > clock_timestamp() AND id <> p_job
    ) < p_bound;
END $$;
"""
DROP = "DROP FUNCTION IF EXISTS jobs_tenant_admits(varchar, bigint, integer);"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("jobs", "0006_neutral_help_text")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
