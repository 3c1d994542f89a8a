"""Database calls off the loop: bounded in time, and batched per turn of the loop."""

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from manual_clock import ManualClock, settle
from structlog.testing import capture_logs

from sweepd.errors import StoreError
from sweepd.offload import Batcher, bounded
from sweepd.tasks import spawn


class Recorder:
    """Work that doubles numbers, records each batch, and fails where told."""

    def __init__(self, fail_item: int | None = None, fail_all: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.fail_item = fail_item
        self.fail_all = fail_all

    def __call__(self, items: list[int]) -> list[int | StoreError]:
        self.batches.append(items)
        if self.fail_all:
            raise StoreError("the database is gone", transient=True)
        return [StoreError(f"item {i} failed") if i == self.fail_item else 2 * i for i in items]


def test_items_of_one_turn_go_together_and_get_their_own_results() -> None:
    work = Recorder()

    async def scenario() -> tuple[list[int], list[int]]:
        batcher = Batcher(work)
        first = await asyncio.gather(*(batcher.submit(i) for i in range(5)))
        second = await asyncio.gather(batcher.submit(10), batcher.submit(11))
        return list(first), list(second)

    first, second = asyncio.run(scenario())
    assert first == [0, 2, 4, 6, 8]
    assert second == [20, 22]
    assert work.batches == [[0, 1, 2, 3, 4], [10, 11]]


def test_an_item_that_fails_fails_alone() -> None:
    async def scenario() -> list[int | BaseException]:
        batcher = Batcher(Recorder(fail_item=1))
        return await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)

    results = asyncio.run(scenario())
    assert results[0] == 0
    assert results[2] == 4
    assert isinstance(results[1], StoreError)
    assert str(results[1]) == "item 1 failed"


def test_a_batch_that_fails_fails_every_item_with_its_error() -> None:
    async def scenario() -> list[int | BaseException]:
        batcher = Batcher(Recorder(fail_all=True))
        return await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)

    results = asyncio.run(scenario())
    assert all(isinstance(result, StoreError) for result in results)
    assert {str(result) for result in results} == {"the database is gone"}


def test_a_cancelled_waiter_does_not_stop_the_others() -> None:
    async def scenario() -> tuple[int, bool]:
        batcher = Batcher(Recorder())
        doomed = asyncio.ensure_future(batcher.submit(1))
        kept = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return await kept, doomed.cancelled()

    assert asyncio.run(scenario()) == (4, True)


def test_a_call_returns_its_value_or_raises_its_own_error() -> None:
    def fails() -> None:
        raise StoreError("no such table", transient=False)

    async def scenario() -> tuple[int, BaseException | None]:
        value = await bounded(lambda a, b: a + b, 2, 3)
        try:
            await bounded(fails)
        except StoreError as error:
            return value, error
        return value, None

    value, error = asyncio.run(scenario())
    assert value == 5
    assert isinstance(error, StoreError)
    assert str(error) == "no such table"
    assert error.transient is False


def test_a_stuck_call_fails_at_its_bound_and_does_not_keep_the_loop_from_ending() -> None:
    """A hung database must not hold a draining daemon: the caller gives up at the
    bound, and ``asyncio.run`` returns although the call's thread is still blocked
    (asyncio's default executor would join that thread and wait forever)."""
    unblock = threading.Event()
    elapsed: list[float] = []
    errors: list[str] = []

    def stuck() -> None:
        unblock.wait()

    async def caller() -> None:
        began = time.monotonic()
        try:
            await bounded(stuck, timeout=0.2)
        except StoreError as error:
            errors.append(str(error))
        elapsed.append(time.monotonic() - began)

    runner = threading.Thread(target=lambda: asyncio.run(caller()), daemon=True)
    runner.start()
    runner.join(timeout=3.0)
    ended = not runner.is_alive()
    unblock.set()
    assert ended, "asyncio.run waited for the stuck call's thread"
    assert errors == ["stuck got no answer from the database within 0.2s"]
    assert 0.2 <= elapsed[0] < 1.0


def test_with_gather_items_of_later_turns_join_the_first_ones_call() -> None:
    work = Recorder()
    clock = ManualClock()

    async def scenario() -> list[int]:
        batcher = Batcher(work, gather=0.05, clock=clock)
        first = asyncio.ensure_future(batcher.submit(1))
        await settle()  # turns of the loop, the gather not over
        second = asyncio.ensure_future(batcher.submit(2))
        await settle()
        assert work.batches == []
        assert clock.waiting() == [0.05]  # one timer, set by the first item
        await clock.advance(0.05)
        return list(await asyncio.wait_for(asyncio.gather(first, second), 2))

    assert asyncio.run(scenario()) == [2, 4]
    assert work.batches == [[1, 2]]


@pytest.mark.parametrize(
    ("work", "message"),
    [
        (lambda items: 1 / 0, "<lambda> raised ZeroDivisionError: division by zero"),
        (lambda items: [], "batch raised RuntimeError: the batch answered 0 of 2 items"),
    ],
    ids=["raises", "answers-short"],
)
def test_a_batch_whose_work_has_a_bug_still_answers_every_item(
    work: Callable[[list[int]], list[int | StoreError]], message: str
) -> None:
    async def scenario() -> list[int | BaseException]:
        batcher = Batcher(work)
        submits = (batcher.submit(i) for i in range(2))
        return await asyncio.wait_for(asyncio.gather(*submits, return_exceptions=True), 2)

    results = asyncio.run(scenario())
    assert [str(r) for r in results] == [message] * 2
    assert all(isinstance(r, StoreError) for r in results)


def test_a_call_that_raises_a_bug_comes_back_as_a_store_error_with_its_cause() -> None:
    def broken() -> None:
        raise KeyError("name")

    async def scenario() -> BaseException | None:
        try:
            await bounded(broken)
        except StoreError as error:
            return error
        return None

    error = asyncio.run(scenario())
    assert str(error) == "broken raised KeyError: 'name'"
    assert isinstance(error, StoreError) and isinstance(error.__cause__, KeyError)


def test_a_spawned_task_that_fails_is_logged_with_its_error() -> None:
    async def doomed() -> None:
        raise ValueError("nobody awaits this")

    async def scenario() -> None:
        task = spawn(doomed(), name="doomed")
        await asyncio.gather(task, return_exceptions=True)
        await settle()

    with capture_logs() as logs:
        asyncio.run(scenario())
    (crashed,) = [e for e in logs if e["event"] == "daemon.task_crashed"]
    assert crashed["task"] == "doomed"
    assert crashed["error"] == "ValueError: nobody awaits this"
    assert crashed["log_level"] == "error"
