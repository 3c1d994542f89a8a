"""The slots: claims go out in batches no bigger than the free slots, and a
tick waiting for a slot holds nothing (§5)."""

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import pytest
from manual_clock import ManualClock, settle

from sweepd.errors import StoreError
from sweepd.slots import (
    GATHER_SECONDS,
    LOOKAHEAD,
    PEER_MEMORY_SECONDS,
    RETRY_CAP_SECONDS,
    RETRY_SECONDS,
    SMALLEST_SHARE,
    Peers,
    Slots,
)


class Database:
    """A fake claim: names in ``taken`` are lost, others won while the limit lasts.

    ``busy`` names are left undecided the first ``busy_calls`` times they are asked for.
    """

    def __init__(self, taken: frozenset[str] = frozenset(), busy_calls: int = 0) -> None:
        self.taken = taken
        self.busy_calls = busy_calls
        self.calls: list[tuple[list[str], int]] = []
        self.times: list[tuple[float, float]] = []  # time.monotonic() at each call and return
        self.fail = False
        self.bug: Exception | None = None  # raised as is, as a bug in the claim would be

    def claim(self, items: list[str], limit: int) -> list[str | StoreError | None]:
        self.calls.append((list(items), limit))
        called = time.monotonic()
        if self.fail:
            raise StoreError("the database is gone", transient=True)
        if self.bug is not None:
            raise self.bug
        out: list[str | StoreError | None] = []
        won = 0
        for item in items:
            if item in self.taken:
                out.append("lost")
            elif len(self.calls) <= self.busy_calls or won >= limit:
                out.append(None)
            else:
                won += 1
                out.append("won")
        self.times.append((called, time.monotonic()))
        return out


def slots_for(database: Database, size: int, clock: ManualClock | None = None) -> Slots[str, str]:
    return Slots(size, database.claim, holds=lambda result: result == "won", clock=clock)


def test_no_more_than_size_are_won_until_slots_come_back() -> None:
    database = Database()

    async def scenario() -> tuple[list[str | None], list[str | None], list[str | None]]:
        slots = slots_for(database, 2)
        tasks = [asyncio.ensure_future(slots.take(f"s{i}")) for i in range(5)]
        await asyncio.sleep(0.05)
        first = [t.result() for t in tasks if t.done()]
        assert slots.free == 0
        slots.give_back()
        slots.give_back()
        await asyncio.sleep(0.05)
        second = [t.result() for t in tasks if t.done()]
        slots.give_back()
        slots.give_back()
        await asyncio.sleep(0.05)
        return first, second, [t.result() for t in tasks]

    first, second, last = asyncio.run(scenario())
    assert first == ["won", "won"]
    assert second == ["won"] * 4
    assert last == ["won"] * 5
    assert all(limit <= 2 for _, limit in database.calls)
    # The first call went out once, at the end of the turn, with every tick waiting.
    assert database.calls[0] == (["s0", "s1", "s2", "s3", "s4"], 2)


def test_lost_ticks_are_answered_without_a_slot() -> None:
    database = Database(taken=frozenset({"s0", "s1", "s2"}))

    async def scenario() -> tuple[list[str | None], int]:
        slots = slots_for(database, 1)
        results = await asyncio.gather(
            slots.take("s0"), slots.take("s1"), slots.take("s2"), slots.take("s3")
        )
        return list(results), slots.free

    results, free = asyncio.run(scenario())
    assert results == ["lost", "lost", "lost", "won"]
    assert free == 0  # the one won holds its slot until given back
    assert len(database.calls) == 1


def test_a_call_looks_at_no_more_than_the_lookahead() -> None:
    database = Database(taken=frozenset(f"s{i}" for i in range(10)))

    async def scenario() -> None:
        slots = slots_for(database, 1)
        await asyncio.gather(*(slots.take(f"s{i}") for i in range(10)))

    asyncio.run(scenario())
    assert [len(items) for items, _ in database.calls] == [LOOKAHEAD, LOOKAHEAD, 10 - 2 * LOOKAHEAD]


def test_undecided_ticks_are_asked_for_again() -> None:
    database = Database(busy_calls=2)

    async def scenario() -> str | None:
        return await slots_for(database, 1).take("s0")

    assert asyncio.run(scenario()) == "won"
    assert len(database.calls) == 3


def test_a_failed_call_fails_its_ticks_and_frees_the_slots() -> None:
    database = Database()
    database.fail = True

    async def scenario() -> tuple[list[str | BaseException | None], int]:
        slots = slots_for(database, 2)
        results = await asyncio.gather(slots.take("s0"), slots.take("s1"), return_exceptions=True)
        return list(results), slots.free

    results, free = asyncio.run(scenario())
    assert all(isinstance(result, StoreError) for result in results)
    assert free == 2


def test_draining_answers_the_waiting_ticks_with_none() -> None:
    database = Database()

    async def scenario() -> list[str | None]:
        slots = slots_for(database, 1)
        tasks = [asyncio.ensure_future(slots.take(f"s{i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        slots.drain()
        late = await slots.take("s9")
        assert late is None
        return [await task for task in tasks]

    assert asyncio.run(scenario()) == ["won", None, None]


@pytest.mark.parametrize("size", [1, 3])
def test_a_cancelled_waiter_is_not_claimed_for(size: int) -> None:
    database = Database()

    async def scenario() -> None:
        slots = slots_for(database, size)
        blocker = [asyncio.ensure_future(slots.take(f"b{i}")) for i in range(size)]
        await asyncio.sleep(0.05)  # every slot held
        doomed = asyncio.ensure_future(slots.take("doomed"))
        await asyncio.sleep(0)
        doomed.cancel()
        await asyncio.sleep(0)
        slots.give_back()
        await asyncio.sleep(0.05)
        assert all(task.done() for task in blocker)

    asyncio.run(scenario())
    assert all("doomed" not in items for items, _ in database.calls)


def test_ticks_out_in_a_claim_when_draining_begins_are_answered() -> None:
    # The won one runs (dropping it would strand a lease until its TTL); the
    # undecided ones are answered None, so no flight waits forever.
    database = Database()
    gate = threading.Event()
    claim = database.claim

    def slow_claim(items: list[str], limit: int) -> list[str | StoreError | None]:
        gate.wait(5)
        return claim(items, limit)

    async def scenario() -> list[str | None]:
        slots = Slots(1, slow_claim, holds=lambda result: result == "won")
        tasks = [asyncio.ensure_future(slots.take(f"s{i}")) for i in range(3)]
        await asyncio.sleep(0.05)  # s0..s2 are out in one call, the gate shut
        slots.drain()
        gate.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), 5)

    assert asyncio.run(scenario()) == ["won", None, None]
    assert database.calls == [(["s0", "s1", "s2"], 1)]


async def calls_made(database: Database, count: int, within: float = 2.0) -> list[int]:
    """The limits of the calls made, once there are ``count`` of them (a bounded wait)."""
    deadline = asyncio.get_running_loop().time() + within
    while len(database.calls) < count:
        assert asyncio.get_running_loop().time() < deadline, database.calls
        await asyncio.sleep(0.001)
    return [limit for _, limit in database.calls]


def test_in_a_backlog_a_call_waits_for_the_busy_slots() -> None:
    # Slots that come back one after another would otherwise split into
    # groups that each pay a call for a tick or two.
    database = Database()

    async def scenario() -> None:
        slots = slots_for(database, 4)
        tasks = [asyncio.ensure_future(slots.take(f"s{i}")) for i in range(10)]
        assert await calls_made(database, 1) == [4]
        await asyncio.wait_for(asyncio.gather(*tasks[:4]), 2)  # won: every slot held
        slots.give_back()
        await asyncio.sleep(0)
        slots.give_back()
        await asyncio.sleep(0)
        slots.give_back()
        await asyncio.sleep(0)
        slots.give_back()
        assert await calls_made(database, 2) == [4, 4]
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


def test_a_gathering_call_leaves_with_the_free_slots_when_the_rest_stay_busy() -> None:
    database = Database()
    clock = ManualClock()

    async def scenario() -> None:
        slots = slots_for(database, 2, clock)
        tasks = [asyncio.ensure_future(slots.take(f"s{i}")) for i in range(5)]
        await asyncio.wait_for(asyncio.gather(*tasks[:2]), 2)  # both slots held
        slots.give_back()  # the other slot stays busy
        await settle()
        assert clock.waiting() == [GATHER_SECONDS]  # the call waits for the busy one
        assert len(database.calls) == 1
        await clock.advance(GATHER_SECONDS)
        assert await asyncio.wait_for(tasks[2], 2) == "won"
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())
    assert [limit for _, limit in database.calls] == [2, 1]


def test_without_a_backlog_a_tick_is_claimed_at_once() -> None:
    database = Database()  # the manual clock never moves: any wait would hang

    async def scenario() -> str | None:
        slots = slots_for(database, 2, ManualClock())
        await slots.take("busy")  # one slot held, one free
        return await asyncio.wait_for(slots.take("s0"), 1)

    assert asyncio.run(scenario()) == "won"
    assert [limit for _, limit in database.calls] == [2, 1]


def test_draining_ends_a_gather_and_answers_the_backlog() -> None:
    database = Database()
    clock = ManualClock()  # never moves: only the drain can end the gather

    async def scenario() -> list[str | None]:
        slots = slots_for(database, 2, clock)
        tasks = [asyncio.ensure_future(slots.take(f"s{i}")) for i in range(5)]
        await asyncio.wait_for(asyncio.gather(*tasks[:2]), 2)
        slots.give_back()  # a backlog, one slot busy: the next call gathers
        await settle()
        assert clock.waiting() == [GATHER_SECONDS]
        slots.drain()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 1))

    assert asyncio.run(scenario()) == ["won", "won", None, None, None]
    assert len(database.calls) == 1


class Ticking:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_replica_alone_claims_a_whole_burst_and_with_peers_its_share() -> None:
    clock = Ticking()
    peers = Peers(clock)
    assert peers.share(200) == 200
    peers.seen("b")
    peers.seen("c")
    peers.seen("b")
    assert peers.share(200) == 67  # three replicas: a third each, rounded up
    assert peers.share(20) == SMALLEST_SHARE  # a small burst is not split into tiny calls
    clock.now = PEER_MEMORY_SECONDS / 2
    peers.seen("c")
    clock.now = PEER_MEMORY_SECONDS + 1
    assert peers.share(200) == 100  # b is forgotten, c was seen since
    clock.now = 2 * PEER_MEMORY_SECONDS
    assert peers.share(200) == 200


def with_peers(*holders: str) -> Peers:
    peers = Peers(Ticking())
    for holder in holders:
        peers.seen(holder)
    return peers


def test_a_call_claims_no_more_than_its_share() -> None:
    database = Database()
    peers = with_peers("b", "c")

    async def scenario() -> list[str | None]:
        slots = Slots(
            200, database.claim, holds=lambda r: r == "won", share=peers.share, clock=ManualClock()
        )
        flights = [asyncio.ensure_future(slots.take(f"s{i}")) for i in range(90)]
        return await asyncio.gather(*flights)

    assert asyncio.run(asyncio.wait_for(scenario(), 5)) == ["won"] * 90
    limits = [limit for _, limit in database.calls]
    # A third of the 90 at first, with 170 slots still free; the rest follow at once.
    assert limits[0] == 30 and all(limit <= 30 for limit in limits), limits


def test_a_call_that_did_not_hold_back_is_followed_at_once() -> None:
    # Four slots and two peers: a share (at least SMALLEST_SHARE) is no bound.
    database = Database(taken=frozenset(f"s{i}" for i in range(4 * LOOKAHEAD - 2)))
    peers = with_peers("b", "c")

    async def scenario() -> list[str | None]:
        slots = Slots(
            4, database.claim, holds=lambda r: r == "won", share=peers.share, clock=ManualClock()
        )
        flights = (slots.take(f"s{i}") for i in range(4 * LOOKAHEAD + 2))
        return await asyncio.wait_for(asyncio.gather(*flights), 2)  # the clock never moves

    results = asyncio.run(scenario())
    assert results.count("won") == 4
    assert [limit for _, limit in database.calls] == [4, 2]  # won 2 of 4, then asked again


async def wait_until(condition: Any, within: float = 2.0) -> None:
    """A bounded wait for what a worker thread and the loop do next."""
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.001)


@pytest.mark.parametrize(
    "bug",
    [ValueError("boom"), RuntimeError("boom")],
    ids=["raises", "raises-runtime"],
)
def test_a_claim_that_raises_a_bug_answers_every_tick_and_frees_the_slots(
    bug: Exception,
) -> None:
    database = Database()
    database.bug = bug

    async def scenario() -> tuple[list[str | BaseException | None], int, str | None]:
        slots = slots_for(database, 2)
        asks = (slots.take(f"s{i}") for i in range(3))
        results = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 2)
        free = slots.free
        database.bug = None
        return list(results), free, await asyncio.wait_for(slots.take("later"), 2)

    results, free, later = asyncio.run(scenario())
    assert all(isinstance(result, StoreError) for result in results), results
    assert all(f"{type(bug).__name__}: boom" in str(result) for result in results)
    assert free == 2
    assert later == "won"  # the replica goes on claiming


def test_a_claim_that_answers_the_wrong_number_of_ticks_fails_them_all() -> None:
    async def scenario() -> list[str | BaseException | None]:
        slots: Slots[str, str] = Slots(2, lambda items, limit: ["won"], holds=lambda r: r == "won")
        asks = (slots.take(f"s{i}") for i in range(2))
        return list(await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 2))

    results = asyncio.run(scenario())
    assert all(isinstance(r, StoreError) and "answered 1 of 2" in str(r) for r in results)


def test_a_tick_won_after_its_flight_has_gone_is_handed_to_orphaned() -> None:
    database = Database()
    gate = threading.Event()
    orphans: list[tuple[str, str]] = []

    def slow_claim(items: list[str], limit: int) -> list[str | StoreError | None]:
        gate.wait(5)
        return database.claim(items, limit)

    async def scenario() -> tuple[int, str | None]:
        slots = Slots(
            2,
            slow_claim,
            holds=lambda r: r == "won",
            orphaned=lambda item, result: orphans.append((item, result)),
        )
        gone = asyncio.ensure_future(slots.take("gone"))
        stays = asyncio.ensure_future(slots.take("stays"))
        await settle()  # both out in one call, the gate shut
        gone.cancel()
        gate.set()
        result = await asyncio.wait_for(stays, 2)
        await wait_until(lambda: orphans)
        return slots.free, result

    free, result = asyncio.run(scenario())
    assert result == "won"
    assert orphans == [("gone", "won")]
    assert free == 1  # the orphan's slot came back; the other is held by "stays"


class Logged:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


def test_a_call_that_finds_every_row_busy_backs_off_to_a_cap_and_counts_it() -> None:
    database = Database(busy_calls=12)
    clock = ManualClock()
    stats: Counter[str] = Counter()
    log = Logged()
    waits: list[float] = []

    async def scenario() -> str | None:
        slots = Slots(1, database.claim, holds=lambda r: r == "won", clock=clock, stats=stats)
        slots.log = log
        taken = asyncio.ensure_future(slots.take("s0"))
        for call in range(1, 13):
            await wait_until(lambda call=call: len(database.calls) == call and clock.waiting())
            (wait,) = clock.waiting()
            waits.append(wait)
            await clock.advance(wait)
        return await asyncio.wait_for(taken, 2)

    assert asyncio.run(scenario()) == "won"
    doubling = [RETRY_SECONDS * 2**i for i in range(12)]
    assert waits == pytest.approx([min(RETRY_CAP_SECONDS, wait) for wait in doubling])
    assert waits[-1] == RETRY_CAP_SECONDS
    assert stats["claims.busy_retries"] == 12
    assert [event for event, _ in log.warnings] == ["lease.rows_busy"]  # once per spell
