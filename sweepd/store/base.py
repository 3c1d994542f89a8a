"""The tick store: all the database work of a tick, behind two verbs and a renewal.

``open`` claims a batch of ticks, marks the won sweeps' rows left running
under an older token lost, and writes each won tick's first row; ``close``
finishes the rows of a batch of runs and releases their leases; ``renew``
extends the leases a replica holds. The runner calls these (through
``sweepd.slots`` and ``sweepd.offload``) and nothing else; no caller builds
SQL, knows a dialect, or sees a cursor.

This class is the portable store, which MySQL and MariaDB use: the lease's
and the history's statements in turn, each its own transaction, so a won tick
whose row failed is reported as such and its lease still released.
``postgresql.py`` and ``sqlite.py`` make a batch one transaction: a tick is
never claimed without its row, nor a lease freed before its row is finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sweepd.errors import StoreError
from sweepd.history import History, Status, Trigger
from sweepd.lease import Claim, LeaseStore, Won
from sweepd.model import SweepDef

Started = int | str  # an attempt's run id, or why its row could not be written
Row = tuple[int, str, Status, str | None]  # run id, sweep, status, error: a row's ending


@dataclass(frozen=True)
class Ask:
    """One flight asking to run a tick: claim it and, if won, start its row."""

    sweep: SweepDef
    tick: datetime | None
    trigger: Trigger


@dataclass
class Opened:
    """What opening a tick found: the claim, and for a won one, its first row."""

    claim: Claim
    lost_runs: int = 0  # older rows of this sweep found still running, now marked lost
    lost_error: str | None = None
    started: Started | None = None  # set for a won claim


@dataclass(frozen=True)
class Hand:
    """One flight handing a run back: finish its last row (if any), release its lease."""

    name: str
    token: int
    ending: Row | None


@dataclass(frozen=True)
class Closed:
    """What closing a run did: why its row or its release failed, if they did."""

    row_error: str | None  # None: finished, or there was no row to finish
    released: bool  # False with no release_error: the lease was no longer this holder's
    release_error: str | None = None


# What open_batch found for the asks it was given (None: undecided), and the
# sweeps among them that have no lease row yet, whose first claim inserts it.
Batch = tuple[list[Opened | None], set[str]]


class TickStore:
    def __init__(self, lease: LeaseStore, history: History, holder: str) -> None:
        self.lease = lease
        self.history = history
        self.holder = holder
        self.engine = lease.engine

    # -- open ----------------------------------------------------------------------------

    def open(self, asks: list[Ask], limit: int) -> list[Opened | StoreError | None]:
        """Claim at most ``limit`` of the asks' ticks, preferring them in order; for
        those won, mark stale rows lost and write the first row. None for an ask
        not decided yet (ask again): beyond the limit, its row busy at that
        instant, or a sweep asked for earlier in the batch (two asks of one
        sweep could both match its one row, and the sweep overlap itself).
        """
        unique = first_of_each([ask.sweep.name for ask in asks])
        results: list[Opened | StoreError | None] = [None] * len(asks)
        # Scheduled ticks go in the dialect's batch; manual runs, which claim no
        # tick, and first claims, which insert the row, go one at a time.
        batch = [i for i in unique if asks[i].tick is not None]
        found, unseen = self.open_batch([asks[i] for i in batch], limit) if batch else ([], set())
        for i, opened in zip(batch, found, strict=True):
            results[i] = opened
        won = sum(isinstance(r, Opened) and isinstance(r.claim, Won) for r in results)
        rest = [i for i in unique if asks[i].tick is None or asks[i].sweep.name in unseen]
        if rest and won < limit:
            for i, one in zip(
                rest, self._open_each([asks[i] for i in rest], limit - won), strict=True
            ):
                results[i] = one
        return results

    def open_batch(self, asks: list[Ask], limit: int) -> Batch:
        """Scheduled ticks of different sweeps, in one go where the dialect allows.
        The portable store decides none here: every sweep goes to ``_open_each``."""
        return [None] * len(asks), {ask.sweep.name for ask in asks}

    def _open_each(self, asks: list[Ask], limit: int) -> list[Opened | StoreError | None]:
        """The lease and history calls in turn: a claim each until ``limit`` are
        won, then one stale-row check and one insert for the rows of those won."""
        results: list[Opened | StoreError | None] = []
        won: list[tuple[Ask, Opened, int]] = []
        for ask in asks:
            if len(won) >= limit:
                results.append(None)
                continue
            try:
                opened = Opened(
                    self.lease.claim(ask.sweep.name, self.holder, ask.sweep.ttl, ask.tick)
                )
            except StoreError as error:
                results.append(error)
                continue
            results.append(opened)
            if isinstance(opened.claim, Won):
                won.append((ask, opened, opened.claim.token))
        if won:
            self._start_won(won)
        return results

    def _start_won(self, won: list[tuple[Ask, Opened, int]]) -> None:
        try:
            lost = self.history.mark_lost({ask.sweep.name: token for ask, _, token in won})
        except StoreError as error:
            for _, opened, _ in won:
                opened.lost_error = str(error)
        else:
            for ask, opened, _ in won:
                opened.lost_runs = lost.get(ask.sweep.name, 0)
        starts = [(a.sweep.name, a.tick, self.holder, token, 1, a.trigger) for a, _, token in won]
        try:
            ids: list[Started] = list(self.history.start_many(starts))
        except StoreError as error:
            ids = [str(error)] * len(won)
        for (_, opened, _), started in zip(won, ids, strict=True):
            opened.started = started

    # -- close ---------------------------------------------------------------------------

    def close(self, hands: list[Hand]) -> list[Closed]:
        """Finish each hand's row, then release its lease, saying per hand what failed."""
        endings = [hand.ending for hand in hands if hand.ending is not None]
        failed = None
        if endings:
            try:
                self.history.finish_many(endings)
            except StoreError as error:
                failed = str(error)
        held = [(hand.name, hand.token) for hand in hands]
        try:
            released = self.lease.release_many(self.holder, held)
        except StoreError as error:
            return [Closed(row_error(hand, failed), False, str(error)) for hand in hands]
        return [
            Closed(row_error(hand, failed), freed)
            for hand, freed in zip(hands, released, strict=True)
        ]

    # -- the rest of a run's database work -------------------------------------------------

    def renew(self, held: list[tuple[str, int, timedelta]]) -> set[str]:
        """Extend this holder's (name, token, ttl) leases; the names still held."""
        return self.lease.renew_many(self.holder, held)

    def start(
        self, name: str, tick: datetime | None, token: int, attempt: int, trigger: Trigger
    ) -> Started:
        """An attempt's row: its id, or why it could not be written."""
        try:
            return self.history.start(name, tick, self.holder, token, attempt, trigger)
        except StoreError as error:
            return str(error)

    def finish(self, ending: Row) -> None:
        """A row's ending written on its own: a timeout, a drain, a late write."""
        self.history.finish_many([ending])

    def release(self, held: list[tuple[str, int]]) -> list[bool]:
        """Releases retried after they failed at the close."""
        return self.lease.release_many(self.holder, held)

    def now(self) -> datetime:
        return self.lease.now()


def row_error(hand: Hand, error: str | None) -> str | None:
    return error if hand.ending is not None else None


def first_of_each(names: list[str]) -> list[int]:
    """The positions of each name's first appearance, in order.

    A batch that asks twice for one lease matches both asks to its one row,
    and both could come back won under one token: the sweep would overlap
    itself. So a batch claims only a name's first ask; the others stay
    undecided, to be asked again once the first is settled.
    """
    seen: set[str] = set()
    first = []
    for i, name in enumerate(names):
        if name not in seen:
            seen.add(name)
            first.append(i)
    return first
