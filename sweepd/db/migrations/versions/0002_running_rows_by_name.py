"""Find a sweep's running rows by (namespace, status, name).

Every claim that wins looks for the sweep's rows left ``running`` by an
older holder (to mark them lost). The old index on (namespace, status)
left the name to a filter, and a planner without statistics (a new table,
before autovacuum's first ANALYZE) preferred the (namespace, name,
started_at) index and read the whole history instead: 2 ms per claim at
3,000 rows, growing with the history. With the name in the index the
lookup is exact whatever the statistics say.

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_sweep_runs_status_name", "sweep_runs", ["namespace", "status", "name"])
    op.drop_index("ix_sweep_runs_status", table_name="sweep_runs")


def downgrade() -> None:
    op.create_index("ix_sweep_runs_status", "sweep_runs", ["namespace", "status"])
    op.drop_index("ix_sweep_runs_status_name", table_name="sweep_runs")
