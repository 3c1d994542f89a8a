"""The real database server restarts under two `sweepd run` replicas (issue: a restart costs no tick).

Unlike the outage tests, which play a stopped server with a proxy, this one restarts the
machine's own PostgreSQL (`pg_ctlcluster ... restart -m fast`) and MariaDB (shutdown, then
start): every pooled connection dies with the server's own goodbye, and a run that ends while
the server is down cannot release its lease. One sweep is between ticks when the server goes,
the other in the middle of a run.

What must hold: every tick due a second after the server answers again runs, exactly once,
and none runs twice at any time.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from conftest import IN_CI, SERVERS
from daemon_harness import (
    Cluster,
    assert_each_tick_once_and_every_run_recorded,
    overlaps,
    read_rows,
    read_runs,
    stamp,
    sweep,
    write_config,
)
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from sweepd.db import migrate

pytestmark = pytest.mark.slow

QUICK, SLOW = "quick", "slow"
SLOW_SECONDS = 0.6  # its runs span each tick's first 0.6 s
RESTART_AT = 0.3  # seconds past a whole second: quick is done, slow is running
BEFORE = 3.0  # seconds of ticks before the restart
AFTER = 6.0  # seconds of ticks after the server answers again
TIMEOUT = 60.0  # bounds every wait on a server or a process
MARIADBD = "/usr/sbin/mariadbd"


def tools_or_skip(server: str) -> None:
    needed = (
        ["pg_ctlcluster"]
        if server == "postgresql"
        else ["mariadb-admin", "start-stop-daemon", "pgrep"]
    )
    missing = [tool for tool in needed if shutil.which(tool) is None]
    if (
        missing
        or os.geteuid() != 0
        or (not Path("/usr/sbin/mariadbd").exists() and server != "postgresql")
    ):
        message = f"restarting {server} here needs root and {', '.join(needed)}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def restart(server: str) -> None:
    """Restart the machine's server; return once the command has."""
    if server == "postgresql":
        (version,) = os.listdir("/etc/postgresql")
        subprocess.run(
            [
                "pg_ctlcluster",
                "--skip-systemctl-redirect",
                version,
                "main",
                "restart",
                "-m",
                "fast",
            ],
            check=True,
            timeout=TIMEOUT,
        )
        return
    subprocess.run(
        ["mariadb-admin", "-h", "127.0.0.1", "-u", "root", "shutdown"], check=True, timeout=TIMEOUT
    )
    deadline = time.monotonic() + TIMEOUT
    while (
        subprocess.run(["pgrep", "-x", "mariadbd"], check=False, capture_output=True).returncode
        == 0
    ):
        assert time.monotonic() < deadline, "mariadbd did not stop"
        time.sleep(0.05)
    subprocess.run(
        [
            "start-stop-daemon",
            "--start",
            "--oknodo",
            "--background",
            "--exec",
            "/usr/sbin/mariadbd",
        ],
        check=True,
        timeout=TIMEOUT,
    )


def wait_until_answering(server: str) -> float:
    """When the server first answers a new connection (epoch seconds)."""
    engine = create_engine(SERVERS[server], isolation_level="AUTOCOMMIT")
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            try:
                with engine.connect() as connection:
                    connection.execute(text("SELECT 1"))
                return time.time()
            except OperationalError:
                assert time.monotonic() < deadline, f"{server} did not come back"
                time.sleep(0.02)
    finally:
        engine.dispose()


def epoch(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


@pytest.mark.parametrize("server", ["postgresql", "mariadb"])
def test_a_restart_of_the_database_costs_no_tick_once_it_answers(
    server: str, make_database: Callable[[str], str], tmp_path: Path
) -> None:
    tools_or_skip(server)
    url = make_database(server)
    migrate.upgrade(url)
    out = tmp_path / "runs.jsonl"
    sweeps = [
        sweep(QUICK, out, ttl="10s"),
        sweep(SLOW, out, ttl="10s", args={"duration": SLOW_SECONDS}),
    ]
    config = write_config(tmp_path / "sweepd.yaml", url, sweeps)
    cluster = Cluster(url, tmp_path)
    try:
        cluster.start(config, 2)
        time.sleep(BEFORE)
        time.sleep((RESTART_AT - time.time() % 1.0) % 1.0)
        went = time.time()
        try:
            restart(server)
        finally:
            back = wait_until_answering(server)
        time.sleep(AFTER)
        stopped_at, codes, _ = cluster.stop()
    finally:
        cluster.close()
        wait_until_answering(server)  # whatever happened, the next test has its server
    print(f"MEASURE {server} restart: down {back - went:.2f}s")

    assert codes == [0, 0]
    runs = read_runs(out)
    assert not overlaps(runs)
    for name in (QUICK, SLOW):
        ran = Counter(
            epoch(r["tick"]) for r in runs if r["sweep"] == name and r["event"] == "start"
        )
        twice = sorted(t for t, n in ran.items() if n > 1)
        assert not twice, f"{name}: ticks run twice: {twice}"
        # Every tick due from a second after the server answered until the stop.
        due = range(math.ceil(back + 1.0), math.floor(stopped_at))
        missed = [t for t in due if t not in ran]
        assert not missed, f"{name}: ticks due after the server was back that never ran: {missed}"
    # No tick twice, no run without its row, and every row says how its run ended.
    assert_each_tick_once_and_every_run_recorded(runs, read_rows(url))
    # Once the server answers, no statement fails on a connection that died with it.
    late = [
        event
        for events in cluster.events()
        for event in events
        if event.get("level") == "error" and stamp(event) > back
    ]
    assert not late, late
