"""What every system's sweep body does in benchmarks/compare.py: record that the
run started, sleep for its body time, record that it finished; one row in
``compare_runs``. The row is written first so that a run killed with its
replica still shows as started: its tick was run, if not to the end.

Imported by each system's runner script, in that system's own virtualenv, so
it needs nothing but psycopg 3. The harness creates the table and reads it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime

import psycopg

TABLE = """
CREATE TABLE IF NOT EXISTS compare_runs (
    id bigserial PRIMARY KEY,
    system text NOT NULL,
    replica integer NOT NULL,
    sweep text NOT NULL,
    tick timestamptz,
    started timestamptz NOT NULL,
    finished timestamptz  -- null: the run never returned (killed in flight)
)
"""


class Recorder:
    """One connection per process, shared by the body's threads under a lock:
    a row per run is a handful a second, and the recording must not add
    connections that the system under test would be blamed for."""

    def __init__(self, url: str, system: str, replica: int, long: float | None = None) -> None:
        self.system, self.replica = system, replica
        self.long = long  # the body of sweep-0 in the "long" scenario, longer than its interval
        self._connection = psycopg.connect(url, autocommit=True)
        self._lock = threading.Lock()

    def run(self, sweep: str, tick: datetime | None, body_seconds: float) -> None:
        """The sweep's body: its row, ``body_seconds`` of sleep (a sync sweep), its end."""
        started = datetime.now(UTC)
        with self._lock:
            found = self._connection.execute(
                "INSERT INTO compare_runs (system, replica, sweep, tick, started)"
                " VALUES (%s, %s, %s, %s, %s) RETURNING id",
                (self.system, self.replica, sweep, tick, started),
            ).fetchone()
        assert found is not None
        time.sleep(self.long if self.long is not None and sweep == "sweep-0" else body_seconds)
        with self._lock:
            self._connection.execute(
                "UPDATE compare_runs SET finished = %s WHERE id = %s", (datetime.now(UTC), found[0])
            )


def from_environment() -> Recorder:
    """The recorder a runner script was started for: COMPARE_URL, COMPARE_SYSTEM,
    COMPARE_REPLICA, and COMPARE_LONG (the body of sweep-0, when it is long)."""
    long = os.environ.get("COMPARE_LONG")
    return Recorder(
        os.environ["COMPARE_URL"],
        os.environ["COMPARE_SYSTEM"],
        int(os.environ["COMPARE_REPLICA"]),
        None if long is None else float(long),
    )


def quiet_logging() -> None:
    """Warnings and errors only, with the time and the replica: a system's INFO
    lines per job would cost CPU that the other systems do not pay."""
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s replica {os.environ.get('COMPARE_REPLICA', '-')} "
        "%(levelname)s %(name)s: %(message)s",
    )


def exit_within(seconds: float) -> None:
    """Exit 0 after ``seconds`` whatever is still running: a sync body cannot be
    interrupted, and the harness waits 5 s after its SIGTERM. A daemon timer, so
    that a prompt shutdown does not wait for it."""
    watchdog = threading.Timer(seconds, os._exit, (0,))
    watchdog.daemon = True
    watchdog.start()
