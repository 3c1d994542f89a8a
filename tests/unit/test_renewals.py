"""The renewals: every lease a replica holds renewed in one call a beat, and
lost, loudly, when it is gone or the database has been away too long (§6)."""

import asyncio
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from manual_clock import ManualClock

from sweepd.errors import StoreError
from sweepd.model import SweepDef
from sweepd.runner import RENEW_SECONDS, Held, Renewals
from sweepd.schedule import Every

TTL = timedelta(seconds=3)


def sweep(name: str, ttl: timedelta = TTL) -> SweepDef:
    return SweepDef(
        name=name,
        func=lambda: None,
        target="tests:nothing",
        schedule=Every(timedelta(seconds=1)),
        ttl=ttl,
        timeout=None,
        misfire_grace=timedelta(seconds=1),
    )


class Store:
    """A fake tick store's ``renew``: every lease is still held unless named in ``gone``."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gone: set[str] = set()
        self.fail = False
        self.hold_up: threading.Event | None = None  # set: the call may return

    def renew(self, held: list[tuple[str, int, timedelta]]) -> set[str]:
        self.calls.append([name for name, _, _ in held])
        if self.hold_up is not None:
            self.hold_up.wait(5)
        if self.fail:
            raise StoreError("the database is gone", transient=True)
        return {name for name, _, _ in held} - self.gone


class Rig:
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.store = Store()
        self.lost: list[tuple[str, str]] = []
        self.errors = 0
        self.renewals = Renewals(
            self.store,  # type: ignore[arg-type]
            self.clock,
            on_lost=self._lost,
            on_error=self._error,
        )
        self.events: dict[str, threading.Event] = {}

    def _lost(self, held: Held, why: str) -> None:
        self.lost.append((held.sweep.name, why))

    def _error(self, error: StoreError, leases: int) -> None:
        self.errors += 1

    def hold(self, name: str, ttl: timedelta = TTL) -> None:
        self.events[name] = threading.Event()
        self.renewals.hold(sweep(name, ttl), 1, self.events[name], log=None)

    async def beat(self, seconds: float = RENEW_SECONDS, calls: int | None = None) -> None:
        """Move the clock on; wait for the renewal calls expected by then, and their answers."""
        await self.clock.advance(seconds)
        if calls is not None:
            await until(lambda: len(self.store.calls) >= calls)
        await asyncio.sleep(0.05)  # the answer's hop back onto the loop


async def until(condition: Callable[[], bool], seconds: float = 2.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), seconds)


def run(scenario: Callable[[Rig], Any]) -> Rig:
    rig = Rig()
    asyncio.run(scenario(rig))
    return rig


def test_one_call_a_beat_renews_every_lease_due() -> None:
    async def scenario(rig: Rig) -> None:
        for i in range(16):
            rig.hold(f"s{i}")
        await rig.clock.advance(0.9)
        rig.hold("late")  # claimed a tenth of a second before the beat
        await rig.beat(0.1, calls=1)
        await rig.beat(calls=2)
        await rig.beat(calls=3)

    rig = run(scenario)
    early = [f"s{i}" for i in range(16)]
    # The late one is too young at the first beat; from the second on, all go together.
    assert rig.store.calls == [early, [*early, "late"], [*early, "late"]]
    assert rig.lost == [] and rig.errors == 0


def test_a_run_shorter_than_half_a_beat_costs_no_renewal() -> None:
    async def scenario(rig: Rig) -> None:
        rig.hold("quick")
        await rig.clock.advance(0.3)
        rig.renewals.drop("quick")
        await rig.beat()
        await rig.beat()
        assert rig.clock.waiting() == []  # nothing held: no beat is set

    rig = run(scenario)
    assert rig.store.calls == []


def test_a_lease_the_renewal_no_longer_finds_is_lost_and_renewed_no_more() -> None:
    async def scenario(rig: Rig) -> None:
        rig.hold("kept")
        rig.hold("taken")
        rig.store.gone = {"taken"}
        await rig.beat(calls=1)
        assert rig.events["taken"].is_set()
        assert not rig.events["kept"].is_set()
        await rig.beat(calls=2)

    rig = run(scenario)
    assert rig.lost == [("taken", "taken")]
    assert rig.store.calls == [["kept", "taken"], ["kept"]]


def test_renewals_failing_for_two_thirds_of_the_ttl_lose_the_lease() -> None:
    async def scenario(rig: Rig) -> None:
        rig.store.fail = True
        rig.hold("short")  # 3 s: lost once failing renewals are 1.5 s old
        rig.hold("long", ttl=timedelta(seconds=30))  # lost at 19.5 s
        await rig.beat(calls=1)
        assert rig.lost == [] and rig.errors == 1  # a failure, but 1 s is not too long yet
        await rig.beat(calls=2)
        assert rig.lost == [("short", "unreachable")]
        assert rig.events["short"].is_set()
        for _ in range(3, 20):  # to 19 s: the long one is renewed from 10 s on, failing
            await rig.beat()
        assert rig.lost == [("short", "unreachable")]
        await rig.beat()  # 20 s
        assert rig.lost == [("short", "unreachable"), ("long", "unreachable")]

    rig = run(scenario)
    # Renewed when its ttl/3 came due, then retried every beat while it failed.
    assert rig.store.calls == [["short"], ["short"], *[["long"]] * 11]


def test_a_lease_whose_run_ended_while_its_renewal_was_out_is_not_lost() -> None:
    async def scenario(rig: Rig) -> None:
        rig.store.hold_up = threading.Event()
        rig.hold("ending")
        await rig.clock.advance(RENEW_SECONDS)
        await until(lambda: len(rig.store.calls) == 1)
        rig.renewals.drop("ending")  # released as the renewal was out
        rig.store.gone = {"ending"}
        rig.store.hold_up.set()
        await asyncio.sleep(0.05)

    rig = run(scenario)
    assert rig.lost == []


def test_a_ttl_shorter_than_three_beats_is_renewed_every_third_of_it() -> None:
    async def scenario(rig: Rig) -> None:
        rig.hold("brief", ttl=timedelta(milliseconds=600))
        assert rig.clock.waiting() == [pytest.approx(0.2)]
        await rig.beat(0.2, calls=1)

    rig = run(scenario)
    assert rig.store.calls == [["brief"]]
