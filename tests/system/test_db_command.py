"""`sweepd db upgrade|check|sql` as real commands, on every dialect.

The race that matters: several replicas start at once and each runs `db upgrade`. They must
end with one schema at head and no error, exactly one of them saying it did the upgrade.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import text

from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.db.schema import VERSION_TABLE

pytestmark = pytest.mark.slow

TIMEOUT = 60.0  # seconds; bounds every subprocess and every wait
REPLICAS = 4

# Runs `sweepd <args>` through sweepd's own main(), but only once the test opens the gate: the
# imports are done before it, so the four processes reach the migration lock together. It
# records when it passed the gate and when it finished, to prove the runs overlapped.
GATED = """
import sys, time
from pathlib import Path
from sweepd.cli import main
from sweepd.db import health, migrate
ready, gate, times = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
deadline = time.monotonic() + 60
while not gate.exists():
    if time.monotonic() > deadline:
        sys.exit("the gate never opened")
    time.sleep(0.005)
began = time.time()
status = main(sys.argv[4:])
times.write_text(f"{began} {time.time()}")
sys.exit(status)
"""


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def environment() -> dict[str, str]:
    """Our environment without any SWEEPD_* setting, so only the arguments choose the database."""
    return {key: value for key, value in os.environ.items() if not key.startswith("SWEEPD_")}


def sweepd(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    done = subprocess.run(
        [sys.executable, "-m", "sweepd", *args],
        cwd=cwd,
        env={**environment(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    return Result(done.returncode, done.stdout, done.stderr)


def assert_clean(result: Result) -> None:
    # The last lines of a traceback say what went wrong; the rest only floods the report.
    if "Traceback" in result.stdout + result.stderr:
        pytest.fail("traceback printed: " + " | ".join(result.stderr.strip().splitlines()[-2:]))


def version_rows(url: str) -> list[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))
            return [str(row[0]) for row in rows]
    finally:
        engine.dispose()


def test_concurrent_upgrades_end_with_one_current_schema(database_url: str, tmp_path: Path) -> None:
    head = migrate.head()
    gate = tmp_path / "gate"
    processes: list[subprocess.Popen[str]] = []
    try:
        for index in range(REPLICAS):
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        GATED,
                        str(tmp_path / f"ready-{index}"),
                        str(gate),
                        str(tmp_path / f"times-{index}"),
                        *("db", "upgrade", "--database", database_url),
                    ],
                    cwd=tmp_path,
                    env=environment(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + TIMEOUT
        while not all((tmp_path / f"ready-{index}").exists() for index in range(REPLICAS)):
            assert all(process.poll() is None for process in processes), "a replica died early"
            assert time.monotonic() < deadline, "the replicas never got ready"
            time.sleep(0.01)
        opened = time.monotonic()
        gate.touch()
        results = []
        for process in processes:
            stdout, stderr = process.communicate(timeout=TIMEOUT)
            results.append(Result(process.returncode, stdout, stderr))
        elapsed = time.monotonic() - opened
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate(timeout=TIMEOUT)

    for result in results:
        assert_clean(result)
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
    outputs = sorted(result.stdout.strip() for result in results)
    assert outputs == sorted(
        [f"schema upgraded: none -> {head}"] + [f"schema already at {head}"] * (REPLICAS - 1)
    )
    # Every replica passed the gate before any had finished: they really raced.
    spans = [
        tuple(map(float, (tmp_path / f"times-{index}").read_text().split()))
        for index in range(REPLICAS)
    ]
    assert max(began for began, _ in spans) < min(ended for _, ended in spans), spans
    assert elapsed < 30, f"{REPLICAS} concurrent upgrades took {elapsed:.1f}s"

    check = sweepd(tmp_path, "db", "check", "--database", database_url)
    assert check.returncode == 0, check.stderr
    assert "schema current" in check.stdout
    assert version_rows(database_url) == [head]


def test_check_on_an_empty_database_names_the_fix(database_url: str, tmp_path: Path) -> None:
    result = sweepd(tmp_path, "db", "check", "--database", database_url)

    assert_clean(result)
    assert result.returncode == 1, result.stderr
    assert "sweepd db upgrade" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("dialect_name", ["postgresql", "mysql", "sqlite"])
def test_sql_prints_the_ddl(tmp_path: Path, dialect_name: str) -> None:
    result = sweepd(tmp_path, "db", "sql", "--dialect", dialect_name)

    assert_clean(result)
    assert result.returncode == 0, result.stderr
    assert "CREATE TABLE sweep_leases" in result.stdout
    assert "CREATE TABLE sweep_runs" in result.stdout


def test_sql_refuses_an_unknown_dialect(tmp_path: Path) -> None:
    result = sweepd(tmp_path, "db", "sql", "--dialect", "oracle")

    assert_clean(result)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "oracle" in result.stderr
    assert result.stdout == ""


# A server that does not exist: a `db sql` that tried to connect would fail.
NOWHERE = {
    "postgresql": "postgresql://app:pw@db.invalid/app",
    "mysql": "mysql://app:pw@db.invalid/app",
    "sqlite": "sqlite:///no/such/folder/sweepd.db",
}


@pytest.mark.parametrize("dialect_name", ["postgresql", "mysql", "sqlite"])
def test_sql_is_for_the_database_given_by_flag_environment_or_config(
    tmp_path: Path, dialect_name: str
) -> None:
    url = NOWHERE[dialect_name]
    config = tmp_path / "sweepd.yaml"
    config.write_text(f"database:\n  url: {url}\n")
    wanted = migrate.sql(dialect_name)

    ways = {
        "--database": sweepd(tmp_path, "db", "sql", "--database", url),
        "$SWEEPD_DATABASE_URL": sweepd(tmp_path, "db", "sql", env={"SWEEPD_DATABASE_URL": url}),
        "--config": sweepd(tmp_path, "db", "sql", "--config", str(config)),
        "$SWEEPD_CONFIG": sweepd(tmp_path, "db", "sql", env={"SWEEPD_CONFIG": str(config)}),
    }

    for way, result in ways.items():
        assert_clean(result)
        assert (result.returncode, result.stderr) == (0, ""), way
        assert result.stdout == wanted, way


def test_sql_takes_the_database_in_the_usual_order_and_dialect_over_all(tmp_path: Path) -> None:
    config = tmp_path / "sweepd.yaml"
    config.write_text(f"database:\n  url: {NOWHERE['sqlite']}\n")
    env = {"SWEEPD_DATABASE_URL": NOWHERE["mysql"], "SWEEPD_CONFIG": str(config)}

    flag = sweepd(tmp_path, "db", "sql", "--database", NOWHERE["postgresql"], env=env)
    environment_url = sweepd(tmp_path, "db", "sql", env=env)
    dialect = sweepd(tmp_path, "db", "sql", "--dialect", "sqlite", "--database", NOWHERE["mysql"])

    assert flag.stdout == migrate.sql("postgresql"), flag.stderr
    assert environment_url.stdout == migrate.sql("mysql"), environment_url.stderr
    assert dialect.stdout == migrate.sql("sqlite"), dialect.stderr


def test_sql_without_a_dialect_or_a_database_says_what_to_pass(tmp_path: Path) -> None:
    result = sweepd(tmp_path, "db", "sql")

    assert_clean(result)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, result.stderr
    assert "--dialect" in line and "--database" in line and "--config" in line, line
