"""The tick store on SQLite: a batch's open is one write transaction, and so is its close.

SQLite runs in the process, so a statement costs no round trip, and around
one short statement SQLAlchemy's layers cost several times the statement
itself. So the steps of a batch are the lease's and the history's own
statements (written once, in ``sweepd.lease`` and ``sweepd.history``),
compiled for the driver's cursor and run inside ``BEGIN IMMEDIATE``
(``sqlite_write``): all or nothing, for one commit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql import ClauseElement

from sweepd.db.engine import driver_errors, store_fault
from sweepd.db.schema import UtcDateTime
from sweepd.history import RUN_SQL, History
from sweepd.lease import MICRO, Claim, LeaseStore, Won, why_lost
from sweepd.store.base import Ask, Batch, Closed, Hand, Opened, TickStore, row_error


class DriverStatement:
    """A Core statement compiled once to the driver's own SQL, for a driver cursor.

    SQLite's compiled form uses named parameters, which its driver takes
    from a mapping and, unlike positions, ignores when unused: one mapping
    can serve a claim and the reading that explains its loss.
    """

    def __init__(self, statement: ClauseElement, dialect: Dialect) -> None:
        if dialect.name == "sqlite":
            dialect = _SQLITE_NAMED
        compiled = statement.compile(dialect=dialect)
        self.sql = str(compiled)
        # Values the statement carries itself (a literal status, the 1 of token + 1).
        self.fixed = {k: v for k, v in compiled.params.items() if v is not None}

    def params(self, **values: Any) -> dict[str, Any]:
        return {**self.fixed, **values}


_SQLITE_NAMED = sqlite_dialect.dialect(paramstyle="named")


def driver_times(
    dialect: Dialect,
) -> tuple[Callable[[datetime | None], Any], Callable[[Any], datetime | None]]:
    """An aware time to the driver's value and back, as SQLAlchemy would convert
    it, for a ``DriverStatement``: SQLite keeps times as text whose layout its
    comparisons depend on."""
    impl = UtcDateTime().dialect_impl(dialect)
    to_driver, from_driver = impl.bind_processor(dialect), impl.result_processor(dialect, None)
    assert to_driver is not None and from_driver is not None
    return to_driver, from_driver


@contextmanager
def sqlite_write(connection: Connection) -> Iterator[Any]:
    """A driver cursor inside ``BEGIN IMMEDIATE`` ... ``COMMIT`` on a SQLite connection.

    IMMEDIATE takes the file's one write lock before the first statement, so
    no other writer changes what they read before they commit, and the batch
    pays one commit. On a failure the transaction is rolled back, or else the
    connection invalidated: back in the pool mid-transaction, it would keep
    the write lock and stall every writer of the file.
    """
    dbapi_connection = connection.connection.dbapi_connection
    assert dbapi_connection is not None  # a checked-out connection always has one
    with driver_errors(connection, "BEGIN IMMEDIATE", None):
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("BEGIN IMMEDIATE")
            try:
                yield cursor
                cursor.execute("COMMIT")
            except BaseException as error:
                try:
                    dbapi_connection.rollback()
                except Exception:
                    connection.invalidate(error if isinstance(error, Exception) else None)
                raise
        finally:
            cursor.close()


class SqliteTicks(TickStore):
    def __init__(self, lease: LeaseStore, history: History, holder: str) -> None:
        super().__init__(lease, history, holder)
        dialect = self.engine.dialect
        self._claim_in = DriverStatement(lease.sql.claim_tick, dialect)
        self._explain_in = DriverStatement(lease.sql.explain, dialect)
        self._release_in = DriverStatement(lease.sql.release, dialect)
        self._stale_in = DriverStatement(RUN_SQL.stale_of, dialect)
        self._mark_lost_in = DriverStatement(RUN_SQL.mark_lost, dialect)
        self._start_in = DriverStatement(RUN_SQL.start, dialect)
        self._finish_in = DriverStatement(RUN_SQL.finish, dialect)
        self._time_in, self._time_out = driver_times(dialect)

    def open_batch(self, asks: list[Ask], limit: int) -> Batch:
        try:
            with self.engine.connect() as connection, sqlite_write(connection) as cursor:
                claims, unseen = self._claim_all(cursor, asks, limit)
                results = [None if claim is None else Opened(claim) for claim in claims]
                for ask, opened in zip(asks, results, strict=True):
                    if opened is not None and isinstance(opened.claim, Won):
                        token = opened.claim.token
                        opened.lost_runs = self._mark_stale(cursor, ask.sweep.name, token)
                        opened.started = self._write_row(cursor, ask, token)
        except SQLAlchemyError as error:
            raise store_fault("lease claim", asks[0].sweep.name, self.engine, error) from error
        return results, unseen

    def _claim_all(
        self, cursor: Any, asks: list[Ask], limit: int
    ) -> tuple[list[Claim | None], set[str]]:
        """Claim at most ``limit`` of the asks, in order. None: not decided, being
        beyond the limit or without a lease row yet (those names are returned)."""
        results: list[Claim | None] = []
        unseen: set[str] = set()
        won = 0
        for ask in asks:
            if won >= limit:
                results.append(None)
                continue
            params = self._claim_in.params(
                p_namespace=self.lease.namespace,
                p_name=ask.sweep.name,
                p_holder=self.holder,
                p_micros=ask.sweep.ttl // MICRO,
                p_tick=self._time_in(ask.tick),
                p_tolerance=self.lease.clock_tolerance // MICRO,
            )
            cursor.execute(self._claim_in.sql, params)
            row = cursor.fetchone()
            if row is not None:
                won += 1
                results.append(Won(token=int(row[0]), holder=self.holder, tick=ask.tick))
                continue
            cursor.execute(
                self._explain_in.sql, params
            )  # the same mapping: unused keys are ignored
            found = cursor.fetchone()
            if found is None:
                unseen.add(ask.sweep.name)
                results.append(None)
                continue
            holder, expires_at, last, early = found
            seen = (holder, self._time_out(expires_at), self._time_out(last), early)
            results.append(why_lost(seen, ask.tick))
        return results, unseen

    def _mark_stale(self, cursor: Any, name: str, token: int) -> int:
        """Mark the sweep's rows left running under an older token lost; how many."""
        cursor.execute(
            self._stale_in.sql, self._stale_in.params(p_namespace=self.lease.namespace, p_name=name)
        )
        stale = [run_id for run_id, older in cursor.fetchall() if older < token]
        for run_id in stale:
            cursor.execute(self._mark_lost_in.sql, self._mark_lost_in.params(p_id=run_id))
        return len(stale)

    def _write_row(self, cursor: Any, ask: Ask, token: int) -> int:
        params = self._start_in.params(
            p_namespace=self.lease.namespace,
            p_name=ask.sweep.name,
            p_tick=self._time_in(ask.tick),
            p_holder=self.holder,
            p_token=token,
            p_attempt=1,
            p_trigger=ask.trigger,
        )
        cursor.execute(self._start_in.sql, params)
        return int(cursor.lastrowid)

    def close(self, hands: list[Hand]) -> list[Closed]:
        freed: list[bool] = []
        try:
            with self.engine.connect() as connection, sqlite_write(connection) as cursor:
                for hand in hands:
                    if hand.ending is not None:
                        run_id, _, status, error = hand.ending
                        ending = self._finish_in.params(p_id=run_id, p_status=status, p_error=error)
                        cursor.execute(self._finish_in.sql, ending)
                for hand in hands:
                    mine = self._release_in.params(
                        p_namespace=self.lease.namespace,
                        p_name=hand.name,
                        p_holder=self.holder,
                        p_token=hand.token,
                    )
                    cursor.execute(self._release_in.sql, mine)
                    freed.append(cursor.rowcount == 1)
        except SQLAlchemyError as error:
            # One transaction: neither the rows nor the releases went through.
            fault = str(store_fault("run finish", hands[0].name, self.engine, error))
            return [Closed(row_error(hand, fault), False, fault) for hand in hands]
        return [Closed(None, released) for released in freed]
