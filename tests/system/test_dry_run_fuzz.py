"""``sweepd run --dry-run`` on generated configs, as a process: what check-config
refuses, run refuses with the same lines and exit 2; what it accepts, run
starts (``daemon.started``) and drains on SIGTERM with exit 0. Never a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from config_strategies import configs
from hypothesis import HealthCheck, event, given, settings

from sweepd.db import migrate

pytestmark = pytest.mark.slow

START_SECONDS = 20.0  # a bound, never reached when the daemon starts


def sweepd(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("SWEEPD_")}
    return subprocess.Popen(
        [sys.executable, "-m", "sweepd", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def drained(process: subprocess.Popen[str]) -> tuple[int, str]:
    """Wait for ``daemon.started`` on stderr, send SIGTERM, return (exit code, stderr)."""
    assert process.stderr is not None
    seen: list[str] = []
    deadline = time.monotonic() + START_SECONDS
    for line in process.stderr:
        seen.append(line)
        if "daemon.started" in line or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGTERM)
    _, rest = process.communicate(timeout=START_SECONDS)
    return process.returncode, "".join(seen) + rest


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(config=configs)
def test_dry_run_refuses_what_check_config_refuses_and_starts_the_rest(
    config: dict[str, object], tmp_path: Path
) -> None:
    # The database is this test's, migrated (a dry run changes no schema): a
    # generated URL could name a server that is not there.
    url = f"sqlite:///{tmp_path}/dry.db"
    if not (tmp_path / "dry.db").exists():  # tmp_path is one folder for every example
        migrate.upgrade(url)
    config["database"] = {"url": url}
    (tmp_path / "sweepd.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    checked = sweepd("check-config", "--no-db", "--config", "sweepd.yaml", cwd=tmp_path)
    _, check_err = checked.communicate(timeout=60)
    assert checked.returncode in (0, 2), check_err
    run = sweepd("run", "--dry-run", "--config", "sweepd.yaml", cwd=tmp_path)
    event(f"check-config exit {checked.returncode}")
    if checked.returncode == 2:
        _, run_err = run.communicate(timeout=60)
        assert (run.returncode, run_err) == (2, check_err)
        return
    code, run_err = drained(run)
    assert "Traceback" not in run_err
    assert "daemon.started" in run_err, run_err
    assert code == 0, run_err
