"""The single-flight queue and the misfire rule, with time in the test's hands.

The runner is replaced by one whose runs end when the test says so: these
tests are about which ticks the daemon hands over, not about the lease
(which the integration and system tests exercise on real databases).
"""

import asyncio
from collections.abc import Callable, Iterator, MutableMapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from structlog.testing import capture_logs

from sweepd.daemon import Daemon, Flight, _Due
from sweepd.db.engine import make_engine
from sweepd.model import Coalesce, Database, Settings, SweepDef
from sweepd.schedule import Every

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class FakeClock:
    def __init__(self) -> None:
        self.current = T0

    def now(self) -> datetime:
        return self.current

    def monotonic(self) -> float:
        return (self.current - T0).total_seconds()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.Handle:
        return asyncio.get_running_loop().call_soon(callback)


class HeldRunner:
    """Runs that last until ``finish()``; records which ticks were run.

    With ``claims``, a run's tick is claimed from its start (``holds`` says
    so); without, every run's tick is still waiting for a slot until it ends.
    """

    def __init__(self, claims: bool = False) -> None:
        self.ran: list[tuple[str, datetime | None]] = []
        self.gate = asyncio.Event()
        self.claims = claims
        self.held: set[str] = set()

    def holds(self, name: str) -> bool:
        return name in self.held

    async def execute(
        self, sweep: SweepDef, tick: datetime | None, trigger: str = "schedule"
    ) -> str:
        self.ran.append((sweep.name, tick))
        if self.claims:
            self.held.add(sweep.name)
        await self.gate.wait()
        self.gate.clear()
        self.held.discard(sweep.name)
        return "success"

    async def finish(self) -> None:
        self.gate.set()
        for _ in range(5):
            await asyncio.sleep(0)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'q.db'}")
    yield engine
    engine.dispose()


def daemon_for(
    engine: Engine, coalesce: Coalesce = "latest", grace: float = 1.0, claimed: bool = False
) -> tuple[Daemon, HeldRunner]:
    sweep = SweepDef(
        name="slow",
        func=lambda: None,
        target="x:y",
        schedule=Every(timedelta(seconds=1)),
        ttl=timedelta(seconds=30),
        timeout=None,
        misfire_grace=timedelta(seconds=grace),
        coalesce=coalesce,
    )
    settings = Settings(
        path="c.yaml",
        database=Database("sqlite://", explicit=True),
        sweeps=(sweep,),
        health_listen="",  # the HTTP side is tests/system/test_health.py's
    )
    daemon = Daemon(settings, engine, clock=FakeClock())
    runner = HeldRunner(claims=claimed)
    daemon.runner.execute = runner.execute  # type: ignore[method-assign]
    daemon.runner.holds = runner.holds  # type: ignore[method-assign]
    daemon.flights["slow"] = Flight(sweep)
    daemon._generation["slow"] = 1
    return daemon, runner


def fire(daemon: Daemon, tick: float, now: float | None = None) -> None:
    due = _Due(at(tick), 0.0, 0, at(tick), "slow", 1)
    daemon._fire(due, at(now if now is not None else tick))


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.mark.parametrize(("coalesce", "expected_second"), [("latest", 3), ("earliest", 1)])
def test_one_runs_one_waits_the_rest_fold(
    engine: Engine, coalesce: Coalesce, expected_second: int
) -> None:
    async def scenario() -> None:
        daemon, runner = daemon_for(engine, coalesce)
        for second in range(4):  # 0 runs; 1 waits; 2 and 3 fold into the waiting one
            fire(daemon, second)
            await asyncio.sleep(0)
        assert runner.ran == [("slow", at(0))]
        assert daemon.stats["ticks.queued"] == 1
        assert daemon.stats["skipped.coalesced"] == 2
        await runner.finish()
        assert runner.ran == [("slow", at(0)), ("slow", at(expected_second))]
        await runner.finish()
        assert daemon.flights["slow"].task is None  # nothing left: the flight lands

    run(scenario())


def short_of_slots(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "daemon.short_of_slots"]


def test_folding_behind_a_tick_not_yet_claimed_is_a_warning_a_minute(engine: Engine) -> None:
    async def scenario() -> list[MutableMapping[str, Any]]:
        daemon, runner = daemon_for(engine)  # tick 0 waits for a slot throughout
        with capture_logs() as logs:
            for second in range(4):  # 1 waits; 2 and 3 fold in front of an unstarted 0
                fire(daemon, second)
                await asyncio.sleep(0)
            assert isinstance(daemon.clock, FakeClock)
            daemon.clock.current = at(60)  # a minute after the first line
            fire(daemon, 60)
        await runner.finish()
        await runner.finish()
        return logs

    first, second = short_of_slots(run(scenario()))
    assert first["log_level"] == "warning"
    assert (first["sweep"], first["folded"], first["waiting"]) == ("slow", 1, 1)
    assert first["concurrency"] == 4
    assert second["folded"] == 2  # tick 3's fold, said with tick 60's


def test_folding_behind_a_long_run_is_quiet(engine: Engine) -> None:
    async def scenario() -> list[MutableMapping[str, Any]]:
        daemon, runner = daemon_for(engine, claimed=True)  # tick 0 is claimed and running
        with capture_logs() as logs:
            for second in range(4):
                fire(daemon, second)
                await asyncio.sleep(0)
        assert daemon.stats["skipped.coalesced"] == 2
        await runner.finish()
        await runner.finish()
        return logs

    assert short_of_slots(run(scenario())) == []


def test_a_late_tick_is_missed_not_run(engine: Engine) -> None:
    async def scenario() -> None:
        daemon, runner = daemon_for(engine, grace=1.0)
        fire(daemon, 10, now=10.5)  # within grace: runs
        await asyncio.sleep(0)
        fire(daemon, 11, now=12.5)  # 1.5 s late: missed
        assert runner.ran == [("slow", at(10))]
        assert daemon.stats["skipped.missed"] == 1
        await runner.finish()

    run(scenario())


def test_falling_far_behind_counts_every_missed_tick_and_jumps_to_now(engine: Engine) -> None:
    async def scenario() -> None:
        daemon, _runner = daemon_for(engine, grace=1.0)
        daemon._heap.clear()
        fire(daemon, 100, now=160)  # a host suspended for a minute
        assert daemon.stats["skipped.missed"] == 59  # ticks 100..158, each accounted for
        (following,) = daemon._heap
        # Tick 159 is exactly misfire_grace late: still runnable, so the loop
        # resumes there, at the present, with no burst of stale ticks.
        assert following.tick == at(159)

    run(scenario())


def test_draining_drops_new_ticks_with_a_reason(engine: Engine) -> None:
    async def scenario() -> None:
        daemon, runner = daemon_for(engine)
        daemon.stop()
        fire(daemon, 0)
        await asyncio.sleep(0)
        assert runner.ran == []
        assert daemon.stats["skipped.draining"] == 1

    run(scenario())


class BusyClock(FakeClock):
    """Time that passes while the loop works: every reading is 2 ms after the last."""

    def __init__(self) -> None:
        super().__init__()
        self.timers: list[datetime] = []  # when each timer asked for would ring

    def now(self) -> datetime:
        self.current += timedelta(milliseconds=2)
        return self.current

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.Handle:
        self.timers.append(self.current + timedelta(seconds=seconds))
        return asyncio.get_running_loop().call_later(3600, callback)  # never, in the test


async def one_sleep(daemon: Daemon, clock: BusyClock) -> datetime:
    """Let the loop fire what is due and go to sleep; return when its timer rings."""
    loop = asyncio.create_task(daemon._loop())
    while not clock.timers:
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # the flights it started take their first step
    daemon.stop()
    await loop
    return clock.timers[0]


def test_the_sleep_after_a_burst_counts_from_after_it(engine: Engine) -> None:
    async def scenario() -> None:
        daemon, runner = daemon_for(engine)
        clock = BusyClock()
        daemon.clock = clock
        daemon._push(daemon.flights["slow"].sweep, at(0), 1)
        rings = await one_sleep(daemon, clock)
        assert runner.ran == [("slow", at(0))]
        # Asked for at 4 ms, after the burst, for the next tick's time.
        assert abs((rings - at(1)).total_seconds()) < 1e-6, rings
        await runner.finish()

    run(scenario())


def test_daemon_started_counts_the_configs_sweeps_as_check_config_does(engine: Engine) -> None:
    # Not the internal history sweep, which check-config does not list either.
    daemon, _ = daemon_for(engine)

    async def scenario() -> None:
        daemon.stop()
        await daemon.run()

    with capture_logs() as logs:
        run(scenario())
    (started,) = [e for e in logs if e["event"] == "daemon.started"]
    assert started["sweeps"] == len(daemon.settings.sweeps) == 1


def test_watchers_hear_start_reload_drain_and_stop_in_order(engine: Engine) -> None:
    daemon, runner = daemon_for(engine)
    daemon._reload = lambda: daemon.settings
    states: list[str] = []
    daemon.watchers.append(states.append)

    async def scenario() -> None:
        running = asyncio.ensure_future(daemon.run())
        await asyncio.sleep(0)
        daemon.request_reload()
        for _ in range(20):
            await asyncio.sleep(0)
        daemon.stop()
        daemon.stop()  # a second stop tells nobody again
        while not running.done():  # the runs the first ticks started end
            await runner.finish()
        await running

    run(scenario())
    assert states == ["started", "reloading", "reloaded", "draining", "stopped"]
