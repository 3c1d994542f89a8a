"""Real databases for the tests (a SQLite file, PostgreSQL and MariaDB), and the clock shim.

Each test that asks for ``database_url`` gets a database of its own, created
for it and dropped after, so no test sees another's leases. A server that is
not running skips its tests on a laptop but fails them in CI, where every
dialect must be exercised.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from sweepd.db import migrate
from sweepd.db.engine import make_engine

if TYPE_CHECKING:
    from daemon_harness import Cluster

IN_CI = os.environ.get("CI") == "true"
MakeDatabase = Callable[[str], str]
SERVERS = {
    "postgresql": os.environ.get(
        "SWEEPD_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    "mariadb": os.environ.get("SWEEPD_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test"),
}
DIALECTS = ["sqlite", "postgresql", "mariadb"]
SHIM_SOURCE = Path(__file__).parent / "system" / "fakeclock.c"


def _server_or_skip(dialect: str) -> str:
    admin_url = SERVERS[dialect]
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except OperationalError as error:
        message = f"{dialect} is not reachable at {admin_url}: {error.orig}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    finally:
        engine.dispose()
    return admin_url


@pytest.fixture
def make_database(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """``make_database(dialect) -> url`` of a new, empty database, dropped at teardown."""
    created: list[tuple[str, str, str]] = []

    def make(dialect: str) -> str:
        if dialect == "sqlite":
            return f"sqlite:///{tmp_path / f'sweepd-{secrets.token_hex(3)}.db'}"
        admin_url = _server_or_skip(dialect)
        name = f"sweepd_test_{secrets.token_hex(6)}"
        engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(text(f"CREATE DATABASE {name}"))
        engine.dispose()
        created.append((dialect, admin_url, name))
        return admin_url.rsplit("/", 1)[0] + f"/{name}"

    yield make

    for dialect, admin_url, name in created:
        engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            if dialect == "postgresql":
                # Connections still open here are a leak in the code under test
                # (an engine never disposed); name them, then clean up anyway.
                leaked = connection.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE datname = :name"),
                    {"name": name},
                ).scalar_one()
                connection.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
                assert leaked == 0, f"{leaked} connection(s) to {name} left open"
            else:
                connection.execute(text(f"DROP DATABASE {name}"))
        engine.dispose()


@pytest.fixture(params=DIALECTS)
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(dialect: str, make_database: Callable[[str], str]) -> str:
    """A fresh, empty database of each dialect in turn."""
    return make_database(dialect)


@pytest.fixture(scope="session")
def fakeclock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fakeclock LD_PRELOAD shim, compiled once; CI must have gcc, so there a miss fails."""
    gcc = shutil.which("gcc")
    if gcc is None:
        reason = "gcc is needed to build the fakeclock LD_PRELOAD shim"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    library = tmp_path_factory.mktemp("fakeclock") / "fakeclock.so"
    # -Werror: a warning in a clock shim is a bug we want to see, not ignore.
    flags = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
    subprocess.run(
        [gcc, *flags, "-o", str(library), str(SHIM_SOURCE), "-ldl"], check=True, timeout=60
    )
    return library


@pytest.fixture
def cluster(database_url: str, tmp_path: Path) -> Iterator[Cluster]:
    """Replicas of `sweepd run` for one system test; none outlives it."""
    from daemon_harness import Cluster  # tests/system is on the path for its tests

    found = Cluster(database_url, tmp_path)
    try:
        yield found
    finally:
        found.close()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """A migrated engine on the test's own database."""
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    yield engine
    engine.dispose()
