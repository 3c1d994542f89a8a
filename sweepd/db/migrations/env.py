"""Alembic's entry point for sweepd's own migrations.

Run through ``sweepd.db.migrate``, which hands over either a live connection
(``upgrade``) or a dialect name for offline SQL (``db sql``). The version
table is sweepd's own, so these migrations can share a database with the
host application's Alembic history without touching it.
"""

from __future__ import annotations

from typing import Any

from alembic import context

from sweepd.db.schema import VERSION_TABLE, metadata

config = context.config
connection = config.attributes.get("connection")
# Offline (no connection): render SQL for the named dialect, values inlined.
target: dict[str, Any] = (
    {"connection": connection}
    if connection is not None
    else {"dialect_name": config.attributes["dialect"], "literal_binds": True}
)
context.configure(
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    transaction_per_migration=True,
    **target,
)
with context.begin_transaction():
    context.run_migrations()
