"""Database work sent off the event loop: bounded in time, and batched.

The loop never waits on the database itself: every call goes to a worker
thread, and the loop gives up on it after a bound. Calls that flights make
in the same turn of the loop travel together, so a burst of ticks costs a
few thread hops and statements instead of several per tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from sweepd.clock import Clock, SystemClock
from sweepd.errors import StoreError
from sweepd.tasks import spawn

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
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    DB_THREADS.run(loop, future, call, args)
    timer = loop.call_later(timeout, _give_up, future, call, timeout)
    try:
        return await future
    except StoreError:
        raise
    except Exception as error:
        raise unexpected(getattr(call, "__name__", "database call"), error) from error
    finally:
        timer.cancel()


def unexpected(operation: str, error: Exception) -> StoreError:
    """A store call that raised something other than ``StoreError``: a bug, or a
    driver error no layer below named. Callers handle it as they handle any
    failed call (loudly, and the daemon goes on); its type and message stay in
    the text, the exception itself in ``__cause__``."""
    fault = StoreError(f"{operation} raised {type(error).__name__}: {error}")
    fault.__cause__ = error
    return fault


def _give_up(future: asyncio.Future[Any], call: Callable[..., Any], timeout: float) -> None:
    if not future.done():
        name = getattr(call, "__name__", "database call")
        future.set_exception(
            StoreError(
                f"{name} got no answer from the database within {timeout:g}s", transient=True
            )
        )


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # given up on, or its caller was cancelled
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


# A call for a thread: the loop to answer on, its future, the call, its arguments.
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class Threads:
    """Daemon threads that make blocking calls for the loop, kept for the next
    call when one returns, and at most ``size`` of them (None: no bound).

    Not a ThreadPoolExecutor, for two reasons. Its hop costs a concurrent
    future chained to an asyncio one, both ways, on every call: about 7 % of
    a run's CPU in a burst. And its threads are joined at interpreter exit,
    so a call stuck on a hung database, or a sync sweep that ignores
    ``ctx.cancelled``, would keep a drained daemon from ever exiting.
    """

    def __init__(self, name: str, size: int | None = None) -> None:
        self.name, self.size = name, size
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._busy = 0  # calls handed over whose code has not returned

    def run(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        call: Callable[..., Any],
        args: tuple[Any, ...] = (),
    ) -> None:
        """Make ``call(*args)`` on a thread; its outcome settles ``future`` on ``loop``."""
        with self._lock:
            self._busy += 1
            spawn = self._busy > self._threads and (self.size is None or self._threads < self.size)
            self._threads += spawn
        self._jobs.put((loop, future, call, args))
        if spawn:
            threading.Thread(target=self._serve, name=self.name, daemon=True).start()

    def busy(self) -> int:
        with self._lock:
            return self._busy

    def _serve(self) -> None:
        while True:
            loop, future, call, args = self._jobs.get()
            value, error = None, None
            try:
                value = call(*args)
            except BaseException as failure:  # the caller's to handle, on the loop
                error = failure
            # RuntimeError: the loop is closed; nobody waits for this answer any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, value, error)
            del value, error, future  # hold nothing of a finished call while idle
            with self._lock:
                self._busy -= 1


# The database calls': Python's own bound for an executor, which is plenty, as
# the calls are batched, a few at a time.
DB_THREADS = Threads("sweepd-db", min(32, (os.cpu_count() or 1) + 4))


class Batcher(Generic[Item, Result]):
    """Gathers the items submitted in one turn of the loop, or within ``gather``
    seconds of the first, into one bounded call.

    ``work`` gets the items in submission order and returns a result per
    item, a ``StoreError`` for one that failed on its own; if ``work``
    raises, every item fails with that error. No batch waits to fill.
    """

    def __init__(
        self,
        work: Callable[[list[Item]], Sequence[Result | StoreError]],
        gather: float = 0.0,
        clock: Clock | None = None,
    ) -> None:
        self.work = work
        self.gather = gather
        self.clock = clock or SystemClock()
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []

    async def submit(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self._pending.append((item, future))
        if len(self._pending) == 1:
            if self.gather > 0:
                self.clock.call_later(self.gather, self._flush)
            else:
                loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        spawn(self._send(batch), name="batch")

    async def _send(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        """Answer every item of ``batch``, whatever the work raises or returns."""
        try:
            results: Sequence[Result | StoreError] = await bounded(
                self.work, [item for item, _ in batch]
            )
            if len(results) != len(batch):
                raise RuntimeError(f"the batch answered {len(results)} of {len(batch)} items")
        except Exception as error:
            fault = error if isinstance(error, StoreError) else unexpected("batch", error)
            results = [fault] * len(batch)
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # its flight was cancelled while waiting
                continue
            if isinstance(result, StoreError):
                future.set_exception(result)
            else:
                future.set_result(result)
