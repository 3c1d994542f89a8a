"""Schema migrations: upgrade, check, and the DDL for a DBA.

Alembic runs sweepd's own migrations with sweepd's own version table. Several
replicas may start at once with ``migrate: auto``, so ``upgrade`` first takes
a lock that the database holds for one connection (an advisory lock on
PostgreSQL, GET_LOCK on MySQL, a lock file beside a SQLite file): the first
replica migrates, the others wait, then find the schema current and do
nothing. On SQLite the lock file is taken before the first connection: even
opening the file can write to it (turning it to WAL), and two processes that
both do that at once can fail with "database is locked" at once, without
waiting on the busy timeout.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

from sweepd.db.engine import make_engine, store_fault
from sweepd.db.schema import VERSION_TABLE
from sweepd.errors import DatabaseFileError, SweepdError

LOCK_WAIT_SECONDS = 120
_LOCK_NAME = "sweepd.migrate"
_PG_LOCK_KEY = 0x5357_4550_4D49_4752 & 0x7FFF_FFFF_FFFF_FFFF  # "SWEPMIGR", a fixed bigint


class SchemaError(SweepdError):
    """The database schema is missing or not current: run `sweepd db upgrade`."""


def _config(output: io.StringIO | None = None) -> Config:
    config = Config(output_buffer=output)
    config.set_main_option("script_location", "sweepd.db:migrations")
    return config


def head() -> str:
    found = ScriptDirectory.from_config(_config()).get_current_head()
    assert found is not None
    return found


def current(engine: Engine) -> str | None:
    """The revision the database is at; None when sweepd's tables were never made."""
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
            return context.get_current_revision()
    except SQLAlchemyError as error:
        raise store_fault("schema check", None, engine, error) from error


def is_current(engine: Engine) -> bool:
    return current(engine) == head()


def require_current(engine: Engine) -> None:
    """For ``migrate: never``: fail loudly, naming the fix, unless the schema is at head."""
    found, wanted = current(engine), head()
    if found != wanted:
        state = "missing" if found is None else f"at revision {found}"
        raise SchemaError(
            f"the database schema is {state}, sweepd needs {wanted}: run `sweepd db upgrade`"
        )


def upgrade(url: str) -> tuple[str | None, str]:
    """Bring the schema to head under the migration lock; return (before, after)."""
    engine = make_engine(url, autocommit=False)
    try:
        with _migration_lock(engine) as connection:
            return _upgrade(connection)
    except SQLAlchemyError as error:
        raise store_fault("schema upgrade", None, engine, error) from error
    finally:
        engine.dispose()


def _upgrade(connection: Connection) -> tuple[str | None, str]:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    before = context.get_current_revision()
    connection.commit()
    config = _config()
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
    connection.commit()
    return before, head()


def sql(dialect: str) -> str:
    """The DDL ``upgrade`` would run on an empty database of ``dialect``."""
    output = io.StringIO()
    config = _config(output)
    config.attributes["dialect"] = dialect
    command.upgrade(config, "head", sql=True)
    return output.getvalue()


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[Connection]:
    """A connection, held while no other process is migrating this database."""
    backend = engine.dialect.name
    if backend == "sqlite":
        with _sqlite_lock(engine.url.database), engine.connect() as connection:
            yield connection
        return
    with engine.connect() as connection:
        if backend == "postgresql":
            connection.execute(text("SET lock_timeout = '0'"))  # wait for the migrating replica
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _PG_LOCK_KEY})
            connection.commit()
            try:
                yield connection
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _PG_LOCK_KEY})
                connection.commit()
        else:
            got = connection.execute(
                text("SELECT GET_LOCK(:name, :wait)"),
                {"name": _LOCK_NAME, "wait": LOCK_WAIT_SECONDS},
            ).scalar()
            connection.commit()
            if got != 1:
                raise SweepdError(
                    f"another process held the migration lock for over {LOCK_WAIT_SECONDS}s"
                )
            try:
                yield connection
            finally:
                connection.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": _LOCK_NAME})
                connection.commit()


@contextlib.contextmanager
def _sqlite_lock(database: str | None) -> Iterator[None]:
    if not database or database == ":memory:":
        yield  # a private in-memory database has no one to race
        return
    path = lock_path(database)
    try:
        lock = open(path, "a")  # noqa: SIM115 (the with below closes it)
    except OSError as error:
        # make_engine has checked the folder; what is left (a read-only file,
        # a folder gone since) still deserves one line naming the file.
        raise DatabaseFileError(f"migration lock {path}: {error.strerror or error}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def lock_path(database: str) -> Path:
    """The file beside a SQLite database that ``upgrade`` locks."""
    return Path(database).with_name(Path(database).name + ".migrate-lock")
