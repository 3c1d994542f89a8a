"""Database work sent off the event loop: bounded in time, and batched.

The loop never waits on the database itself: every call goes to a worker
thread, and the loop gives up on it after a bound. Calls that flights make
in the same turn of the loop travel together, so a burst of ticks costs a
few thread hops and statements instead of several per tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sweepd.errors import StoreError

T = TypeVar("T")
Item = TypeVar("Item")
Result = TypeVar("Result")

# How long any one database call may take before the daemon stops waiting for
# it. The engines bound connect and statement times themselves; this catches
# what they cannot, such as a server that accepts bytes and never answers.
DB_CALL_SECONDS = 15.0


async def bounded(call: Callable[..., T], *args: Any, timeout: float = DB_CALL_SECONDS) -> T:
    """Run a blocking database call on a thread, giving up on it after ``timeout``.

    The thread may stay blocked; the caller goes on and treats the call as
    failed, so a hung database makes ticks fail loudly instead of stalling.
    """
    try:
        return await asyncio.wait_for(asyncio.to_thread(call, *args), timeout)
    except TimeoutError:
        name = getattr(call, "__name__", "database call")
        raise StoreError(
            f"{name} got no answer from the database within {timeout:g}s", transient=True
        ) from None


class Batcher(Generic[Item, Result]):
    """Gathers the items submitted in one turn of the loop into one bounded call.

    ``work`` gets the items in submission order and returns one result per
    item, a ``StoreError`` standing for an item that failed on its own; if
    ``work`` raises, every item of the batch fails with that error. No item
    waits for a batch to fill: the batch leaves at the end of the turn in
    which its first item came.
    """

    def __init__(self, work: Callable[[list[Item]], list[Result | StoreError]]) -> None:
        self.work = work
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def submit(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self._pending.append((item, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)  # held, so the task is not collected mid-flight
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            results = await bounded(self.work, [item for item, _ in batch])
        except StoreError as error:
            results = [error] * len(batch)
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # its flight was cancelled while waiting
                continue
            if isinstance(result, StoreError):
                future.set_exception(result)
            else:
                future.set_result(result)
