"""A clock whose time moves only when the test moves it.

Timers and sleeps set through it wait for ``advance``, so a test asserts
what was waited for and in which order, never how long a loaded machine
took to get there.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class ManualTimer:
    def __init__(self, at: float, callback: Callable[[], None]) -> None:
        self.at = at
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    def __init__(self) -> None:
        self.time = 0.0
        self._timers: list[tuple[float, int, ManualTimer]] = []
        self._order = itertools.count()
        self.asked: list[float] = []  # every delay asked for, in order

    def now(self) -> datetime:
        return T0 + timedelta(seconds=self.time)

    def monotonic(self) -> float:
        return self.time

    def call_later(self, seconds: float, callback: Callable[[], None]) -> ManualTimer:
        self.asked.append(seconds)
        timer = ManualTimer(self.time + max(0.0, seconds), callback)
        heapq.heappush(self._timers, (timer.at, next(self._order), timer))
        return timer

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        timer = self.call_later(seconds, wake)
        try:
            await future
        finally:
            timer.cancel()

    def waiting(self) -> list[float]:
        """How far ahead each timer still set is, soonest first."""
        return sorted(t.at - self.time for _, _, t in self._timers if not t.cancelled)

    async def advance(self, seconds: float) -> None:
        """Move time on, firing each timer that comes due, and let the loop run."""
        until = self.time + seconds
        while self._timers and self._timers[0][0] <= until:
            at, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self.time = max(self.time, at)
            timer.callback()
            await settle()
        self.time = until
        await settle()


async def settle(turns: int = 20) -> None:
    """Let the loop run what is ready (a few turns: callbacks schedule callbacks)."""
    for _ in range(turns):
        await asyncio.sleep(0)
