"""`sweepd run` as a command: --dry-run, migrate: never, bad config."""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import HERE, read_rows, read_runs, sweep, write_config
from sqlalchemy import inspect

from sweepd.db import migrate
from sweepd.db.engine import make_engine

pytestmark = pytest.mark.slow


def sweepd_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


def test_dry_run_logs_the_ticks_it_would_fire_and_touches_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'dry.db'}"
    out, log = tmp_path / "runs.jsonl", tmp_path / "dry.log"
    config = write_config(
        tmp_path / "sweepd.yaml",
        url,
        [sweep("tidy", out)],
        database={"url": url, "migrate": "never"},
    )
    # A dry run checks the schema and must not create it: make it first.
    upgrade = [sys.executable, "-m", "sweepd", "db", "upgrade", "--database", url]
    assert subprocess.run(upgrade, capture_output=True, timeout=60, check=False).returncode == 0
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "sweepd", "run", "--dry-run", "--config", str(config)],
            env=sweepd_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(would_fire(log)) < 2:
                time.sleep(0.1)
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert [e["sweep"] for e in would_fire(log)][:2] == ["tidy", "tidy"]
    assert read_runs(out) == []
    assert read_rows(url) == []
    assert "tick.claimed" not in log.read_text()


def would_fire(log: Path) -> list[dict[str, object]]:
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [e for e in events if e.get("event") == "tick.would_fire"]


def run_failing(tmp_path: Path, database: dict[str, str], log_format: str) -> tuple[int, str]:
    """(exit status, stderr) of a `sweepd run` that cannot start, logging in ``log_format``."""
    config = write_config(
        tmp_path / "sweepd.yaml",
        database["url"],
        [sweep("tidy", tmp_path / "runs")],
        database=database,
    )
    result = subprocess.run(
        [sys.executable, "-m", "sweepd", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**sweepd_env(), "SWEEPD_LOG_FORMAT": log_format},
    )
    assert "Traceback" not in result.stderr
    return result.returncode, result.stderr


MISSING_SCHEMA = (
    f"the database schema is missing, sweepd needs {migrate.head()}: run `sweepd db upgrade`"
)


def test_migrate_never_refuses_a_missing_schema_naming_the_fix(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"

    status, stderr = run_failing(tmp_path, {"url": url, "migrate": "never"}, "console")

    assert status == 1
    assert stderr.splitlines()[-1] == f"sweepd: {MISSING_SCHEMA}"
    engine = make_engine(url)
    try:
        assert inspect(engine).get_table_names() == []  # nothing was created behind the refusal
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("database", "message"),
    [
        pytest.param(
            {"url": "sqlite:///{tmp}/empty.db", "migrate": "never"}, MISSING_SCHEMA, id="schema"
        ),
        pytest.param(
            # Port 1 refuses at once: the schema upgrade at start fails, a StoreError.
            {"url": "postgresql://postgres:s3cr3t@127.0.0.1:1/test"},
            "schema upgrade failed: OperationalError: *",
            id="store",
        ),
    ],
)
def test_in_json_logs_the_fatal_error_is_the_last_json_line(
    tmp_path: Path, database: dict[str, str], message: str
) -> None:
    database = {**database, "url": database["url"].format(tmp=tmp_path)}

    status, stderr = run_failing(tmp_path, database, "json")

    events = [json.loads(line) for line in stderr.splitlines()]  # every line, or it fails here
    assert status == 1
    assert events[0]["event"] == "daemon.starting"
    last = events[-1]
    assert (last["event"], last["level"], last["exit_code"]) == ("daemon.failed", "error", 1)
    assert fnmatch.fnmatchcase(last["message"], message), last
    assert "s3cr3t" not in stderr


def test_a_bad_config_is_located_lines_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "sweepd.yaml"
    config.write_text(
        "sweeps:\n  - name: tidy\n    callable: daemon_sweeps:record\n    every: soon\n"
        f"    args: {{out: {tmp_path / 'runs'}}}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "sweepd", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=sweepd_env(),  # daemon_sweeps importable, args that fit: one problem, the duration
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"{config}:4:12: sweeps[0].every: invalid duration 'soon' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)"
    ]
