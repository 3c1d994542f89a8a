"""The ``concurrency`` slots, handed out by claiming ticks in batches.

A tick waiting for a slot holds no lease (§5), so a replica may only claim
as many ticks as it has free slots; claimed one at a time, most of a burst
would be claims lost to other replicas. So flights hand their ticks in here:
with ``k`` slots free, one call asks for at most ``k`` of the first
``LOOKAHEAD * k`` ticks waiting, in the replica's order. Those won take the
slots, those lost are answered at once, the rest wait for the next call. In
a backlog a call also waits, briefly, for the busy slots to come back.

A replica that has lost ticks to others lately claims only its share of a
burst in one call (``Peers``): the first call to reach the database would
otherwise lock every row of the burst, and that one replica would then start
all of its runs one after another while the others start none.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sweepd.clock import Clock, SystemClock
from sweepd.errors import StoreError
from sweepd.offload import bounded, unexpected
from sweepd.tasks import spawn

Item = TypeVar("Item")
Result = TypeVar("Result")

# How many waiting ticks one call looks at, per free slot. Enough that a call
# usually fills its slots even when most rows were already won by other
# replicas; not all of them, because a call's cost grows with what it sends
# and reads back, and a burst of hundreds would resend the whole queue for
# every few slots.
LOOKAHEAD = 4
# In a backlog (more ticks waiting than slots free), how long a call waits for
# the busy slots to come back before it leaves with only the free ones. A
# claim's time is mostly its commit, not its ticks: without the wait, slots
# that free one after another split into groups that each pay a call for a
# tick or two, and the backlog drains no sooner (its commit has the figures).
GATHER_SECONDS = 0.005
# After a call that decided nothing (every open row was busy at that
# instant), how long to wait before asking again. Another replica's claim
# holds its rows for a millisecond or two, so the first wait is short; each
# call in a row that finds them busy again waits twice as long, up to the
# cap, since rows locked that long are held by something else (a release on a
# slow server, an operator's open transaction) that retrying will not hurry.
RETRY_SECONDS = 0.002
RETRY_CAP_SECONDS = 0.25
# How long a replica that took a tick from this one counts as a peer.
PEER_MEMORY_SECONDS = 600.0
# The fewest ticks a call claims for when it holds back for its peers: a claim
# of a few more ticks costs next to nothing, one more call a round trip.
SMALLEST_SHARE = 16


class Peers:
    """The replicas this one lost ticks to lately, and so its share of a burst."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._seen: dict[str, float] = {}  # holder: when last seen

    def seen(self, holder: str) -> None:
        self._seen[holder] = self._monotonic()

    def share(self, waiting: int) -> int:
        """How many of ``waiting`` ticks one call should claim: all of them alone."""
        now = self._monotonic()
        for holder, at in list(self._seen.items()):
            if now - at > PEER_MEMORY_SECONDS:  # stopped, or a restart's old name
                del self._seen[holder]
        return max(SMALLEST_SHARE, -(-waiting // (1 + len(self._seen))))


class Slots(Generic[Item, Result]):
    """``size`` slots; ``claim(items, limit)`` decides at most ``limit`` wins.

    ``claim`` runs on a worker thread and returns, per item in order, a
    result, a ``StoreError`` for an item that failed on its own, or None for
    one not decided yet. ``holds(result)``: whether it won a slot.
    ``share(waiting)`` bounds one call's wins when that many wait.
    ``orphaned(item, result)`` must give back what a won result holds when
    its flight has gone (cancelled while the call was out).
    """

    def __init__(
        self,
        size: int,
        claim: Callable[[list[Item], int], list[Result | StoreError | None]],
        holds: Callable[[Result], bool],
        share: Callable[[int], int] | None = None,
        *,
        orphaned: Callable[[Item, Result], None] | None = None,
        clock: Clock | None = None,
        stats: Counter[str] | None = None,
        log: Any = None,
    ) -> None:
        self.size = size
        self.free = size
        self.claim = claim
        self.holds = holds
        self.share = share
        self.orphaned = orphaned
        self.clock = clock or SystemClock()
        self.stats = stats if stats is not None else Counter()
        self.log = log
        self.draining = False
        self._waiting: deque[tuple[Item, asyncio.Future[Result | None]]] = deque()
        self._calling: asyncio.Task[None] | None = None
        self._all_back: asyncio.Future[None] | None = None  # set while a call gathers

    async def take(self, item: Item) -> Result | None:
        """The claim's result for ``item``, or None if draining began before it was decided.

        A result that ``holds`` a slot keeps it until ``give_back``.
        """
        if self.draining:
            return None
        future: asyncio.Future[Result | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if len(self._waiting) == 1:
            # At the end of this turn, so every flight that fires in it goes in one call.
            asyncio.get_running_loop().call_soon(self._wake)
        return await future

    def give_back(self) -> None:
        self.free += 1
        if self.free == self.size:
            self._stop_gathering()
        self._wake()

    def drain(self) -> None:
        """Answer every waiting tick with None; what is being claimed now still comes back."""
        self.draining = True
        self._dismiss()
        self._stop_gathering()

    def _dismiss(self) -> None:
        waiting, self._waiting = self._waiting, deque()
        for _, future in waiting:
            if not future.done():
                future.set_result(None)

    def _wake(self) -> None:
        if self._calling is None and self._waiting and self.free > 0 and not self.draining:
            self._calling = spawn(self._call(), name="slots-claim")

    async def _call(self) -> None:
        """Calls one at a time, each for every slot free when it leaves (or its
        share of them): overlapping calls, one per slot as it frees, cost twice
        the statements for the same lateness."""
        busy = 0  # calls in a row that found every row busy
        try:
            while self.free > 0 and not self.draining:
                if self.free < self.size and len(self._waiting) > self.free:
                    await self._gather()
                    if self.draining:
                        break
                limit = self.free
                if self.share is not None:
                    limit = min(limit, self.share(len(self._waiting)))
                batch = self._next(limit * LOOKAHEAD)
                if not batch:
                    break
                undecided = await self._claim_batch(batch, limit)
                if self.draining:
                    # Out in the call when drain() answered the queue: answer them now.
                    self._dismiss()
                if undecided == len(batch):
                    # Every open row was busy at that instant: ask again, later each time.
                    busy += 1
                    await self.clock.sleep(self._busy_wait(busy))
                    continue
                busy = 0
        finally:
            self._calling = None

    async def _claim_batch(
        self, batch: list[tuple[Item, asyncio.Future[Result | None]]], limit: int
    ) -> int:
        """One call for ``batch``: every decided tick answered, the undecided put
        back in front, the slots not won returned; how many were undecided.

        Whatever the call or the answering raises, every tick of the batch is
        answered and the reserved slots come back: a flight left waiting on a
        future nobody settles is a sweep that stopped without a word.
        """
        self.free -= limit  # reserved while the call is out
        won = 0
        try:
            try:
                results = await bounded(self.claim, [item for item, _ in batch], limit)
            except StoreError as error:
                results = [error] * len(batch)
            if len(results) != len(batch):
                raise RuntimeError(f"the claim answered {len(results)} of {len(batch)} ticks")
            won = self._answer(batch, results)
        except Exception as error:
            fault = error if isinstance(error, StoreError) else unexpected("lease claim", error)
            for _, future in batch:
                if not future.done():
                    future.set_exception(fault)
            return 0
        finally:
            self.free += limit - won
        undecided = [w for w, r in zip(batch, results, strict=True) if r is None]
        # Ticks that came while the call was out wait behind those still undecided.
        self._waiting.extendleft(reversed(undecided))
        return len(undecided)

    def _busy_wait(self, busy: int) -> float:
        """The wait before the ``busy``-th call in a row that found every row busy."""
        self.stats["claims.busy_retries"] += 1
        wait = RETRY_SECONDS * 2.0 ** (busy - 1)
        if wait >= RETRY_CAP_SECONDS > wait / 2 and self.log is not None:
            # Loud once per spell: rows locked this long keep ticks from running.
            self.log.warning(
                "lease.rows_busy",
                calls=busy,
                note="every lease row asked for is locked by another transaction; retrying",
            )
        return min(wait, RETRY_CAP_SECONDS)

    async def _gather(self) -> None:
        """Wait up to ``GATHER_SECONDS`` for every busy slot to come back."""
        loop = asyncio.get_running_loop()
        self._all_back = loop.create_future()
        timer = self.clock.call_later(GATHER_SECONDS, self._stop_gathering)
        try:
            await self._all_back
        finally:
            timer.cancel()
            self._all_back = None

    def _stop_gathering(self) -> None:
        if self._all_back is not None and not self._all_back.done():
            self._all_back.set_result(None)

    def _next(self, most: int) -> list[tuple[Item, asyncio.Future[Result | None]]]:
        """Take up to ``most`` waiting ticks off the front, dropping those whose flight is gone."""
        batch: list[tuple[Item, asyncio.Future[Result | None]]] = []
        while self._waiting and len(batch) < most:
            waiter = self._waiting.popleft()
            if not waiter[1].done():
                batch.append(waiter)
        return batch

    def _answer(
        self,
        batch: list[tuple[Item, asyncio.Future[Result | None]]],
        results: list[Result | StoreError | None],
    ) -> int:
        """Settle each decided future; return how many slots the results hold."""
        held = 0
        for (item, future), result in zip(batch, results, strict=True):
            if result is None:
                continue
            if isinstance(result, StoreError):
                if not future.done():
                    future.set_exception(result)
                continue
            if self.holds(result):
                if future.done():
                    # Its flight is gone: what it won goes back now, not at its expiry.
                    if self.orphaned is not None:
                        self.orphaned(item, result)
                    continue
                held += 1
            if not future.done():
                future.set_result(result)
        return held
