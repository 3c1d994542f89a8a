"""The threads that make blocking calls for the loop: they count what is still
running, so the exit knows whether a sync sweep was left behind
(sweepd.cli.entry), and they keep to their bound."""

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from sweepd.offload import Threads

WAIT = 5.0  # a bound on each wait, never reached when the code is right


def settles(condition: Callable[[], bool]) -> bool:
    """Whether ``condition`` holds within WAIT: the count drops on the call's own
    thread, just after the call returns."""
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run(threads: Threads, call: Callable[..., Any], *args: Any) -> "asyncio.Future[Any]":
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    threads.run(loop, future, call, args)
    return future


def test_busy_counts_calls_until_their_code_returns() -> None:
    async def scenario() -> None:
        threads = Threads("test")
        release = threading.Event()
        started = [threading.Event(), threading.Event()]

        def call(index: int) -> int:
            started[index].set()
            release.wait(WAIT)
            return index

        assert threads.busy() == 0
        futures = [run(threads, call, index) for index in range(2)]
        assert all(await asyncio.to_thread(lambda: [e.wait(WAIT) for e in started]))
        assert threads.busy() == 2

        release.set()
        assert await asyncio.gather(*futures) == [0, 1]
        assert await asyncio.to_thread(settles, lambda: threads.busy() == 0)

    asyncio.run(scenario())


def test_a_reused_thread_counts_its_next_call_and_keeps_its_name() -> None:
    async def scenario() -> None:
        threads = Threads("test-reuse")
        first = await run(threads, threading.current_thread)
        assert await asyncio.to_thread(settles, lambda: threads.busy() == 0)
        hold, running = threading.Event(), threading.Event()

        def blocked() -> threading.Thread:
            running.set()
            hold.wait(WAIT)
            return threading.current_thread()

        second = run(threads, blocked)
        assert await asyncio.to_thread(running.wait, WAIT)
        assert threads.busy() == 1
        hold.set()
        assert await second is first  # the idle thread took it: no new one
        assert first.name == "test-reuse"

    asyncio.run(scenario())


def test_calls_past_the_bound_queue_for_a_thread() -> None:
    async def scenario() -> None:
        threads = Threads("test-bound", size=2)
        release = threading.Event()
        idents: set[int] = set()

        def call() -> None:
            idents.add(threading.get_ident())
            release.wait(WAIT)

        futures = [run(threads, call) for _ in range(5)]
        assert await asyncio.to_thread(settles, lambda: len(idents) == 2)
        assert threads.busy() == 5  # three of them waiting for one of the two
        release.set()
        await asyncio.gather(*futures)
        assert len(idents) == 2

    asyncio.run(scenario())


def test_an_exception_settles_the_future_with_it() -> None:
    async def scenario() -> None:
        def fails() -> None:
            raise KeyError("gone")

        with pytest.raises(KeyError, match="gone"):
            await run(Threads("test-raise"), fails)

    asyncio.run(scenario())
