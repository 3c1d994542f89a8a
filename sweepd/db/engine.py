"""Engines, and what every store needs to run SQL on them.

``make_engine`` turns a URL into an engine set up for its dialect; around it
are the database's clock as SQL (``db_now``), the reading of driver errors,
and ``driver_errors`` for the stores that run their hot statements on a
driver cursor (``sweepd/store/``).

Every engine here fails fast: a database that does not answer must fail a
claim within seconds, loudly, rather than hang the daemon while it looks
healthy. Engines run in autocommit, one round trip per statement; the
transactions spelled out are the tick stores' batches.
"""

from __future__ import annotations

import select
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError, SQLAlchemyError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FunctionElement

from sweepd.db.schema import UtcDateTime
from sweepd.db.url import EXTRAS, DatabaseUrlError, check_sqlite_folder, normalize_url
from sweepd.errors import StoreError
from sweepd.redact import mask_in

DEFAULT_TIMEOUT = timedelta(seconds=5)
T = TypeVar("T")


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
        check_sqlite_folder(parsed)
    try:
        engine = create_engine(parsed, **options)
    except ImportError as error:  # SQLAlchemy imports the driver here
        extra = EXTRAS.get(parsed.drivername)
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


# A connection back from the pool after this long is pinged before use.
PING_IDLE_SECONDS = 1.0


def _ping_when_idle(engine: Engine, seconds: float) -> None:
    """Ping a connection back from the pool only if it sat idle, and drop at no
    cost those the server has already hung up on.

    ``pool_pre_ping`` costs a round trip per checkout. A server that restarts
    says goodbye on every connection, which leaves the idle socket readable:
    one ``poll`` at checkout finds those, so the first statement after a
    restart goes on a new connection. One that dies without a word within a
    second of the connection's last use fails that statement, loudly.
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
def driver_errors(connection: Connection, sql: str, params: Any) -> Iterator[None]:
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
