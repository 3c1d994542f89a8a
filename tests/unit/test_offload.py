"""The batcher: what flights ask for in one turn of the loop travels as one call."""

import asyncio

import pytest

from sweepd.errors import StoreError
from sweepd.offload import Batcher


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
