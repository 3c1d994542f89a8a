"""procrastinate in benchmarks/compare.py: periodic tasks deferred by every replica's worker,
deduplicated per tick by PostgreSQL, and run by whichever worker fetches the job first.

Named ``procrastinate_runner.py`` because ``procrastinate.py`` would shadow the package.

    venv: pip install procrastinate==3.10.0 'psycopg[binary]==3.3.9'

The setup its docs describe ("Launch a task periodically"): each worker runs a periodic
deferrer for the schedules declared in code, and a unique row per (task, periodic id,
timestamp) in ``procrastinate_periodic_defers`` lets only one worker defer each tick, so any
number of workers share one database. ``--setup`` applies the schema (``apply_schema``);
the schedules live only in code, so nothing else is stored. By design the deferrer wakes
0.5 s after each tick (``MARGIN`` in procrastinate/periodic.py), so runs start at least that
late; and a starting worker defers the latest tick already past, if nobody has yet.

Settings chosen, and why (everything else is procrastinate's default: PsycopgConnector's pool
of 4 connections plus one LISTEN connection, LISTEN/NOTIFY on, 5 s polling, no lock, no
queueing lock, no retry, finished jobs kept, periodic max_delay 10 min):

* One task, ``sweep``, with S periodic schedules: ``app.periodic(cron=..., periodic_id=
  "sweep-N", task_kwargs={"sweep": "sweep-N"})`` in a loop, the docs' way to give one task
  several schedules with different arguments. The job's ``timestamp`` kwarg (the tick it was
  deferred for, seconds since the epoch) becomes the recorded tick.
* The task's ``name="sweep"``: the default name comes from the module, and for a script that
  is resolved from its file; an explicit name keeps the jobs' task_name independent of that.
* Cron from I: ``* * * * * */I`` (the optional 6th field is seconds) for whole I dividing 60,
  ``*/m * * * *`` for whole minutes m dividing 60. Both stay on the epoch grid; other
  intervals cannot be written as a cron and are refused.
* ``concurrency=S``: the default of 1 would run one job at a time per worker, so S sweeps due
  at the same instant would queue behind each other; S sub-workers let a worker run every
  sweep of a tick at once, the way the docs raise concurrency ("concurrency=30"). Sync tasks
  run in a thread via asgiref's sync_to_async, i.e. the event loop's default thread pool,
  which Python sizes min(32, CPUs + 4). That pool is left as is, as a user following the
  docs would have it: on a small machine it, not concurrency, caps the sync bodies running
  at once in a replica, and jobs fetched beyond it wait in "doing" for a thread.
* A run longer than its interval: nothing changed. The deferrer makes a new job for every
  tick regardless of running ones, so with concurrency > 1 runs of one sweep overlap. A
  ``lock`` would serialise them and a ``queueing_lock`` would skip ticks while one waits;
  the periodic docs set neither by default, so neither is set.
* Signals: ``install_signal_handlers=False`` and our own SIGTERM/SIGINT handler, which
  cancels the ``run_worker_async`` task: the docs' other way to stop a worker, the same
  graceful stop (running jobs finish, the worker unregisters). Our handler also starts a
  4.5 s watchdog, because a sync job cannot be interrupted and the harness allows 5 s (a
  graceful stop also waits for fetched jobs still queued for a thread); and it is in place
  before ``ready``, so a SIGTERM while the app opens still exits 0.
* Logging at WARNING: procrastinate logs two INFO lines per job, CPU the other systems don't
  spend. The one WARNING at start, "App is instantiated in the main Python module", is
  about a second import of the script making a second app; nothing here imports it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from datetime import UTC, datetime

import procrastinate

sys.path.insert(0, os.path.dirname(__file__))
import record  # beside this file, on the sys.path entry above

SHUTDOWN_LIMIT = 4.5  # seconds after SIGTERM before the watchdog exits


class Body:
    """What the sweep task needs in a replica, set once in replica() before the worker runs."""

    recorder: record.Recorder | None = None
    seconds = 0.0


def run_sweep(timestamp: int, sweep: str) -> None:
    """The task every schedule defers: the shared sync body, with the tick it was deferred for."""
    assert Body.recorder is not None, "run_sweep called outside a replica"
    Body.recorder.run(sweep, datetime.fromtimestamp(timestamp, UTC), Body.seconds)


def cron_for(interval: float) -> str:
    """A cron expression whose instants are the epoch-grid multiples of ``interval``."""
    seconds = round(interval)
    if seconds != interval or seconds < 1:
        sys.exit(f"procrastinate: cron needs whole seconds, not {interval:g}")
    if 60 % seconds == 0:
        return "* * * * * *" if seconds == 1 else f"* * * * * */{seconds}"
    minutes, rest = divmod(seconds, 60)
    if rest == 0 and 60 % minutes == 0:
        return f"*/{minutes} * * * *"
    sys.exit(f"procrastinate: no cron fires on the grid of {interval:g} s")


def make_app(url: str) -> procrastinate.App:
    """The app on the shared database; psycopg's pool takes the libpq URL as it is."""
    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))


def register_sweeps(app: procrastinate.App, sweeps: int, interval: float) -> None:
    """One task, S periodic schedules of it, each passing its sweep's name."""
    task = app.task(name="sweep")(run_sweep)
    cron = cron_for(interval)
    for index in range(sweeps):
        name = f"sweep-{index}"
        # A dict of its own each: the deferrer adds the timestamp to task_kwargs in place.
        app.periodic(cron=cron, periodic_id=name, task_kwargs={"sweep": name})(task)


def setup(url: str) -> None:
    """Procrastinate's tables, functions and triggers; the schedules need no rows."""
    app = make_app(url)
    with app.open():
        app.schema_manager.apply_schema()


async def replica(url: str, sweeps: int, interval: float) -> None:
    """A worker that defers the periodic jobs and runs jobs, until SIGTERM."""
    app = make_app(url)
    register_sweeps(app, sweeps, interval)
    loop = asyncio.get_running_loop()
    worker: asyncio.Task[None] | None = None
    stopping = asyncio.Event()

    def on_signal() -> None:
        record.exit_within(SHUTDOWN_LIMIT)
        stopping.set()
        if worker is not None:
            worker.cancel()  # first cancel: graceful, running jobs finish

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)

    async with app.open_async():
        if stopping.is_set():
            return
        worker = asyncio.create_task(
            app.run_worker_async(concurrency=sweeps, install_signal_handlers=False)
        )
        print("ready", flush=True)
        try:
            await worker
        except asyncio.CancelledError:
            if not stopping.is_set():
                raise  # not our cancellation
    # Leaving the context closed the pool.


def main() -> int:
    record.quiet_logging()
    url = os.environ["COMPARE_URL"]
    if sys.argv[1:] == ["--setup"]:
        setup(url)
        return 0
    if sys.argv[1:]:
        sys.exit(f"usage: {sys.argv[0]} [--setup]")
    Body.recorder = record.from_environment()
    Body.seconds = float(os.environ["COMPARE_BODY"])
    asyncio.run(
        replica(url, int(os.environ["COMPARE_SWEEPS"]), float(os.environ["COMPARE_INTERVAL"]))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
