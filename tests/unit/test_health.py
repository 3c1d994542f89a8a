"""The health side with time in the test's hands: what the pulse records, and
what each endpoint answers from it."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

from manual_clock import T0, ManualClock, settle
from structlog.testing import capture_logs

from sweepd.errors import StoreError
from sweepd.health import (
    ALIVE_WITHIN,
    CHECK_SECONDS,
    PULSE_SECONDS,
    READY_WITHIN,
    HealthServer,
    Pulse,
    Vitals,
    alive,
    ready,
)
from sweepd.metrics import Metrics
from sweepd.observe import get_logger


def test_alive_while_the_loop_turned_lately_and_ready_while_the_database_answered() -> None:
    vitals = Vitals()
    assert not alive(vitals, 0.0)
    assert ready(vitals, 0.0) == "the database has not answered lately"
    vitals.turned_at, vitals.answered_at = 10.0, 10.0
    assert alive(vitals, 10.0 + ALIVE_WITHIN)
    assert not alive(vitals, 10.0 + ALIVE_WITHIN + 0.1)
    assert ready(vitals, 10.0 + READY_WITHIN) is None
    assert ready(vitals, 10.0 + READY_WITHIN + 0.1) == "the database has not answered lately"
    vitals.draining = True
    assert ready(vitals, 10.0) == "draining"


class Database:
    """The database's clock, 0.25 s behind this host's, until it goes away."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.gone = False
        self.asked = 0

    def now(self) -> object:
        self.asked += 1
        if self.gone:
            raise StoreError("the database is gone", transient=True)
        return self.clock.now() - timedelta(seconds=0.25)


async def answered(vitals: Vitals, asked: int, database: Database) -> None:
    """A bounded wait for the check's thread to come back."""
    for _ in range(400):
        if database.asked >= asked and vitals.answered_at is not None:
            return
        await asyncio.sleep(0.005)


def test_the_pulse_records_each_turn_and_checks_the_database_every_other_second() -> None:
    clock = ManualClock()
    vitals, metrics = Vitals(), Metrics()
    database = Database(clock)

    async def scenario() -> list[str]:
        pulse = Pulse(vitals, clock, database.now, metrics, get_logger())
        pulse.start()
        await answered(vitals, 1, database)
        assert (vitals.turned_at, vitals.answered_at) == (0.0, 0.0)
        assert vitals.skew == 0.25
        await clock.advance(PULSE_SECONDS)
        assert vitals.turned_at == PULSE_SECONDS and database.asked == 1  # not due yet
        database.gone = True
        await clock.advance(CHECK_SECONDS - PULSE_SECONDS)
        for _ in range(400):  # the failed check's thread
            if database.asked == 2:
                break
            await asyncio.sleep(0.005)
        await settle()
        pulse.stop()
        return [str(clock.waiting())]

    with capture_logs() as logs:
        asyncio.run(scenario())
    assert database.asked == 2
    assert vitals.answered_at == 0.0  # the failed check changed nothing
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "health.database_unreachable"
    ]
    assert metrics.clock_skew._value.get() == 0.25


def test_each_endpoint_answers_from_the_vitals_alone() -> None:
    clock = ManualClock()
    vitals, metrics = Vitals(), Metrics()
    server = HealthServer("127.0.0.1:0", vitals, clock, metrics)
    try:
        assert server.answer("/healthz")[0] == 503
        assert server.answer("/readyz")[0] == 503
        vitals.turned_at = vitals.answered_at = 0.0
        assert server.answer("/healthz") == (200, "text/plain", b"ok\n")
        assert server.answer("/readyz") == (200, "text/plain", b"ready\n")
        status, kind, body = server.answer("/metrics")
        assert (status, kind) == (200, "text/plain; version=0.0.4; charset=utf-8")
        assert b"sweepd_ready 1.0" in body
        vitals.draining = True
        assert server.answer("/readyz") == (503, "text/plain", b"not ready: draining\n")
        assert b"sweepd_ready 0.0" in server.answer("/metrics")[2]
        assert server.answer("/other")[0] == 404
        assert server.listening.startswith("127.0.0.1:")
    finally:
        server.stop()
    assert clock.now() == T0


def test_a_check_stuck_on_a_hung_database_is_not_joined_by_another() -> None:
    clock = ManualClock()
    vitals = Vitals()
    release = threading.Event()
    asked: list[int] = []

    def hung() -> object:
        asked.append(1)
        release.wait(10)
        return clock.now()

    async def scenario() -> None:
        pulse = Pulse(vitals, clock, hung, Metrics(), get_logger())
        pulse.start()
        # The check gives up after its bound (real time: bounded's own timer)...
        await asyncio.sleep(CHECK_SECONDS + 0.3)
        for _ in range(4):  # ...and the pulses past several checks' times send none
            await clock.advance(CHECK_SECONDS)
        pulse.stop()
        release.set()

    asyncio.run(scenario())
    assert asked == [1]
    assert vitals.answered_at is None
