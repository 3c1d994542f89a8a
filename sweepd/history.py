"""Run history: one ``sweep_runs`` row per attempt, from start to how it ended.

A run that started leaves a row that says how it ended. The row is written
``running`` before the sweep's code is called and finished after it returns;
a replica that crashes in between leaves ``running`` behind, and whichever
replica next wins that sweep's lease marks it ``lost``: its higher fencing
token proves the old holder's claim is over.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Engine, and_, bindparam, delete, insert, select, update
from sqlalchemy.exc import SQLAlchemyError

from sweepd.db.engine import db_now, retry_deadlocks, store_fault
from sweepd.db.schema import ERROR_LENGTH, UtcDateTime, sweep_runs
from sweepd.errors import StoreError

# What a row left running by a replica that stopped renewing its lease says:
# it crashed, was paused past its ttl, or lost the database.
LOST_ERROR = "the replica running it stopped renewing its lease"

Status = Literal["running", "success", "failed", "timeout", "cancelled", "lost"]
Trigger = Literal["schedule", "manual"]
# A run attempt's row about to be written: sweep, tick, holder, token, attempt, trigger.
Start = tuple[str, datetime | None, str, int, int, Trigger]


@dataclass(frozen=True)
class RunRow:
    id: int
    namespace: str
    name: str
    tick: datetime | None
    holder: str
    fencing_token: int
    attempt: int
    trigger: str
    started_at: datetime
    finished_at: datetime | None
    status: str
    error: str | None


def describe_error(error: BaseException) -> str:
    """``Type: message``, cut to what the column keeps."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= ERROR_LENGTH else text[: ERROR_LENGTH - 1] + "…"


class RunStatements:
    """The run-row statements of the hot path, built once with bind parameters:
    building a Core statement per call costs more CPU than its round trip."""

    def __init__(self) -> None:
        c = sweep_runs.c
        running, namespace = c.status == "running", c.namespace == bindparam("p_namespace")
        self.start = insert(sweep_runs).values(
            namespace=bindparam("p_namespace"),
            name=bindparam("p_name"),
            tick=bindparam("p_tick", type_=UtcDateTime()),
            holder=bindparam("p_holder"),
            fencing_token=bindparam("p_token"),
            attempt=bindparam("p_attempt"),
            trigger=bindparam("p_trigger"),
            started_at=db_now(),
            status="running",
        )
        # Only a row still running changes: a row the next holder already
        # marked lost keeps saying so, and a retry after a deadlock is harmless.
        ending: dict[str, Any] = {"status": bindparam("p_status"), "error": bindparam("p_error")}
        one = and_(c.id == bindparam("p_id"), running)
        self.finish = update(sweep_runs).where(one).values(finished_at=db_now(), **ending)
        lost = {"status": "lost", "finished_at": db_now(), "error": LOST_ERROR}
        # A just-claimed sweep's rows left running, and one of them marked lost.
        name = c.name == bindparam("p_name")
        self.stale_of = select(c.id, c.fencing_token).where(namespace, name, running)
        self.mark_lost = update(sweep_runs).where(one).values(**lost)
        # Their lists, for the portable store's batches.
        self.start_many = self.start.returning(c.id, sort_by_parameter_order=True)
        names = c.name.in_(bindparam("p_names", expanding=True))
        self.stale_of_many = select(c.id, c.name, c.fencing_token).where(namespace, names, running)
        ids = c.id.in_(bindparam("p_ids", expanding=True))
        self.mark_lost_many = update(sweep_runs).where(ids, running).values(**lost)


RUN_SQL = RunStatements()
_START = ("p_name", "p_tick", "p_holder", "p_token", "p_attempt", "p_trigger")  # a Start's


class History:
    def __init__(self, engine: Engine, namespace: str) -> None:
        self.engine = engine
        self.namespace = namespace

    def start(
        self,
        name: str,
        tick: datetime | None,
        holder: str,
        token: int,
        attempt: int,
        trigger: Trigger,
    ) -> int:
        """Write the ``running`` row of a run attempt about to start; its id."""
        return self.start_many([(name, tick, holder, token, attempt, trigger)])[0]

    def start_many(self, starts: list[Start]) -> list[int]:
        """``start`` for several attempts; their ids, in order. One INSERT for all
        where the dialect returns a multi-row INSERT's ids in order (PostgreSQL,
        SQLite, MariaDB), else one INSERT each on one connection."""
        rows = [
            {"p_namespace": self.namespace, **dict(zip(_START, s, strict=True))} for s in starts
        ]
        try:
            with self.engine.connect() as connection:
                # Read here: the dialect learns what the server can do when it first connects.
                if (
                    len(rows) > 1
                    and connection.dialect.insert_executemany_returning_sort_by_parameter_order
                ):
                    return [int(i) for i in connection.execute(RUN_SQL.start_many, rows).scalars()]
                ids = []
                for row in rows:
                    key = connection.execute(RUN_SQL.start, row).inserted_primary_key
                    assert key is not None
                    ids.append(int(key[0]))
                return ids
        except SQLAlchemyError as error:
            raise store_fault("run start", starts[0][0], self.engine, error) from error

    def finish(self, run_id: int, name: str, status: Status, error: str | None = None) -> None:
        """Record how the run ended (only while the row still says ``running``)."""
        self.finish_many([(run_id, name, status, error)])

    def finish_many(self, endings: list[tuple[int, str, Status, str | None]]) -> None:
        """``finish`` for several runs (run id, sweep, status, error), sent together
        (pipelined by psycopg)."""
        params = [{"p_id": i, "p_status": status, "p_error": e} for i, _, status, e in endings]

        def write() -> None:
            with self.engine.connect() as connection:
                connection.execute(RUN_SQL.finish, params)

        try:
            retry_deadlocks(write)
        except SQLAlchemyError as error_:
            raise store_fault("run finish", endings[0][1], self.engine, error_) from error_

    def mark_lost(self, claimed: dict[str, int]) -> dict[str, int]:
        """Mark the rows of just-claimed sweeps (name -> new token) left ``running``
        under an older token lost: their holder is gone. How many, per sweep."""

        def mark() -> dict[str, int]:
            # Ids first, then an UPDATE by primary key: an UPDATE searching by
            # (namespace, status) would lock the index entries of every running
            # sweep and deadlock with their own finish on MySQL.
            names = {"p_namespace": self.namespace, "p_names": list(claimed)}
            with self.engine.connect() as connection:
                found = connection.execute(RUN_SQL.stale_of_many, names).all()
                stale = [(run_id, name) for run_id, name, older in found if older < claimed[name]]
                if stale:
                    ids = {"p_ids": [run_id for run_id, _ in stale]}
                    connection.execute(RUN_SQL.mark_lost_many, ids)
                return Counter(name for _, name in stale)

        try:
            return retry_deadlocks(mark)
        except SQLAlchemyError as error:
            raise store_fault("mark lost", next(iter(claimed)), self.engine, error) from error

    def prune(self, keep: timedelta) -> int:
        """Delete finished rows that started longer than ``keep`` ago (database clock)."""
        c = sweep_runs.c
        try:
            with self.engine.connect() as connection:
                cutoff = connection.execute(select(db_now())).scalar_one() - keep
                result = connection.execute(
                    delete(sweep_runs).where(
                        c.namespace == self.namespace, c.started_at < cutoff, c.status != "running"
                    )
                )
                return int(result.rowcount)
        except SQLAlchemyError as error:
            raise store_fault("history prune", None, self.engine, error) from error

    def runs(
        self,
        name: str | None = None,
        limit: int = 50,
        *,
        status: Status | None = None,
        since: timedelta | None = None,
    ) -> list[RunRow]:
        """The newest rows first: of one sweep, in one status, started within ``since``
        (by the database's clock), as asked."""
        c = sweep_runs.c
        query = select(sweep_runs).where(c.namespace == self.namespace)
        if name is not None:
            query = query.where(c.name == name)
        if status is not None:
            query = query.where(c.status == status)
        query = query.order_by(c.started_at.desc(), c.id.desc()).limit(limit)
        try:
            with self.engine.connect() as connection:
                if since is not None:
                    cutoff = connection.execute(select(db_now())).scalar_one() - since
                    query = query.where(c.started_at >= cutoff)
                return [RunRow(**row._mapping) for row in connection.execute(query)]
        except SQLAlchemyError as error:
            raise store_fault("history read", name or "-", self.engine, error) from error


__all__ = ["History", "RunRow", "Status", "StoreError", "Trigger", "describe_error"]
