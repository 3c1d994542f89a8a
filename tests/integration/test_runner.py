"""The runner on every dialect: what a replica learns from the ticks it loses, and
how each way a run can end is recorded."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select
from structlog.testing import capture_logs
from tcp_proxy import proxy_for

from sweepd.clock import SystemClock
from sweepd.context import SweepContext
from sweepd.db import migrate
from sweepd.db.engine import db_now, make_engine
from sweepd.db.schema import sweep_leases, sweep_runs
from sweepd.history import History
from sweepd.lease import LeaseStore
from sweepd.model import SweepDef
from sweepd.observe import get_logger
from sweepd.runner import ORPHANED_ERROR, Runner
from sweepd.schedule import Every

TICK = datetime(2026, 1, 1, tzinfo=UTC)  # in the past: the claim refuses ticks from the future
SWEEP = SweepDef(
    name="sweep",
    func=lambda: None,
    target="tests:nothing",
    schedule=Every(timedelta(minutes=1)),
    ttl=timedelta(seconds=30),
    timeout=None,
    misfire_grace=timedelta(minutes=5),
)


def test_a_replica_that_loses_a_tick_to_another_claims_its_share_of_a_burst(
    dialect: str, make_database: Callable[[str], str]
) -> None:
    url = make_database(dialect)
    migrate.upgrade(url)
    engine = make_engine(url)

    async def scenario() -> tuple[Runner, Runner, str, str]:
        a, b = runner_on(engine, "a", concurrency=200), runner_on(engine, "b", concurrency=200)
        first = await a.execute(SWEEP, TICK)
        second = await b.execute(SWEEP, TICK)
        return a, b, first, second

    try:
        a, b, first, second = asyncio.run(scenario())
    finally:
        engine.dispose()
    assert (first, second) == ("success", "already_run")
    assert a.peers.share(200) == 200  # it won: as far as it knows, it is alone
    assert b.peers.share(200) == 100  # it lost to a: half of a burst each


def runner_on(engine: Engine, holder: str = "a", **fields: Any) -> Runner:
    return Runner(
        LeaseStore(engine, "runner"),
        History(engine, "runner"),
        holder,
        SystemClock(),
        get_logger(),
        Counter(),
        **fields,
    )


def rows(engine: Engine) -> list[Any]:
    with engine.connect() as connection:
        return list(connection.execute(select(sweep_runs)).mappings())


def lease_free(engine: Engine) -> bool:
    with engine.connect() as connection:
        expires = connection.execute(select(sweep_leases.c.expires_at)).scalar_one()
        return bool(expires <= connection.execute(select(db_now())).scalar_one())


async def within(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """A bounded wait for what the runner does on its own, after the call returned."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not await asyncio.to_thread(condition):
        assert asyncio.get_running_loop().time() < deadline, "not within the bound"
        await asyncio.sleep(0.05)


def test_a_tick_won_for_a_flight_that_has_gone_is_given_back_and_says_so(
    dialect: str, make_database: Callable[[str], str]
) -> None:
    url = make_database(dialect)
    migrate.upgrade(url)
    engine = make_engine(url)
    runner = runner_on(engine)
    claim = runner._slots.claim
    asked, gate = threading.Event(), threading.Event()

    def held_claim(asks: list[Any], limit: int) -> list[Any]:
        asked.set()
        gate.wait(10)
        return claim(asks, limit)

    runner._slots.claim = held_claim

    async def scenario() -> None:
        flight = asyncio.ensure_future(runner.execute(SWEEP, TICK))
        assert await asyncio.to_thread(asked.wait, 10)
        flight.cancel()  # the flight goes while its claim is out
        gate.set()
        await within(lambda: bool(rows(engine)) and rows(engine)[0]["status"] != "running")
        await within(lambda: lease_free(engine))

    try:
        with capture_logs() as logs:
            asyncio.run(scenario())
        (row,) = rows(engine)
    finally:
        engine.dispose()
    assert (row["status"], row["error"]) == ("cancelled", ORPHANED_ERROR)
    assert runner.stats["ticks.orphaned"] == 1
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["tick.orphaned"]


def broken(ctx: SweepContext) -> None:
    raise ValueError("the sweep's own bug")


def test_a_failed_run_logs_its_traceback_with_the_sweeps_file_and_line(
    make_database: Callable[[str], str],
) -> None:
    url = make_database("sqlite")
    migrate.upgrade(url)
    engine = make_engine(url)
    sweep = replace(SWEEP, func=broken, takes_context=True)
    try:
        with capture_logs() as logs:
            status = asyncio.run(runner_on(engine).execute(sweep, TICK))
        (row,) = rows(engine)
    finally:
        engine.dispose()
    assert status == "failed"
    assert row["error"] == "ValueError: the sweep's own bug"
    (finished,) = [e for e in logs if e["event"] == "run.finished"]
    assert finished["error"] == "ValueError: the sweep's own bug"
    line = broken.__code__.co_firstlineno + 1
    assert f'File "{__file__}", line {line}, in broken' in finished["exception"]
    assert finished["exception"].endswith("ValueError: the sweep's own bug")


def test_a_sync_run_past_its_timeout_is_recorded_timeout_while_its_thread_still_runs(
    make_database: Callable[[str], str],
) -> None:
    url = make_database("sqlite")
    migrate.upgrade(url)
    engine = make_engine(url)
    release = threading.Event()

    def stubborn(ctx: SweepContext) -> None:
        release.wait(10)  # ignores ctx.cancelled

    sweep = replace(SWEEP, func=stubborn, takes_context=True, timeout=timedelta(milliseconds=200))

    async def scenario() -> tuple[str, Any]:
        runner = runner_on(engine)
        flight = asyncio.ensure_future(runner.execute(sweep, TICK))
        await within(lambda: bool(rows(engine)) and rows(engine)[0]["status"] != "running")
        (meanwhile,) = rows(engine)
        assert not flight.done()  # the thread still has its lease and its slot
        assert not lease_free(engine)
        release.set()
        return await flight, meanwhile

    try:
        status, meanwhile = asyncio.run(scenario())
        (row,) = rows(engine)
    finally:
        engine.dispose()
    assert status == "timeout"
    for found in (meanwhile, row):
        assert (found["status"], found["error"]) == ("timeout", "timed out after 200ms")


@pytest.mark.parametrize("server", ["postgresql", "mariadb"])
def test_a_release_that_failed_is_retried_as_soon_as_the_database_answers(
    server: str, make_database: Callable[[str], str]
) -> None:
    url = make_database(server)
    migrate.upgrade(url)
    proxy, proxied = proxy_for(url)
    engine, direct = make_engine(proxied, timeout=timedelta(seconds=2)), make_engine(url)

    def goes_away() -> None:
        proxy.stop()  # while the run is in flight: its row and its release fail

    sweep = replace(SWEEP, func=goes_away)

    async def scenario() -> Runner:
        runner = runner_on(engine)
        assert await runner.execute(sweep, TICK) == "success"
        assert list(runner.unreleased) == [SWEEP.name]
        assert not await asyncio.to_thread(lease_free, direct)  # its ttl is 30 s
        proxy.start()
        await within(lambda: not runner.unreleased and not runner.unfinished)
        return runner

    try:
        with capture_logs() as logs:
            asyncio.run(scenario())
        free, (row,) = lease_free(direct), rows(direct)
    finally:
        proxy.stop()
        engine.dispose()
        direct.dispose()
    assert free
    assert row["status"] == "success"
    (failed,) = [e for e in logs if e["event"] == "lease.release_failed"]
    assert "lease release" in failed["error"] or "run finish" in failed["error"], failed
    assert [e["released"] for e in logs if e["event"] == "lease.released_late"] == [True]


def test_settles_at_once_write_each_late_ending_once(make_database: Callable[[str], str]) -> None:
    # A probe and a flight's next tick both settle after an outage; the two
    # used to write the same ending and then both remove it (ValueError).
    url = make_database("sqlite")
    migrate.upgrade(url)
    engine = make_engine(url)
    history = History(engine, "runner")
    run_ids = [history.start(f"sweep-{i}", TICK, "a", 1, 1, "schedule") for i in range(3)]

    async def scenario() -> Runner:
        runner = runner_on(engine)
        runner.unfinished = [
            (run_id, f"sweep-{i}", "success", None) for i, run_id in enumerate(run_ids)
        ]
        await asyncio.gather(runner.settle(), runner.settle(), runner.settle())
        return runner

    try:
        with capture_logs() as logs:
            runner = asyncio.run(scenario())
        statuses = [row["status"] for row in rows(engine)]
    finally:
        engine.dispose()
    assert runner.unfinished == []
    assert statuses == ["success"] * 3
    assert sorted(e["run_id"] for e in logs if e["event"] == "run.recorded_late") == run_ids
    assert not [e for e in logs if e["event"] == "daemon.task_crashed"]
