"""What one run costs the daemon's process: bursts of ticks through one ``Runner``.

``replicas.py`` measures whole replicas; this isolates the runner. S sweeps
that do nothing (sync, or async with ``--async``) all fire at once, B times,
on a fresh database; every tick is won, since there is one replica. It
reports, per run: the process's CPU (user + sys, from ``getrusage``), the
its claim and close calls, the other statements SQLAlchemy executed, and the
voluntary context switches.
Logs are rendered as JSON to /dev/null, as the daemon would to a pipe.
Sweeps that take no time flatter anything that waits for runs to end
together: check a gain here with ``replicas.py`` before keeping it.

    python benchmarks/burst.py --dialect postgresql --sweeps 1000 --bursts 5 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).parent))
from replicas import bench_database

from sweepd.clock import SystemClock
from sweepd.db.engine import make_engine
from sweepd.history import History
from sweepd.lease import LeaseStore
from sweepd.model import SweepDef
from sweepd.observe import configure_logging, get_logger
from sweepd.runner import Runner
from sweepd.schedule import Every
from sweepd.store import TickStore


def nothing() -> None:
    return None


async def nothing_async() -> None:
    return None


def counted(calls: Counter[str], kind: str, method: Any) -> Any:
    """``method``, counting its calls: the runner's database calls are these two."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls[kind] += 1
        return method(*args, **kwargs)

    return call


async def bursts(runner: Runner, sweeps: list[SweepDef], first: int, count: int) -> float:
    """Run ``count`` bursts; return the wall seconds they took."""
    began = time.perf_counter()
    base = datetime(2026, 1, 1, tzinfo=UTC)  # in the past: the claim refuses future ticks
    for n in range(first, first + count):
        tick = base + timedelta(minutes=n)
        outcomes = await asyncio.gather(*(runner.execute(s, tick) for s in sweeps))
        wrong = [o for o in outcomes if o != "success"]
        if wrong:
            raise SystemExit(f"burst {n}: {len(wrong)} runs did not succeed: {Counter(wrong)}")
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dialect", default="postgresql", choices=["postgresql", "mysql", "sqlite"]
    )
    parser.add_argument("--sweeps", type=int, default=1000)
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--async", dest="run_async", action="store_true")
    args = parser.parse_args()

    configure_logging("json", "info", stream=open("/dev/null", "w"))  # noqa: SIM115
    with tempfile.TemporaryDirectory() as folder, bench_database(args.dialect, Path(folder)) as url:
        engine = make_engine(url)
        calls: Counter[str] = Counter()

        def count_other(*_: Any) -> None:
            # SQLAlchemy sees every statement but PostgreSQL's two batched ones
            # (they run on the driver's cursor); elsewhere it sees the
            # statements inside the claim and close calls too.
            calls["other"] += 1

        event.listen(engine, "before_cursor_execute", count_other)
        func = nothing_async if args.run_async else nothing
        sweeps = [
            SweepDef(
                name=f"s{i:04d}",
                func=func,
                target="burst:nothing",
                schedule=Every(timedelta(minutes=1)),
                ttl=timedelta(seconds=30),
                timeout=None,
                misfire_grace=timedelta(minutes=5),
            )
            for i in range(args.sweeps)
        ]
        for store in (TickStore, *TickStore.__subclasses__()):  # each dialect's own verbs
            for verb, kind in (("open", "claim"), ("close", "close")):
                if verb in vars(store):
                    setattr(store, verb, counted(calls, kind, getattr(store, verb)))
        runner = Runner(
            LeaseStore(engine, "burst"),
            History(engine, "burst"),
            "burst-holder",
            SystemClock(),
            get_logger(),
            Counter(),
            concurrency=args.concurrency,
        )
        # One burst first, unmeasured: connections, statement caches, threads.
        asyncio.run(bursts(runner, sweeps, 0, 1))
        calls.clear()
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall = asyncio.run(bursts(runner, sweeps, 1, args.bursts))
        after = resource.getrusage(resource.RUSAGE_SELF)
        engine.dispose()
    runs = args.sweeps * args.bursts
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    switches = after.ru_nvcsw - before.ru_nvcsw
    kind = "async" if args.run_async else "sync"
    print(
        f"{args.dialect} {kind} concurrency {args.concurrency}: {runs} runs in {wall:.2f} s; "
        f"{cpu / runs * 1000:.3f} ms CPU per run; per 1,000 runs: "
        f"{calls['claim'] * 1000 // runs} claim, {calls['close'] * 1000 // runs} close, "
        f"{calls['other'] * 1000 // runs} other statements, "
        f"{switches * 1000 // runs} voluntary context switches"
    )


if __name__ == "__main__":
    main()
