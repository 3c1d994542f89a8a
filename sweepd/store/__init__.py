"""The tick store, one per dialect: ``base.TickStore`` is the portable one, which
MySQL/MariaDB use as it is; PostgreSQL and SQLite make each batch one transaction."""

from __future__ import annotations

from sweepd.history import History
from sweepd.lease import LeaseStore
from sweepd.store.base import Ask, Closed, Hand, Opened, Row, Started, TickStore
from sweepd.store.postgresql import PostgresTicks
from sweepd.store.sqlite import SqliteTicks


def tick_store(lease: LeaseStore, history: History, holder: str) -> TickStore:
    """The store for the lease's dialect."""
    dialect = lease.engine.dialect.name
    if dialect == "postgresql":
        return PostgresTicks(lease, history, holder)
    if dialect == "sqlite":
        return SqliteTicks(lease, history, holder)
    return TickStore(lease, history, holder)


__all__ = ["Ask", "Closed", "Hand", "Opened", "Row", "Started", "TickStore", "tick_store"]
