"""The tick store on PostgreSQL: a batch's open is one statement, and so is its close.

One statement is also one transaction: the claim of up to ``limit`` ticks,
the stale-row check and the new ``running`` rows travel together, and so do
the finished rows and the releases. Both run on the driver's cursor
(``driver_rows``): they are every tick's, and SQLAlchemy's execution layer
would be a third of their client CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import Connection, text
from sqlalchemy.exc import SQLAlchemyError

from sweepd.db.engine import driver_errors, retry_deadlocks, store_fault
from sweepd.history import LOST_ERROR, History
from sweepd.lease import MICRO, Claim, LeaseStore, Won, why_lost
from sweepd.store.base import Ask, Batch, Closed, Hand, Opened, TickStore, row_error

# PostgreSQL claims up to :p_limit of a batch of ticks in one statement: the
# same conditions as the single claim, row by row, joined against the wanted
# ticks in this replica's order of preference. SKIP LOCKED passes over rows
# that another replica is claiming or releasing at that instant, so a claimer
# never waits and never deadlocks; such rows, and rows beyond the limit, come
# back undecided and are asked for again. The final SELECT reads the rows as
# they were before the UPDATE, which explains each loss. The CTEs are shared
# with the statements below: ``wanted`` is the ticks asked for, ``won`` the
# rows claimed (name, token).
# Each read of sweep_leases also says ``name = ANY(:p_names)``, which the
# join already implies: a planner without statistics (a new table, before
# autovacuum's first ANALYZE) otherwise reads every lease of the namespace
# once per wanted tick, 8 ms a claim at 1,000 sweeps instead of 0.5.
_CLAIM_CTES = """
    wanted AS (
        SELECT w.name, w.tick, w.micros, w.ord
        FROM unnest(
            CAST(:p_names AS varchar[]),
            CAST(:p_ticks AS timestamptz[]),
            CAST(:p_micros AS bigint[])
        ) WITH ORDINALITY AS w (name, tick, micros, ord)
    ),
    chosen AS (
        SELECT l.name FROM sweep_leases AS l JOIN wanted AS w ON l.name = w.name
        WHERE l.namespace = :p_namespace
          AND l.name = ANY(CAST(:p_names AS varchar[]))
          AND l.expires_at <= statement_timestamp()
          AND w.tick <= statement_timestamp() + :p_tolerance * interval '1 microsecond'
          AND (l.tick IS NULL OR l.tick < w.tick)
        ORDER BY w.ord
        LIMIT :p_limit
        FOR UPDATE OF l SKIP LOCKED
    ),
    won AS (
        UPDATE sweep_leases AS l
        SET holder = :p_holder,
            acquired_at = statement_timestamp(),
            expires_at = statement_timestamp() + w.micros * interval '1 microsecond',
            tick = w.tick,
            fencing_token = l.fencing_token + 1
        FROM wanted AS w
        WHERE l.namespace = :p_namespace
          AND l.name = ANY(CAST(:p_names AS varchar[]))
          AND l.name = w.name
          AND l.name IN (SELECT name FROM chosen)
          AND l.expires_at <= statement_timestamp()
          AND (l.tick IS NULL OR l.tick < w.tick)
        RETURNING l.name, l.fencing_token
    )
"""
# Per wanted tick: the token if won, else the row as it was before the
# statement (what explains a loss), and whether that row was open.
_CLAIM_OUTCOME = """
    w.name, won.fencing_token AS token, l.holder, l.expires_at, l.tick,
    w.tick > statement_timestamp() + :p_tolerance * interval '1 microsecond' AS early,
    l.expires_at <= statement_timestamp() AND (l.tick IS NULL OR l.tick < w.tick) AS open
"""
_CLAIM_JOINS = """
    FROM wanted AS w
    LEFT JOIN won ON won.name = w.name
    LEFT JOIN sweep_leases AS l
        ON l.namespace = :p_namespace
        AND l.name = ANY(CAST(:p_names AS varchar[]))
        AND l.name = w.name
"""
# A batch release locks its rows in name order, so that no two statements
# that wait for row locks can wait on each other in a cycle (a claim never
# waits: SKIP LOCKED); ``held`` is the (name, token) pairs to release, and
# ``name = ANY(:p_names)`` is there for the planner, as in the claim.
_RELEASE_CTES = """
    held AS (
        SELECT h.name, h.token
        FROM unnest(CAST(:p_names AS varchar[]), CAST(:p_tokens AS bigint[])) AS h (name, token)
    ),
    locked AS (
        SELECT l.name FROM sweep_leases AS l JOIN held AS h ON l.name = h.name
        WHERE l.namespace = :p_namespace
          AND l.name = ANY(CAST(:p_names AS varchar[]))
        ORDER BY l.name
        FOR UPDATE OF l
    )
"""
_RELEASE_UPDATE = """
    UPDATE sweep_leases AS l
    SET expires_at = statement_timestamp()
    FROM held AS h
    WHERE l.namespace = :p_namespace
      AND l.name = ANY(CAST(:p_names AS varchar[]))
      AND l.name = h.name
      AND l.name IN (SELECT name FROM locked)
      AND l.holder = :p_holder
      AND l.fencing_token = h.token
    RETURNING l.name
"""


# Claim, mark the won sweeps' stale rows lost, and write their first rows.
_OPEN = text(
    f"""
    WITH {_CLAIM_CTES},
    stale AS (
        UPDATE sweep_runs AS r
        SET status = 'lost', finished_at = statement_timestamp(), error = :p_lost_error
        FROM won
        WHERE r.namespace = :p_namespace
          AND r.name = won.name
          AND r.status = 'running'
          AND r.fencing_token < won.fencing_token
        RETURNING r.name
    ),
    started AS (
        INSERT INTO sweep_runs
            (namespace, name, tick, holder, fencing_token, attempt, trigger, started_at, status)
        SELECT :p_namespace, won.name, w.tick, :p_holder, won.fencing_token, 1, 'schedule',
               statement_timestamp(), 'running'
        FROM won JOIN wanted AS w ON w.name = won.name
        RETURNING id, name
    )
    SELECT {_CLAIM_OUTCOME},
           started.id AS run_id,
           (SELECT count(*) FROM stale WHERE stale.name = w.name) AS lost_runs
    {_CLAIM_JOINS}
    LEFT JOIN started ON started.name = w.name
    """
)

# Finish the rows, then release the leases, as one transaction.
_CLOSE = text(
    f"""
    WITH ended AS (
        SELECT e.id, e.status, e.error
        FROM unnest(
            CAST(:p_ids AS bigint[]), CAST(:p_statuses AS varchar[]), CAST(:p_errors AS text[])
        ) AS e (id, status, error)
    ),
    finished AS (
        UPDATE sweep_runs AS r
        SET status = e.status, finished_at = statement_timestamp(), error = e.error
        FROM ended AS e
        WHERE r.id = e.id AND r.status = 'running'
    ),
    {_RELEASE_CTES}
    {_RELEASE_UPDATE}
    """
)


# A batch statement of more rows than this is planned for its own arrays on
# every run. psycopg prepares a statement after its fifth run, and PostgreSQL
# then keeps a generic plan, which cannot see how long the arrays are: the
# faster plan for a few ticks, and much the slower for a burst of hundreds,
# most already won by other replicas. Revisit if the claim's shape changes.
PLAN_EACH_TIME_OVER = 32


def prepare_for(rows: int) -> bool | None:
    """``driver_rows``' ``prepare`` for a batch statement of that many rows."""
    return False if rows > PLAN_EACH_TIME_OVER else None


def driver_rows(
    connection: Connection, sql: str, params: Mapping[str, Any], *, prepare: bool | None = None
) -> list[Any]:
    """The rows of ``sql`` (in the driver's parameter style), run on the
    connection's driver cursor: SQLAlchemy's execution and result layers are
    a third of a batch's client CPU. A failure comes out as from
    ``Connection.execute``. ``prepare`` is psycopg's (False: plan it afresh).
    """
    dbapi_connection = connection.connection.dbapi_connection
    assert dbapi_connection is not None  # a checked-out connection always has one
    options = {} if prepare is None else {"prepare": prepare}
    with driver_errors(connection, sql, params):
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(sql, params, **options)
            return list(cursor.fetchall())
        finally:
            cursor.close()


def pg_array(values: Iterable[str | int | datetime | None]) -> str:
    """A PostgreSQL array literal of ``values``, for ``CAST(:p AS type[])``.

    psycopg adapts a list element by element: a claim's three lists cost about
    60 us of client CPU, one string each about 8. Every element is quoted and
    escaped, so any text survives (a name ``null`` stays a name), and an aware
    time carries its offset, so the session's time zone cannot shift it.
    """
    parts: list[str] = []
    for value in values:
        if value is None:
            parts.append("NULL")
            continue
        text = value.isoformat() if isinstance(value, datetime) else str(value)
        if "\\" in text or '"' in text:
            text = text.replace("\\", "\\\\").replace('"', '\\"')
        parts.append(f'"{text}"')
    return "{" + ",".join(parts) + "}"


class OpenedRow(NamedTuple):
    """A row of ``_OPEN`` as the driver returns it: per wanted tick, the token if
    won, else the lease row as it was before the statement (what explains a
    loss) and whether it was open; then the new run row and the rows marked lost."""

    name: str
    token: int | None
    holder: str | None
    expires_at: datetime | None
    tick: datetime | None
    early: bool
    open: bool
    run_id: int | None
    lost_runs: int


class PostgresTicks(TickStore):
    def __init__(self, lease: LeaseStore, history: History, holder: str) -> None:
        super().__init__(lease, history, holder)
        # Compiled once, to the driver's own SQL.
        self._open_sql = str(_OPEN.compile(dialect=self.engine.dialect))
        self._close_sql = str(_CLOSE.compile(dialect=self.engine.dialect))

    def open_batch(self, asks: list[Ask], limit: int) -> Batch:
        try:
            with self.engine.connect() as connection:
                found = driver_rows(
                    connection,
                    self._open_sql,
                    self._params(asks, limit),
                    prepare=prepare_for(len(asks)),
                )
        except SQLAlchemyError as error:
            raise store_fault("lease claim", asks[0].sweep.name, self.engine, error) from error
        rows = {row.name: row for row in (OpenedRow(*values) for values in found)}
        results: list[Opened | None] = []
        for ask in asks:
            row = rows[ask.sweep.name]
            claim = _outcome(row, self.holder, ask.tick)
            opened = None if claim is None else Opened(claim)
            if opened is not None and isinstance(claim, Won):
                assert row.run_id is not None  # a won claim's row is written in its statement
                opened.started, opened.lost_runs = int(row.run_id), int(row.lost_runs)
            results.append(opened)
        return results, {name for name, row in rows.items() if row.holder is None}

    def _params(self, asks: list[Ask], limit: int) -> dict[str, Any]:
        return {
            "p_namespace": self.lease.namespace,
            "p_holder": self.holder,
            "p_names": pg_array(ask.sweep.name for ask in asks),
            "p_ticks": pg_array(ask.tick for ask in asks),
            "p_micros": pg_array(ask.sweep.ttl // MICRO for ask in asks),
            "p_tolerance": self.lease.clock_tolerance // MICRO,
            "p_limit": limit,
            "p_lost_error": LOST_ERROR,
        }

    def close(self, hands: list[Hand]) -> list[Closed]:
        endings = [hand.ending for hand in hands if hand.ending is not None]
        params: dict[str, Any] = {
            "p_namespace": self.lease.namespace,
            "p_holder": self.holder,
            "p_ids": pg_array(ending[0] for ending in endings),
            "p_statuses": pg_array(ending[2] for ending in endings),
            "p_errors": pg_array(ending[3] for ending in endings),
            "p_names": pg_array(hand.name for hand in hands),
            "p_tokens": pg_array(hand.token for hand in hands),
        }

        def close() -> set[str]:
            with self.engine.connect() as connection:
                rows = driver_rows(
                    connection, self._close_sql, params, prepare=prepare_for(len(hands))
                )
                return {name for (name,) in rows}

        try:
            freed = retry_deadlocks(close)
        except SQLAlchemyError as error:
            # One statement: neither the rows nor the releases went through.
            fault = str(store_fault("run finish", hands[0].name, self.engine, error))
            return [Closed(row_error(hand, fault), False, fault) for hand in hands]
        return [Closed(None, hand.name in freed) for hand in hands]


def _outcome(row: OpenedRow, holder: str, tick: datetime | None) -> Claim | None:
    """One wanted tick's claim. None: not decided, because the lease has no row
    yet (a first claim, which the single claim makes) or its row was open but
    beyond the limit or busy at that instant (ask again)."""
    if row.token is not None:
        return Won(token=int(row.token), holder=holder, tick=tick)
    if row.holder is None or (row.open and not row.early):
        return None
    # The driver gives timestamptz in the session's time zone; sweepd speaks UTC.
    return why_lost((row.holder, _utc(row.expires_at), _utc(row.tick), row.early), tick)


def _utc(value: datetime | None) -> datetime | None:
    return None if value is None else value.astimezone(UTC)
