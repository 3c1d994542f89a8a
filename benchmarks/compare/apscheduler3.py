"""APScheduler 3 runner for benchmarks/compare.py: every replica runs its own scheduler on one
shared SQLAlchemyJobStore in PostgreSQL, the way people wire APScheduler 3 to a shared database.

APScheduler 3 has no coordination between schedulers: its FAQ says a job store cannot be shared
among processes ("duplicate execution or the scheduler missing jobs"). Each replica loads the due
jobs, runs them and writes the next run time back; whether another replica runs the same tick too
depends only on who reads the row first. That is the behaviour measured here, not a bug to fix.

    venv: pip install APScheduler==3.11.3 SQLAlchemy==2.1.9 'psycopg[binary]==3.3.9'

Settings chosen, and why:

* Trigger: ``IntervalTrigger(seconds=I, start_date=1970-01-01 UTC)``. An interval trigger counts
  whole intervals from its start date, so starting at the epoch puts every fire time on the
  epoch grid shared by all replicas and systems, for any I (a cron ``second=*/I`` only for
  whole divisors of 60).
* ``timezone=UTC`` on the trigger and the scheduler: without it APScheduler 3 asks tzlocal for
  the host's zone; UTC only makes fire times and logs independent of the host (no DST shifts).
* Job function: the textual reference ``apscheduler3:run_sweep``. APScheduler stores a job's
  callable as ``module:name`` and resolves it on load; a function of a script run as
  ``__main__`` would be stored as ``__main__:run_sweep``, which the FAQ warns against (it
  names whatever program is running, not this code). So this script registers itself in
  ``sys.modules`` under its file name and both --setup and the replicas use that name: the
  same module object, one recorder, no second import of the script.
* Job args: only the sweep name. The body time comes from each replica's COMPARE_BODY, so the
  stored jobs don't depend on the environment --setup happened to see.
* --setup: ``BackgroundScheduler.start(paused=True)``, ``add_job(..., replace_existing=True)``,
  ``shutdown()``. A paused scheduler opens its job stores (the table is created there) and
  writes added jobs straight to them, but never processes them, so nothing runs at setup.
* Everything else is APScheduler's default: the ThreadPoolExecutor (10 threads),
  misfire_grace_time=1 s, coalesce=True, max_instances=1. A run longer than its interval
  therefore makes the scheduler skip later ticks of that sweep ("maximum number of running
  instances reached"), and runs waiting over 1 s for a pool thread are dropped as missed:
  that is how APScheduler 3 normally behaves, so it is left alone.
* SIGTERM: ``scheduler.shutdown()`` with its default ``wait=True``, which lets running jobs
  finish (bodies are a few seconds at most) before exiting 0. If a tick falls inside that wait,
  APScheduler's loop still processes it afterwards and logs "cannot schedule new futures after
  shutdown" per due job (and advances them in the store): its own shutdown race, left as is.
* Logging at WARNING to stderr, so skipped and missed runs show in the replica's log.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
# Make ``import apscheduler3`` (what the stored jobs reference) find this very module when it
# runs as a script, instead of importing the file a second time as a separate module.
MODULE = Path(__file__).stem
sys.modules.setdefault(MODULE, sys.modules[__name__])

import record  # noqa: E402  (needs the sys.path entry above)
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore  # noqa: E402
from apscheduler.schedulers.background import BackgroundScheduler  # noqa: E402
from apscheduler.triggers.interval import IntervalTrigger  # noqa: E402

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class _Replica:
    """What run_sweep() needs, set by replica() before its scheduler starts (the stored jobs
    carry only the sweep name) and read in the thread pool."""

    recorder: record.Recorder | None = None
    body_seconds = 0.0


def run_sweep(sweep: str) -> None:
    """The job every ``sweep-N`` runs. APScheduler 3 doesn't tell a job its scheduled time, so
    the tick is None and the harness derives it from the start time."""
    assert _Replica.recorder is not None, "run_sweep called outside a replica"
    _Replica.recorder.run(sweep, None, _Replica.body_seconds)


def scheduler_for(url: str) -> BackgroundScheduler:
    """A scheduler on the shared job store (table ``apscheduler_jobs``), otherwise default."""
    # SQLAlchemy needs the driver named; psycopg 3 is already there for the recorder.
    sqlalchemy_url = url.replace("postgresql://", "postgresql+psycopg://", 1)
    return BackgroundScheduler(
        jobstores={"default": SQLAlchemyJobStore(url=sqlalchemy_url)}, timezone=UTC
    )


def setup(url: str, sweeps: int, interval: float) -> None:
    """Create the job table and store the S jobs, without running any of them."""
    scheduler = scheduler_for(url)
    scheduler.start(paused=True)
    for index in range(sweeps):
        name = f"sweep-{index}"
        scheduler.add_job(
            f"{MODULE}:run_sweep",
            IntervalTrigger(seconds=interval, start_date=EPOCH, timezone=UTC),
            args=[name],
            id=name,
            name=name,
            replace_existing=True,
        )
    scheduler.shutdown()


def replica(url: str) -> None:
    """Run every job in the shared store until SIGTERM."""
    _Replica.recorder = record.from_environment()
    _Replica.body_seconds = float(os.environ["COMPARE_BODY"])

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())

    scheduler = scheduler_for(url)
    scheduler.start()
    print("ready", flush=True)
    stop.wait()
    scheduler.shutdown()


def main() -> None:
    record.quiet_logging()
    url = os.environ["COMPARE_URL"]
    if sys.argv[1:] == ["--setup"]:
        setup(url, int(os.environ["COMPARE_SWEEPS"]), float(os.environ["COMPARE_INTERVAL"]))
    elif not sys.argv[1:]:
        replica(url)
    else:
        sys.exit(f"usage: {sys.argv[0]} [--setup]")


if __name__ == "__main__":
    main()
