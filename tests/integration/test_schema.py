"""Migrations on every dialect: upgrade, check, and `migrate: never`."""

import fcntl
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url

from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.db.schema import VERSION_TABLE, metadata, sweep_runs


def test_upgrade_creates_the_tables_and_is_idempotent(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        assert migrate.current(engine) is None
        with pytest.raises(
            migrate.SchemaError,
            match=r"schema is missing, sweepd needs 0002: run `sweepd db upgrade`",
        ):
            migrate.require_current(engine)
        assert migrate.upgrade(database_url) == (None, migrate.head())
        assert migrate.upgrade(database_url) == (migrate.head(), migrate.head())
        assert migrate.is_current(engine)
        tables = set(inspect(engine).get_table_names())
        assert {"sweep_leases", "sweep_runs", VERSION_TABLE} <= tables
    finally:
        engine.dispose()


@pytest.mark.slow
def test_replicas_that_upgrade_at_once_all_succeed(database_url: str) -> None:
    """`migrate: auto` on every replica of a fresh deploy: one migrates, the rest wait."""
    command = [sys.executable, "-m", "sweepd", "db", "upgrade", "--database", database_url]
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(4)
    ]
    outputs = [(p.communicate(timeout=60)[0].decode(), p.returncode) for p in processes]
    assert [code for _, code in outputs] == [0] * 4, outputs
    engine = make_engine(database_url)
    try:
        assert migrate.is_current(engine)
    finally:
        engine.dispose()


@pytest.mark.parametrize("dialect", ["sqlite"], indirect=True)
def test_sqlite_upgrade_opens_nothing_until_it_holds_the_lock(database_url: str) -> None:
    # Opening the file can already write to it (turning it to WAL), and two
    # processes doing that at once may fail with "database is locked" without
    # waiting, so the file must stay untouched while another process migrates.
    database = make_url(database_url).database
    assert database is not None
    with open(migrate.lock_path(database), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        upgrading = threading.Thread(target=migrate.upgrade, args=(database_url,))
        upgrading.start()
        upgrading.join(0.5)
        assert upgrading.is_alive()
        assert not Path(database).exists()
        fcntl.flock(held, fcntl.LOCK_UN)
    upgrading.join(30)
    assert not upgrading.is_alive()
    engine = make_engine(database_url)
    try:
        assert migrate.is_current(engine)
    finally:
        engine.dispose()


def test_the_migration_matches_the_metadata(database_url: str) -> None:
    """What the migration creates is what the code's metadata describes, column by column."""
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    try:
        inspector = inspect(engine)
        for table in metadata.sorted_tables:
            found = {column["name"]: column for column in inspector.get_columns(table.name)}
            assert set(found) == set(table.columns.keys()), table.name
            for column in table.columns:
                assert found[column.name]["nullable"] == column.nullable, (table.name, column.name)
    finally:
        engine.dispose()


@pytest.mark.parametrize("dialect_name", ["postgresql", "mysql", "sqlite"])
def test_offline_sql_has_both_tables(dialect_name: str) -> None:
    ddl = migrate.sql(dialect_name)
    assert "CREATE TABLE sweep_leases" in ddl
    assert "CREATE TABLE sweep_runs" in ddl
    assert VERSION_TABLE in ddl


def test_a_database_at_0001_with_history_upgrades_to_head(database_url: str) -> None:
    engine = make_engine(database_url, autocommit=False)
    try:
        with engine.connect() as connection:
            config = migrate._config()
            config.attributes["connection"] = connection
            command.upgrade(config, "0001")
            connection.execute(
                sweep_runs.insert().values(
                    namespace="n",
                    name="s",
                    holder="h",
                    fencing_token=1,
                    attempt=1,
                    trigger="schedule",
                    started_at=datetime(2026, 1, 1, tzinfo=UTC),
                    status="running",
                )
            )
            connection.commit()
        assert migrate.upgrade(database_url) == ("0001", migrate.head())
        indexes = {ix["name"] for ix in inspect(engine).get_indexes("sweep_runs")}
        assert "ix_sweep_runs_status_name" in indexes
        assert "ix_sweep_runs_status" not in indexes
        with engine.connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM sweep_runs")).scalar() == 1
    finally:
        engine.dispose()
