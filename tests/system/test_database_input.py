"""A database URL this install cannot use, given to every command that opens one.

What a new user meets first: a PostgreSQL or MySQL URL on an install without that driver's
extra, and a SQLite file in a folder that is missing or cannot hold it. Each is one line that
says what to do, exit 2 (the URL is bad input), never a traceback, never the password.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from sweepd.db.engine import make_engine
from sweepd.errors import UsageError

pytestmark = pytest.mark.slow

TIMEOUT = 60.0  # seconds; bounds every subprocess
PASSWORD = "s3cr3t-pw"

# The driver modules sweepd's extras install, and the extra each comes with.
DRIVERS = {"psycopg": "postgres", "pymysql": "mysql"}


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


Command = Callable[[str, Path], list[str]]

# Every command that turns the configured URL into an engine, given (url, config path).
COMMANDS: dict[str, Command] = {
    "check-config": lambda url, config: ["check-config", "--config", str(config)],
    "run": lambda url, config: ["run", "--config", str(config)],
    "db-upgrade": lambda url, config: ["db", "upgrade", "--database", url],
    "db-check": lambda url, config: ["db", "check", "--database", url],
    "lock": lambda url, config: ["lock", "job", "--ttl", "1m", "--database", url, "--", "true"],
}


def write_config(path: Path, url: str) -> Path:
    config = {
        "database": {"url": url},
        "health": {"listen": ""},
        "sweeps": [{"name": "beat", "callable": "sweepd.examples:heartbeat", "every": "1h"}],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def sweepd(cwd: Path, args: list[str], *, path_first: Path | None = None) -> Result:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPD_")}
    if path_first is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path_first), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "sweepd", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    return Result(done.returncode, done.stdout, done.stderr)


def one_clean_line(result: Result) -> str:
    """The one line on stderr; a traceback fails with its last lines, which say the most."""
    lines = result.stderr.strip().splitlines()
    if "Traceback" in result.stderr:
        pytest.fail("traceback printed: " + " | ".join(lines[-2:]))
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def no_drivers(tmp_path: Path) -> Path:
    """A folder which, first on PYTHONPATH, makes each driver fail to import as if not installed.

    A module of the driver's name that raises what a missing one raises: the interpreter
    finds it before the installed driver, so nothing outside the test's process changes.
    """
    shim = tmp_path / "no-drivers"
    shim.mkdir()
    for module in DRIVERS:
        (shim / f"{module}.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{module}'\", name={module!r})\n"
        )
    return shim


DRIVER_URLS = [
    pytest.param(f"postgresql://app:{PASSWORD}@127.0.0.1:1/app", "postgres", id="postgresql"),
    pytest.param(f"mysql://app:{PASSWORD}@127.0.0.1:1/app", "mysql", id="mysql"),
    pytest.param(f"mariadb+pymysql://app:{PASSWORD}@127.0.0.1:1/app", "mysql", id="mariadb"),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("url", "extra"), DRIVER_URLS)
def test_a_url_whose_driver_is_not_installed_names_the_extra(
    tmp_path: Path, no_drivers: Path, command: str, url: str, extra: str
) -> None:
    config = write_config(tmp_path / "sweepd.yaml", url)

    result = sweepd(tmp_path, COMMANDS[command](url, config), path_first=no_drivers)

    line = one_clean_line(result)
    assert result.returncode == 2, result.stderr
    assert line.startswith("sweepd: ") and line.endswith(f"pip install 'sweepd[{extra}]'"), line
    assert PASSWORD not in result.stdout + result.stderr
    assert result.stdout == ""


def test_a_driver_that_fails_to_load_is_one_line_too(tmp_path: Path) -> None:
    # psycopg installed without a libpq it can load says so over several lines.
    shim = tmp_path / "broken-driver"
    shim.mkdir()
    (shim / "psycopg.py").write_text(
        'raise ImportError("no pq wrapper available.\\nAttempts made:\\n- binary: not found")\n'
    )
    url = f"postgresql://app:{PASSWORD}@127.0.0.1:1/app"

    result = sweepd(tmp_path, ["db", "upgrade", "--database", url], path_first=shim)

    assert one_clean_line(result) == (
        "sweepd: the database driver for postgresql+psycopg is not installed"
        " (no pq wrapper available.): pip install 'sweepd[postgres]'"
    )
    assert result.returncode == 2


def test_the_driver_shim_really_blocks_the_driver(tmp_path: Path, no_drivers: Path) -> None:
    # Should the shim stop shadowing the installed drivers, the tests above fail as refused
    # connections; this one says why.
    env = {**os.environ, "PYTHONPATH": str(no_drivers)}
    for module in DRIVERS:
        done = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert f"ModuleNotFoundError: No module named '{module}'" in done.stderr


@pytest.mark.parametrize(
    ("url", "dialect"),
    [
        pytest.param(f"postgresql://app:{PASSWORD}@127.0.0.1:1/app", "postgresql", id="postgresql"),
        pytest.param(f"mysql://app:{PASSWORD}@127.0.0.1:1/app", "mysql", id="mysql"),
    ],
)
def test_db_sql_needs_no_driver(tmp_path: Path, no_drivers: Path, url: str, dialect: str) -> None:
    # The DDL is for a DBA to read and apply elsewhere: it must not need what connects.
    by_url = sweepd(tmp_path, ["db", "sql", "--database", url], path_first=no_drivers)
    by_dialect = sweepd(tmp_path, ["db", "sql", "--dialect", dialect], path_first=no_drivers)

    assert by_url.returncode == 0, by_url.stderr
    assert "CREATE TABLE sweep_leases" in by_url.stdout
    assert by_url.stdout == by_dialect.stdout


# -- a SQLite file that cannot be made -------------------------------------------------------

# (where the database file goes, under tmp_path; what the one line says is wrong with it)
SQLITE_FOLDERS = [
    pytest.param("missing/x.db", "the folder {root}/missing does not exist", id="missing"),
    pytest.param(
        "missing/deeper/x.db", "the folder {root}/missing/deeper does not exist", id="missing-two"
    ),
    # What makes a folder unusable even for root, who may write into any folder: it is a file.
    pytest.param("file.txt/x.db", "{root}/file.txt is a file, not a folder", id="under-a-file"),
]

FATAL = ["run", "db-upgrade", "lock"]


def sqlite_case(tmp_path: Path, where: str) -> tuple[str, Path, Path]:
    """(url, config, database path) for a database file at ``where`` under a fresh folder."""
    root = tmp_path / "area"
    root.mkdir()
    (root / "file.txt").write_text("not a folder\n")
    database = root / where
    url = f"sqlite:///{database}"
    return url, write_config(tmp_path / "sweepd.yaml", url), database


@pytest.mark.parametrize("command", FATAL)
@pytest.mark.parametrize(("where", "wrong"), SQLITE_FOLDERS)
def test_a_sqlite_file_in_a_folder_that_cannot_hold_it_is_one_line_naming_the_path(
    tmp_path: Path, command: str, where: str, wrong: str
) -> None:
    url, config, database = sqlite_case(tmp_path, where)

    result = sweepd(tmp_path, COMMANDS[command](url, config))

    line = one_clean_line(result)
    assert result.returncode == 2, result.stderr
    root = tmp_path / "area"
    assert line == f"sweepd: database file {database}: {wrong.format(root=root)}"
    assert sorted(p.name for p in root.iterdir()) == ["file.txt"], "something was created"


@pytest.mark.parametrize(("command", "status"), [("check-config", 1), ("db-check", 1)])
@pytest.mark.parametrize(("where", "wrong"), SQLITE_FOLDERS)
def test_the_database_checks_name_the_sqlite_path_and_what_is_wrong(
    tmp_path: Path, command: str, status: int, where: str, wrong: str
) -> None:
    url, config, database = sqlite_case(tmp_path, where)

    result = sweepd(tmp_path, COMMANDS[command](url, config))

    assert "Traceback" not in result.stderr
    assert result.returncode == status, result.stderr
    reason = (
        f"database unreachable: database file {database}: {wrong.format(root=tmp_path / 'area')}"
    )
    assert result.stderr.strip().splitlines()[-1].endswith(reason), result.stderr


def test_a_folder_this_user_cannot_write_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root may write into any folder, and the tests run as root: what an ordinary user's
    # read-only folder does is seen through the permission check itself.
    database = tmp_path / "x.db"
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)

    with pytest.raises(UsageError) as caught:
        make_engine(f"sqlite:///{database}")

    assert str(caught.value) == f"database file {database}: the folder {tmp_path} is not writable"


def test_a_migration_lock_that_cannot_be_opened_is_one_line_naming_it(tmp_path: Path) -> None:
    # The folder is fine; the lock file beside the database is not (here a folder in its place).
    database = tmp_path / "x.db"
    lock = tmp_path / "x.db.migrate-lock"
    lock.mkdir()

    result = sweepd(tmp_path, ["db", "upgrade", "--database", f"sqlite:///{database}"])

    assert one_clean_line(result) == f"sweepd: migration lock {lock}: Is a directory"
    assert result.returncode == 2
