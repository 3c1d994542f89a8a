"""Migrations on every dialect: upgrade, check, and `migrate: never`."""

import pytest
from sqlalchemy import inspect

from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.db.schema import VERSION_TABLE, metadata


def test_upgrade_creates_the_tables_and_is_idempotent(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        assert migrate.current(engine) is None
        with pytest.raises(
            migrate.SchemaError,
            match=r"schema is missing, sweepd needs 0001: run `sweepd db upgrade`",
        ):
            migrate.require_current(engine)
        assert migrate.upgrade(database_url) == (None, migrate.head())
        assert migrate.upgrade(database_url) == (migrate.head(), migrate.head())
        assert migrate.is_current(engine)
        tables = set(inspect(engine).get_table_names())
        assert {"sweep_leases", "sweep_runs", VERSION_TABLE} <= tables
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
