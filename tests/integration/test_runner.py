"""The runner on every dialect: what a replica learns from the ticks it loses."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sweepd.clock import SystemClock
from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.history import History
from sweepd.lease import LeaseStore
from sweepd.model import SweepDef
from sweepd.observe import get_logger
from sweepd.runner import Runner
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

    def runner(holder: str) -> Runner:
        return Runner(
            LeaseStore(engine, "runner"),
            History(engine, "runner"),
            holder,
            SystemClock(),
            get_logger(),
            Counter(),
            concurrency=200,
        )

    async def scenario() -> tuple[Runner, Runner, str, str]:
        a, b = runner("a"), runner("b")
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
