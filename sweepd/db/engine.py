"""Engines and the helpers the stores share to run SQL on them.

``make_engine`` turns a URL into an engine set up for its dialect; around it
are the database's clock as SQL (``db_now``), the reading of driver errors,
and the driver-cursor path the hot statements take. The stores themselves
(lease.py, ticks.py, history.py) own their SQL and its per-dialect forms.

Every engine here fails fast: a database that does not answer must fail a
claim within seconds, loudly, rather than hang the daemon while it looks
healthy. Lease statements are single statements, so engines run in
autocommit: one round trip per statement, no BEGIN/COMMIT around it. The
one transaction spelled out is SQLite's batch of claims and run rows
(``sqlite_write``), whose statements must land together.
"""

from __future__ import annotations

import os
import select
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Dialect, Engine, create_engine, event
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, DisconnectionError, SQLAlchemyError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FunctionElement

from sweepd.db.schema import UtcDateTime
from sweepd.errors import DatabaseFileError, StoreError, UsageError
from sweepd.redact import mask_in, mask_url

DEFAULT_TIMEOUT = timedelta(seconds=5)
T = TypeVar("T")

# Bare schemes mean our drivers: psycopg 3 and PyMySQL, not SQLAlchemy's defaults.
_DRIVERS = {
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "mysql": "mysql+pymysql",
    "mariadb": "mysql+pymysql",
    "mariadb+pymysql": "mysql+pymysql",
}
# The extra that installs each of our drivers: a plain `pip install sweepd` has neither.
_EXTRAS = {"postgresql+psycopg": "postgres", "mysql+pymysql": "mysql"}


class DatabaseUrlError(UsageError):
    """The database URL cannot be used."""


def normalize_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseUrlError(f"invalid database URL {mask_url(url)!r}") from None
    driver = _DRIVERS.get(parsed.drivername)
    if driver is not None:
        parsed = parsed.set(drivername=driver)
    if parsed.get_backend_name() not in ("sqlite", "postgresql", "mysql"):
        raise DatabaseUrlError(
            f"unsupported database {parsed.get_backend_name()!r} in {mask_url(url)!r}"
        )
    return parsed


def make_engine(
    url: str, *, timeout: timedelta = DEFAULT_TIMEOUT, autocommit: bool = True
) -> Engine:
    """An engine with timeouts on connect and on every statement."""
    parsed = normalize_url(url)
    seconds = max(1, int(timeout.total_seconds()))
    backend = parsed.get_backend_name()
    options: dict[str, Any] = {}
    if autocommit:
        options["isolation_level"] = "AUTOCOMMIT"
        # Nothing to roll back in autocommit; PyMySQL would spend a round trip on it.
        options["skip_autocommit_rollback"] = True
    options["connect_args"] = _connect_args(backend, seconds)
    if backend == "sqlite":
        _check_sqlite_folder(parsed)
    try:
        engine = create_engine(parsed, **options)
    except ImportError as error:  # SQLAlchemy imports the driver here
        extra = _EXTRAS.get(parsed.drivername)
        fix = f"pip install 'sweepd[{extra}]'" if extra else "install it"
        why = (str(error).splitlines() or [""])[0]  # psycopg's lists every attempt, a line each
        raise DatabaseUrlError(
            f"the database driver for {parsed.drivername} is not installed ({why}): {fix}"
        ) from None
    _ping_when_idle(engine, PING_IDLE_SECONDS)
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_on_connect(seconds))
    return engine


def _connect_args(backend: str, seconds: int) -> dict[str, Any]:
    """The driver's own bounds on connecting and on every statement."""
    if backend == "postgresql":
        return {
            "connect_timeout": seconds,
            "application_name": "sweepd",
            # Server-side bounds: a statement blocked on a lock or a slow plan
            # is cancelled by the server and raises, instead of waiting forever.
            # lock_timeout a little below, so a blocked claim says it was a lock.
            "options": f"-c statement_timeout={seconds * 1000} -c lock_timeout={seconds * 1000 - 100}",
            # A dead host or a cut network: TCP itself gives up within a few
            # seconds instead of the kernel's default of many minutes.
            "keepalives": 1,
            "keepalives_idle": seconds,
            "keepalives_interval": 1,
            "keepalives_count": 3,
            "tcp_user_timeout": seconds * 2000,
        }
    if backend == "mysql":
        return {
            "connect_timeout": seconds,
            # Client-side bounds: PyMySQL gives up on a server that stops answering.
            "read_timeout": seconds * 2,
            "write_timeout": seconds * 2,
            "init_command": f"SET SESSION time_zone = '+00:00', innodb_lock_wait_timeout = {seconds}",
        }
    return {"timeout": seconds}  # SQLite's busy wait


def _check_sqlite_folder(url: URL) -> None:
    """Refuse a SQLite file whose folder cannot hold it, naming the path and why.

    SQLite itself says only "unable to open database file", and the migration
    lock beside the file fails before it. The folder must be writable, not
    only the file: WAL keeps two more files beside the database.
    """
    database = url.database
    if not database or database == ":memory:" or url.query.get("uri"):
        return  # in memory, or a URI filename that SQLite resolves itself
    path = os.path.abspath(database)
    folder = os.path.dirname(path)
    if not os.path.exists(folder):
        wrong = f"the folder {folder} does not exist"
    elif not os.path.isdir(folder):
        wrong = f"{folder} is a file, not a folder"
    elif not os.access(folder, os.W_OK | os.X_OK):
        wrong = f"the folder {folder} is not writable"
    else:
        return
    raise DatabaseFileError(f"database file {path}: {wrong}")


# A connection back from the pool after this long is pinged before use.
PING_IDLE_SECONDS = 1.0


def _ping_when_idle(engine: Engine, seconds: float) -> None:
    """Pre-ping, but only connections that sat idle in the pool, and drop at
    no cost those the server has already hung up on.

    SQLAlchemy's ``pool_pre_ping`` pings on every checkout, one extra round
    trip per lease statement. A connection used within the last second is
    not worth it; a connection idle longer (between ticks) is pinged, and a
    dead one swapped for a new one before the claim sees it. A server that
    restarts or shuts down says goodbye on every connection (PostgreSQL's
    "terminating connection due to administrator command", or just the
    socket's end), which leaves the idle socket readable: one ``poll`` of it
    at checkout finds those, however recently used, so the first statement
    after a restart goes on a new connection instead of failing. What is
    left is a server that dies without a word in the second since the
    connection's last use: that statement fails, loudly, and the pool
    replaces the connection.
    """

    def on_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None:
            return  # just made
        if _hung_up(dbapi_connection):
            # The pool's own signal: drop this connection, hand out a fresh one.
            raise DisconnectionError("the server closed this connection while it was pooled")
        if time.monotonic() - idle_since <= seconds:
            return  # just used
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as error:
            raise DisconnectionError(str(error)) from error

    event.listen(engine, "checkin", on_checkin)
    event.listen(engine, "checkout", on_checkout)


def _hung_up(dbapi_connection: Any) -> bool:
    """Whether the server wrote to, or closed, a connection that nobody is using.

    An idle connection owes the client nothing, so anything to read on it is
    the server's goodbye. SQLite has no socket: never hung up.
    """
    try:
        if callable(getattr(dbapi_connection, "fileno", None)):  # psycopg
            fd = int(dbapi_connection.fileno())
        elif hasattr(dbapi_connection, "_sock"):  # PyMySQL, None once closed
            fd = dbapi_connection._sock.fileno()
        else:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except Exception:
        return True  # the driver already knows it is closed


def _sqlite_on_connect(seconds: int) -> Any:
    def on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        # WAL lets readers and one writer work at once, so several processes on
        # one host coordinate through one file; busy_timeout makes a writer wait
        # for the lock instead of failing at once.
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={seconds * 1000}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return on_connect


# -- the database's clock ---------------------------------------------------------------
#
# Every lease comparison is made against the database's own clock, inside the
# statement, so replicas whose clocks disagree still agree on who holds what.


class db_now(FunctionElement[Any]):
    """The database's current time, at sub-second resolution."""

    type = UtcDateTime()
    inherit_cache = True


class db_now_plus(FunctionElement[Any]):
    """The database's current time plus a duration (given in microseconds)."""

    type = UtcDateTime()
    inherit_cache = True


# SQLite keeps datetimes as text in SQLAlchemy's layout, 'YYYY-MM-DD HH:MM:SS.ffffff';
# strftime's %f gives milliseconds ('SS.SSS'), so three zeros complete the layout and
# text order stays time order.
_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now'{}) || '000'"


@compiles(db_now, "postgresql")
def _now_pg(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "statement_timestamp()"


@compiles(db_now, "mysql")
def _now_mysql(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "UTC_TIMESTAMP(6)"


@compiles(db_now, "sqlite")
def _now_sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return _SQLITE_NOW.format("")


def _micros_param(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    (micros,) = element.clauses
    return str(compiler.process(micros, **kw))


@compiles(db_now_plus, "postgresql")
def _plus_pg(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    return f"(statement_timestamp() + {_micros_param(element, compiler, **kw)} * interval '1 microsecond')"


@compiles(db_now_plus, "mysql")
def _plus_mysql(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    return f"(UTC_TIMESTAMP(6) + INTERVAL {_micros_param(element, compiler, **kw)} MICROSECOND)"


@compiles(db_now_plus, "sqlite")
def _plus_sqlite(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    modifier = f"printf('%+.6f seconds', {_micros_param(element, compiler, **kw)} / 1000000.0)"
    return _SQLITE_NOW.format(", " + modifier)


# -- reading errors -------------------------------------------------------------------------


def is_duplicate_key(error: DBAPIError) -> bool:
    """Whether an INSERT failed only because the row already exists: the lost race."""
    orig = error.orig
    # PostgreSQL's unique_violation. PyMySQL sets sqlstate too, to MySQL's
    # generic 23000, so that case must fall through to its error number.
    if getattr(orig, "sqlstate", None) == "23505":  # psycopg
        return True
    if isinstance(orig, sqlite3.IntegrityError):
        return getattr(orig, "sqlite_errorname", "") in (
            "SQLITE_CONSTRAINT_PRIMARYKEY",
            "SQLITE_CONSTRAINT_UNIQUE",
        )
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return bool(args) and args[0] == 1062  # MySQL ER_DUP_ENTRY


def store_fault(
    operation: str, name: str | None, engine: Engine, error: SQLAlchemyError
) -> StoreError:
    """A driver's exception as one line naming what failed, with no password in it."""
    orig = getattr(error, "orig", None) or error
    first_line = (str(orig).strip().splitlines() or [""])[0]
    url = engine.url.render_as_string(hide_password=False)
    subject = f"{operation} for {name!r}" if name else operation
    message = mask_in(f"{subject} failed: {type(orig).__name__}: {first_line}", url)
    # Retry only what may pass: lost connections and timeouts. A missing table
    # or a wrong column is not going to fix itself on the next tick.
    if isinstance(orig, sqlite3.Error):
        # SQLite says OperationalError for "no such table" too: go by its code.
        transient = getattr(orig, "sqlite_errorname", "").startswith(
            ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_PROTOCOL")
        )
    else:
        transient = (
            not isinstance(error, DBAPIError)
            or error.connection_invalidated
            or type(error).__name__ in ("OperationalError", "InterfaceError")
        )
    return StoreError(message, transient=transient)


@contextmanager
def _driver_errors(connection: Connection, sql: str, params: Any) -> Iterator[None]:
    """Raise the driver's exceptions as ``Connection.execute`` would: a
    ``DBAPIError`` around them, and a connection the dialect calls dead
    invalidated, so the pool never hands it out again."""
    dialect = connection.dialect
    dbapi_connection = connection.connection.dbapi_connection
    try:
        yield
    except dialect.loaded_dbapi.Error as error:
        if not connection.invalidated and dialect.is_disconnect(error, dbapi_connection, None):
            connection.invalidate(error)
        raise DBAPIError.instance(
            sql,
            params,
            error,
            dialect.loaded_dbapi.Error,
            connection_invalidated=connection.invalidated,
            dialect=dialect,
        ) from error


# A batch statement of more rows than this is planned for its own arrays on
# every run. psycopg prepares a statement after its fifth run, and PostgreSQL
# then keeps a generic plan, which cannot see how long the arrays are. For 16
# ticks that plan is the faster (0.9 ms against 1.4 for planning each time);
# for 200 ticks, 67 of them won, it took 15 ms where a plan for the arrays took 6.
PLAN_EACH_TIME_OVER = 32


def prepare_for(rows: int) -> bool | None:
    """``driver_rows``' ``prepare`` for a batch statement of that many rows."""
    return False if rows > PLAN_EACH_TIME_OVER else None


def driver_rows(
    connection: Connection, sql: str, params: Mapping[str, Any], *, prepare: bool | None = None
) -> list[Any]:
    """Run ``sql`` (in the driver's own parameter style) on the connection's
    driver cursor and return its rows as the driver gives them.

    For the daemon's few hot statements only: SQLAlchemy's execution and
    result layers are about a third of such a call's client CPU, paid on
    every tick. A failure comes out as from ``Connection.execute``.
    ``prepare`` is psycopg's: False plans the statement afresh for these
    parameters, where by default it is prepared after its fifth run.
    """
    dbapi_connection = connection.connection.dbapi_connection
    assert dbapi_connection is not None  # a checked-out connection always has one
    options = {} if prepare is None else {"prepare": prepare}
    with _driver_errors(connection, sql, params):
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(sql, params, **options)
            return list(cursor.fetchall())
        finally:
            cursor.close()


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

    For statements that must land together, or not at all. IMMEDIATE takes
    the file's one write lock before the first statement (waiting up to the
    busy timeout), so what they read no other writer changes before they
    commit, and the whole batch pays one commit instead of one each. On any
    failure the transaction is rolled back; if even that fails the
    connection is invalidated, since one returned to the pool mid-transaction
    would keep the write lock and stall every writer of the file.
    """
    dbapi_connection = connection.connection.dbapi_connection
    assert dbapi_connection is not None  # a checked-out connection always has one
    with _driver_errors(connection, "BEGIN IMMEDIATE", None):
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


def pg_array(values: Iterable[str | int | datetime | None]) -> str:
    """A PostgreSQL array literal of ``values``, for ``CAST(:p AS type[])``.

    psycopg adapts a Python list element by element, finding a dumper for
    each: a claim's three short lists cost about 60 us of client CPU, one
    string each about 8, and the server parses either just as fast. Every
    element is quoted, with backslashes before quotes and backslashes, so
    any text survives (a name ``null`` stays a name); an aware time is
    written with its offset, so the session's time zone cannot shift it.
    A claim sends three of these, an element in each for every tick it asks
    about: hence one loop, and no call per element.
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


def is_deadlock(error: DBAPIError) -> bool:
    """A deadlock or lock-wait victim: the statement may simply be run again."""
    orig = error.orig
    if getattr(orig, "sqlstate", None) in ("40P01", "40001"):  # psycopg
        return True
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return bool(args) and args[0] in (1213, 1205)  # MySQL deadlock, lock wait timeout


def retry_deadlocks(call: Callable[[], T], attempts: int = 3) -> T:
    """Run an idempotent statement again when the database picked it as a deadlock victim."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except DBAPIError as error:
            if attempt == attempts or not is_deadlock(error):
                raise
            time.sleep(0.01 * attempt)
    raise AssertionError("unreachable")
