"""The database work around each tick: open (claim + run row) and close (finish + release).

The runner asks for it in batches (``sweepd.slots``, ``sweepd.offload``).
On PostgreSQL each batch is one statement: the claim of up to ``limit``
ticks, the stale-row check and the new ``running`` rows travel together,
and so do the finished rows and the releases. One statement is also one
transaction: a tick is never claimed without its row, and a lease is never
freed before its row says how the run ended (else the next holder would
mark a finished run lost). On SQLite the claims, stale checks and rows of a
batch are short statements in one write transaction on the driver's cursor,
with the same all-or-nothing result. On MySQL/MariaDB the same steps are the
lease and history calls one after another, in one thread hop.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from sweepd.db.engine import (
    driver_rows,
    pg_array,
    prepare_for,
    retry_deadlocks,
    sqlite_write,
    store_fault,
)
from sweepd.errors import StoreError
from sweepd.history import LOST_ERROR, History, Start, Status, Trigger
from sweepd.lease import (
    CLAIM_UPTO_POSTGRESQL_CTES,
    CLAIM_UPTO_POSTGRESQL_JOINS,
    CLAIM_UPTO_POSTGRESQL_OUTCOME,
    RELEASE_MANY_POSTGRESQL_CTES,
    RELEASE_MANY_POSTGRESQL_UPDATE,
    Claim,
    ClaimedRow,
    LeaseStore,
    Want,
    Won,
    claim_outcome,
    first_of_each,
)
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


# Claim, mark the won sweeps' stale rows lost, and write their first rows.
_OPEN_POSTGRESQL = text(
    f"""
    WITH {CLAIM_UPTO_POSTGRESQL_CTES},
    stale AS (
        UPDATE sweep_runs AS r
        SET status = 'lost', finished_at = statement_timestamp(), error = :p_lost_error
        FROM won
        WHERE r.namespace = :p_namespace
          AND r.name = won.name
          AND r.status = 'running'
          AND r.fencing_token < won.fencing_token
        RETURNING r.name
    ),
    started AS (
        INSERT INTO sweep_runs
            (namespace, name, tick, holder, fencing_token, attempt, trigger, started_at, status)
        SELECT :p_namespace, won.name, w.tick, :p_holder, won.fencing_token, 1, 'schedule',
               statement_timestamp(), 'running'
        FROM won JOIN wanted AS w ON w.name = won.name
        RETURNING id, name
    )
    SELECT {CLAIM_UPTO_POSTGRESQL_OUTCOME},
           started.id AS run_id,
           (SELECT count(*) FROM stale WHERE stale.name = w.name) AS lost_runs
    {CLAIM_UPTO_POSTGRESQL_JOINS}
    LEFT JOIN started ON started.name = w.name
    """
)

# Finish the rows, then release the leases, as one transaction.
_CLOSE_POSTGRESQL = text(
    f"""
    WITH ended AS (
        SELECT e.id, e.status, e.error
        FROM unnest(
            CAST(:p_ids AS bigint[]), CAST(:p_statuses AS varchar[]), CAST(:p_errors AS text[])
        ) AS e (id, status, error)
    ),
    finished AS (
        UPDATE sweep_runs AS r
        SET status = e.status, finished_at = statement_timestamp(), error = e.error
        FROM ended AS e
        WHERE r.id = e.id AND r.status = 'running'
    ),
    {RELEASE_MANY_POSTGRESQL_CTES}
    {RELEASE_MANY_POSTGRESQL_UPDATE}
    """
)


class TickStore:
    def __init__(self, store: LeaseStore, history: History, holder: str) -> None:
        self.store = store
        self.history = history
        self.holder = holder
        self.engine = store.engine
        self._postgresql = self.engine.dialect.name == "postgresql"
        self._sqlite = self.engine.dialect.name == "sqlite"
        if self._postgresql:
            # Compiled once, to the driver's own SQL: these two statements are
            # every tick's, so they skip SQLAlchemy's execution layer.
            self._open_sql = str(_OPEN_POSTGRESQL.compile(dialect=self.engine.dialect))
            self._close_sql = str(_CLOSE_POSTGRESQL.compile(dialect=self.engine.dialect))

    # -- open ----------------------------------------------------------------------------

    def open_upto(self, asks: list[Ask], limit: int) -> list[Opened | StoreError | None]:
        """Claim at most ``limit`` of the asks' ticks, preferring them in order; for
        those won, mark stale rows lost and write the first row. None for an ask
        not decided yet (ask again).

        Where a batch is one transaction (PostgreSQL, SQLite) its failure
        fails every ask in it and claims none. Elsewhere only a claim's failure
        fails its ask: a won tick whose stale check or row failed is reported
        as such, so that its lease is still released.
        """
        unique = first_of_each([ask.sweep.name for ask in asks])  # never one sweep twice
        if len(unique) == len(asks):
            return self._open_unique(asks, limit)
        results: list[Opened | StoreError | None] = [None] * len(asks)
        opened = self._open_unique([asks[i] for i in unique], limit)
        for i, result in zip(unique, opened, strict=True):
            results[i] = result
        return results

    def _open_unique(self, asks: list[Ask], limit: int) -> list[Opened | StoreError | None]:
        """``open_upto`` for asks of different sweeps."""
        results: list[Opened | StoreError | None] = [None] * len(asks)
        rest = list(range(len(asks)))
        if self._postgresql or self._sqlite:
            batch = [i for i, ask in enumerate(asks) if self._batchable(ask)]
            open_batch = self._open_postgresql if self._postgresql else self._open_sqlite
            found, unseen = open_batch([asks[i] for i in batch], limit)
            for i, found_one in zip(batch, found, strict=True):
                results[i] = found_one
            # Left to the calls in turn: manual runs, and first claims (no row yet).
            batched = set(batch)
            rest = [i for i in rest if i not in batched or asks[i].sweep.name in unseen]
        won = sum(isinstance(r, Opened) and isinstance(r.claim, Won) for r in results)
        if rest and won < limit:
            each = self._open_each([asks[i] for i in rest], limit - won)
            for i, result in zip(rest, each, strict=True):
                results[i] = result
        return results

    @staticmethod
    def _batchable(ask: Ask) -> bool:
        return ask.tick is not None and ask.trigger == "schedule"

    def _open_postgresql(self, asks: list[Ask], limit: int) -> tuple[list[Opened | None], set[str]]:
        if not asks:
            return [], set()
        wants = [Want(ask.sweep.name, ask.sweep.ttl, ask.tick) for ask in asks]
        params = self.store.claim_upto_params(self.holder, wants, limit)
        params["p_lost_error"] = LOST_ERROR
        try:
            with self.engine.connect() as connection:
                found = driver_rows(
                    connection, self._open_sql, params, prepare=prepare_for(len(asks))
                )
        except SQLAlchemyError as error:
            raise store_fault("lease claim", asks[0].sweep.name, self.engine, error) from error
        # Each row: the claim's columns, then the two that the open adds.
        rows: dict[str, tuple[ClaimedRow, int | None, int]] = {}
        for *claimed, run_id, lost_runs in found:
            row = ClaimedRow(*claimed)
            rows[row.name] = (row, run_id, lost_runs)
        results: list[Opened | None] = []
        for ask in asks:
            row, run_id, lost_runs = rows[ask.sweep.name]
            claim = claim_outcome(row, self.holder, ask.tick)
            if claim is None:
                results.append(None)
                continue
            opened = Opened(claim)
            if isinstance(claim, Won):
                assert run_id is not None  # a won claim's row is written in its statement
                opened.started = int(run_id)
                opened.lost_runs = int(lost_runs)
            results.append(opened)
        return results, {name for name, (row, _, _) in rows.items() if row.holder is None}

    def _open_sqlite(self, asks: list[Ask], limit: int) -> tuple[list[Opened | None], set[str]]:
        """The claims, stale checks and rows in one write transaction, on the driver's cursor."""
        if not asks:
            return [], set()
        wants = [Want(ask.sweep.name, ask.sweep.ttl, ask.tick) for ask in asks]
        try:
            with self.engine.connect() as connection, sqlite_write(connection) as cursor:
                claims, unseen = self.store.claim_in(cursor, self.holder, wants, limit)
                starts = [
                    Start(ask.sweep.name, ask.tick, self.holder, claim.token, 1, ask.trigger)
                    for ask, claim in zip(asks, claims, strict=True)
                    if isinstance(claim, Won)
                ]
                lost, ids = self.history.open_in(cursor, starts)
        except SQLAlchemyError as error:
            raise store_fault("lease claim", asks[0].sweep.name, self.engine, error) from error
        started = iter(ids)
        results: list[Opened | None] = []
        for ask, claim in zip(asks, claims, strict=True):
            if claim is None:
                results.append(None)
                continue
            opened = Opened(claim)
            if isinstance(claim, Won):
                opened.started = next(started)
                opened.lost_runs = lost.get(ask.sweep.name, 0)
            results.append(opened)
        return results, unseen

    def _open_each(self, asks: list[Ask], limit: int) -> list[Opened | StoreError | None]:
        """The lease and history calls in turn: claim, mark stale rows lost, write rows."""
        wants = [Want(ask.sweep.name, ask.sweep.ttl, ask.tick) for ask in asks]
        claims = self.store.claim_upto(self.holder, wants, limit)
        results: list[Opened | StoreError | None] = [
            claim if claim is None or isinstance(claim, StoreError) else Opened(claim)
            for claim in claims
        ]
        won = [
            (ask, opened, opened.claim)
            for ask, opened in zip(asks, results, strict=True)
            if isinstance(opened, Opened) and isinstance(opened.claim, Won)
        ]
        if not won:
            return results
        try:
            lost = self.history.mark_lost_many({ask.sweep.name: c.token for ask, _, c in won})
        except StoreError as error:
            for _, opened, _ in won:
                opened.lost_error = str(error)
        else:
            for ask, opened, _ in won:
                opened.lost_runs = lost.get(ask.sweep.name, 0)
        starts = [
            Start(ask.sweep.name, ask.tick, self.holder, claim.token, 1, ask.trigger)
            for ask, _, claim in won
        ]
        try:
            ids: list[Started] = list(self.history.start_many(starts))
        except StoreError as error:
            ids = [str(error)] * len(won)
        for (_, opened, _), started in zip(won, ids, strict=True):
            opened.started = started
        return results

    # -- close ---------------------------------------------------------------------------

    def close_many(self, hands: list[Hand]) -> list[Closed]:
        """Finish each hand's row, then release its lease, saying per hand what failed."""
        if self._postgresql:
            return self._close_postgresql(hands)
        endings = [hand.ending for hand in hands if hand.ending is not None]
        row_error = None
        if endings:
            try:
                self.history.finish_many(endings)
            except StoreError as error:
                row_error = str(error)
        held = [(hand.name, hand.token) for hand in hands]
        try:
            released = self.store.release_each(self.holder, held)
        except StoreError as error:
            return [Closed(_row_error(hand, row_error), False, str(error)) for hand in hands]
        return [
            Closed(_row_error(hand, row_error), freed)
            for hand, freed in zip(hands, released, strict=True)
        ]

    def _close_postgresql(self, hands: list[Hand]) -> list[Closed]:
        endings = [hand.ending for hand in hands if hand.ending is not None]
        params: dict[str, Any] = {
            "p_namespace": self.store.namespace,
            "p_holder": self.holder,
            "p_ids": pg_array(ending[0] for ending in endings),
            "p_statuses": pg_array(ending[2] for ending in endings),
            "p_errors": pg_array(ending[3] for ending in endings),
            "p_names": pg_array(hand.name for hand in hands),
            "p_tokens": pg_array(hand.token for hand in hands),
        }

        def close() -> set[str]:
            with self.engine.connect() as connection:
                rows = driver_rows(
                    connection, self._close_sql, params, prepare=prepare_for(len(hands))
                )
                return {name for (name,) in rows}

        try:
            freed = retry_deadlocks(close)
        except SQLAlchemyError as error:
            # One statement: neither the rows nor the releases went through.
            fault = str(store_fault("run finish", hands[0].name, self.engine, error))
            return [Closed(_row_error(hand, fault), False, fault) for hand in hands]
        return [Closed(None, hand.name in freed) for hand in hands]


def _row_error(hand: Hand, error: str | None) -> str | None:
    return error if hand.ending is not None else None
