"""sweep_leases and sweep_runs.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from sweepd.db.schema import HOLDER_LENGTH, NAME_LENGTH, UtcDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweep_leases",
        sa.Column("namespace", sa.String(NAME_LENGTH), primary_key=True),
        sa.Column("name", sa.String(NAME_LENGTH), primary_key=True),
        sa.Column("holder", sa.String(HOLDER_LENGTH), nullable=False),
        sa.Column("acquired_at", UtcDateTime(), nullable=False),
        sa.Column("expires_at", UtcDateTime(), nullable=False),
        sa.Column("tick", UtcDateTime(), nullable=True),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "sweep_runs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("namespace", sa.String(NAME_LENGTH), nullable=False),
        sa.Column("name", sa.String(NAME_LENGTH), nullable=False),
        sa.Column("tick", UtcDateTime(), nullable=True),
        sa.Column("holder", sa.String(HOLDER_LENGTH), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("trigger", sa.String(16), nullable=False),
        sa.Column("started_at", UtcDateTime(), nullable=False),
        sa.Column("finished_at", UtcDateTime(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_sweep_runs_name_started", "sweep_runs", ["namespace", "name", "started_at"])
    op.create_index("ix_sweep_runs_status", "sweep_runs", ["namespace", "status"])


def downgrade() -> None:
    op.drop_table("sweep_runs")
    op.drop_table("sweep_leases")
