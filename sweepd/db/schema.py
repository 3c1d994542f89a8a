"""sweepd's tables, as SQLAlchemy Core metadata.

``metadata`` is importable so a host application's own Alembic can see the
tables and leave them alone (``include_object``), while sweepd migrates them
with its own version table. The migrations, not ``create_all``, make them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Dialect,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
)

VERSION_TABLE = "sweepd_alembic_version"
NAME_LENGTH = 128
HOLDER_LENGTH = 255
ERROR_LENGTH = 2000  # error text kept per run, truncated; the log has the rest


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC in Python, whatever the column type underneath.

    PostgreSQL stores ``timestamptz``; MySQL's DATETIME(6) and SQLite's text
    have no zone, so values go in as naive UTC and come back marked UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        if dialect.name == "mysql":
            from sqlalchemy.dialects.mysql import DATETIME

            return dialect.type_descriptor(DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime(timezone=dialect.name == "postgresql"))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("sweepd stores aware datetimes only")
        value = value.astimezone(UTC)
        return value if dialect.name == "postgresql" else value.replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # a text value computed by SQLite itself
            value = datetime.fromisoformat(value)
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


metadata = MetaData()

sweep_leases = Table(
    "sweep_leases",
    metadata,
    Column("namespace", String(NAME_LENGTH), primary_key=True),
    Column("name", String(NAME_LENGTH), primary_key=True),
    Column("holder", String(HOLDER_LENGTH), nullable=False),
    Column("acquired_at", UtcDateTime(), nullable=False),
    Column("expires_at", UtcDateTime(), nullable=False),
    # The last scheduled tick claimed; NULL until one is (manual runs set none).
    Column("tick", UtcDateTime(), nullable=True),
    Column("fencing_token", BigInteger(), nullable=False),
)

sweep_runs = Table(
    "sweep_runs",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("namespace", String(NAME_LENGTH), nullable=False),
    Column("name", String(NAME_LENGTH), nullable=False),
    Column("tick", UtcDateTime(), nullable=True),
    Column("holder", String(HOLDER_LENGTH), nullable=False),
    Column("fencing_token", BigInteger(), nullable=False),
    Column("attempt", Integer(), nullable=False),
    Column("trigger", String(16), nullable=False),  # schedule | manual
    Column("started_at", UtcDateTime(), nullable=False),
    Column("finished_at", UtcDateTime(), nullable=True),
    Column("status", String(16), nullable=False),  # running success failed timeout cancelled lost
    Column("error", Text(), nullable=True),
    Index("ix_sweep_runs_name_started", "namespace", "name", "started_at"),
    Index("ix_sweep_runs_status_name", "namespace", "status", "name"),
)
