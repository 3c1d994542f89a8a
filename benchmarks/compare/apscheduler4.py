"""APScheduler 4 in benchmarks/compare.py: an AsyncScheduler per replica on a
shared PostgreSQL data store and event broker.

APScheduler 4.0.0a6 is a PRE-RELEASE: its author warns the 4.x API may still
change incompatibly and that it is not for production. It is measured here
because 3.x cannot share a job store between processes at all.

The multi-process setup its user guide describes ("Using multiple
schedulers"): every replica runs an ``AsyncScheduler`` in the default role
(both scheduler and worker) on one ``SQLAlchemyDataStore`` (async engine,
postgresql+psycopg) and one ``PsycopgEventBroker`` (LISTEN/NOTIFY), so
schedules are processed once and sleeping schedulers wake on new jobs.
``--setup`` creates the schema and adds the S schedules; replicas only run.

Settings chosen, and why (everything else is APScheduler's default:
misfire_grace_time None, i.e. a late job still runs however late;
coalesce "latest"; max_running_jobs 1 per task; lease 30 s; cleanup 15 min):

- A task per sweep (task id = schedule id = ``sweep-N``), all with the same
  function. The task is APScheduler's unit of max_running_jobs; one shared
  task would make its default limit of 1 serialize all S sweeps cluster-wide,
  which no real deployment of S separate sweep functions would see.
- ``job_executor="threadpool"`` (task default): the body is a sync, blocking
  call. AsyncScheduler's first executor, "async", would call it on the event
  loop thread and stall the scheduler; the sync ``Scheduler`` wrapper picks
  "threadpool" by default for exactly this reason. (Not that wrapper itself:
  in 4.0.0a6 it also defaults cleanup_interval to None, i.e. no clean-up.)
- ``identity="apscheduler4-<replica>"``: the user guide advises a stable,
  unique identity per scheduler. A restarted replica then releases at start
  the jobs its predecessor held (killed, or, a 4.0.0a6 bug, acquired just as
  it stopped); with a new identity each time they would block their sweep's
  only slot until a cleanup (at a scheduler's start, after the 30 s lease;
  then every 15 min).
- The interval trigger starts on the first epoch-grid instant after
  ``--setup`` (start + k*I stays on the grid); ticks missed before the
  replicas start coalesce into one late run, as the defaults dictate.
- A run longer than its interval: nothing changed. The scheduler still makes
  a job per tick, max_running_jobs=1 keeps it waiting (not dropped) while
  the previous run of that sweep is running, and misfire_grace_time=None
  lets it start late; so a sweep that is always too long builds a backlog.
- SIGTERM leaves the scheduler's context, its own orderly shutdown; a
  running body in a worker thread cannot be interrupted, so a watchdog ends
  the process at 4.5 s to honour the harness's 5 s limit.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
from datetime import UTC, datetime

from apscheduler import AsyncScheduler, ConflictPolicy, TaskDefaults, current_job
from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
from apscheduler.eventbrokers.psycopg import PsycopgEventBroker
from apscheduler.triggers.interval import IntervalTrigger

sys.path.insert(0, os.path.dirname(__file__))
import record

SHUTDOWN_LIMIT = 4.5  # seconds after SIGTERM before the watchdog exits


class Body:
    """What the sweeps' function needs in a replica, set once in main()."""

    recorder: record.Recorder | None = None
    seconds = 0.0


def run_sweep(sweep: str) -> None:
    """The function of every sweep's task, run in the thread pool executor.

    The job carries the fire time it was made for (no jitter is configured,
    so it is the tick itself); AnyIO copies the context into the worker
    thread, so ``current_job`` is readable here. It comes back from the jobs
    table in the session's time zone, hence the conversion to UTC.
    """
    assert Body.recorder is not None
    fire_time = current_job.get().scheduled_fire_time
    Body.recorder.run(sweep, fire_time.astimezone(UTC) if fire_time else None, Body.seconds)


def sweep_names() -> list[str]:
    return [f"sweep-{i}" for i in range(int(os.environ["COMPARE_SWEEPS"]))]


def make_scheduler(identity: str) -> AsyncScheduler:
    libpq_url = os.environ["COMPARE_URL"]
    _, rest = libpq_url.split("://", 1)
    return AsyncScheduler(
        SQLAlchemyDataStore(f"postgresql+psycopg://{rest}"),
        PsycopgEventBroker(libpq_url),
        identity=identity,
        task_defaults=TaskDefaults(job_executor="threadpool"),
    )


async def setup() -> None:
    """Schema (created by the data store on start) and the S schedules."""
    interval = float(os.environ["COMPARE_INTERVAL"])
    start = datetime.fromtimestamp(math.ceil(time.time() / interval) * interval, UTC)
    async with make_scheduler("apscheduler4-setup") as scheduler:
        for name in sweep_names():
            await scheduler.configure_task(name, func=run_sweep)
            await scheduler.add_schedule(
                name,
                IntervalTrigger(seconds=interval, start_time=start),
                id=name,
                args=(name,),
                conflict_policy=ConflictPolicy.replace,
            )


async def replica(number: int) -> None:
    stopping = asyncio.Event()

    def on_signal() -> None:
        record.exit_within(SHUTDOWN_LIMIT)
        stopping.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)

    async with make_scheduler(f"apscheduler4-{number}") as scheduler:
        # The tasks exist already (--setup); this only binds their function
        # to this process, a read per task and no write.
        for name in sweep_names():
            await scheduler.configure_task(name, func=run_sweep)
        await scheduler.start_in_background()
        print("ready", flush=True)
        await stopping.wait()
    # Leaving the context stopped the scheduler and closed store and broker.


def main() -> int:
    record.quiet_logging()
    if "--setup" in sys.argv:
        asyncio.run(setup())
        return 0
    Body.seconds = float(os.environ["COMPARE_BODY"])
    Body.recorder = record.from_environment()
    asyncio.run(replica(int(os.environ["COMPARE_REPLICA"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
