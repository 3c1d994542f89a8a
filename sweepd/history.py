"""Run history: one ``sweep_runs`` row per attempt, from start to how it ended.

A run that started leaves a row that says how it ended. The row is written
``running`` before the sweep's code is called and finished after it returns;
a replica that crashes in between leaves ``running`` behind, and whichever
replica next wins that sweep's lease marks it ``lost``: its higher fencing
token proves the old holder's claim is over.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Start:
    """The row of one run attempt about to start."""

    name: str
    tick: datetime | None
    holder: str
    token: int
    attempt: int
    trigger: Trigger


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
        self.start_returning = self.start.returning(c.id, sort_by_parameter_order=True)
        # Only a row still running changes: a row the next holder already
        # marked lost keeps saying so, and a retry after a deadlock is harmless.
        ending: dict[str, Any] = {"status": bindparam("p_status"), "error": bindparam("p_error")}
        one = and_(c.id == bindparam("p_id"), running)
        self.finish = update(sweep_runs).where(one).values(finished_at=db_now(), **ending)
        names = c.name.in_(bindparam("p_names", expanding=True))
        self.stale_of = select(c.id, c.name, c.fencing_token).where(namespace, names, running)
        lost = {"status": "lost", "finished_at": db_now(), "error": LOST_ERROR}
        ids = c.id.in_(bindparam("p_ids", expanding=True))
        self.mark_lost = update(sweep_runs).where(ids, running).values(**lost)
        # One sweep's, for a driver cursor (SQLite), which cannot expand a list.
        name = c.name == bindparam("p_name")
        self.stale_of_one = select(c.id, c.fencing_token).where(namespace, name, running)
        self.mark_lost_one = update(sweep_runs).where(one).values(**lost)


RUN_SQL = RunStatements()


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
        params = {
            "p_namespace": self.namespace,
            "p_name": name,
            "p_tick": tick,
            "p_holder": holder,
            "p_token": token,
            "p_attempt": attempt,
            "p_trigger": trigger,
        }
        try:
            with self.engine.connect() as connection:
                key = connection.execute(RUN_SQL.start, params).inserted_primary_key
                assert key is not None
                return int(key[0])
        except SQLAlchemyError as error:
            raise store_fault("run start", name, self.engine, error) from error

    def start_many(self, starts: list[Start]) -> list[int]:
        """Write the ``running`` rows of several runs; their ids, in order.

        One INSERT for all of them where the dialect returns the ids of a
        multi-row INSERT in order (PostgreSQL, SQLite, MariaDB 10.5+), else
        one INSERT each on one connection.
        """
        rows = [
            {
                "p_namespace": self.namespace,
                "p_name": start.name,
                "p_tick": start.tick,
                "p_holder": start.holder,
                "p_token": start.token,
                "p_attempt": start.attempt,
                "p_trigger": start.trigger,
            }
            for start in starts
        ]
        dialect = self.engine.dialect
        try:
            with self.engine.connect() as connection:
                if len(rows) > 1 and dialect.insert_executemany_returning_sort_by_parameter_order:
                    found = connection.execute(RUN_SQL.start_returning, rows)
                    return [int(run_id) for run_id in found.scalars()]
                ids = []
                for row in rows:
                    key = connection.execute(RUN_SQL.start, row).inserted_primary_key
                    assert key is not None
                    ids.append(int(key[0]))
                return ids
        except SQLAlchemyError as error:
            raise store_fault("run start", starts[0].name, self.engine, error) from error

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

    def mark_lost_many(self, claimed: dict[str, int]) -> dict[str, int]:
        """Rows of just-claimed sweeps (name -> new token) left ``running`` under an
        older token: their holder is gone, so they are marked lost; how many, per sweep."""

        def mark() -> dict[str, int]:
            # Ids first, then an UPDATE by primary key: an UPDATE searching by
            # (namespace, status) would lock the index entries of every running
            # sweep and deadlock with their own finish on MySQL.
            with self.engine.connect() as connection:
                found = connection.execute(
                    RUN_SQL.stale_of, {"p_namespace": self.namespace, "p_names": list(claimed)}
                )
                stale = [row for row in found if row.fencing_token < claimed[row.name]]
                if not stale:
                    return {}
                connection.execute(RUN_SQL.mark_lost, {"p_ids": [row.id for row in stale]})
                counts: dict[str, int] = {}
                for row in stale:
                    counts[row.name] = counts.get(row.name, 0) + 1
                return counts

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


__all__ = ["History", "RunRow", "Start", "Status", "StoreError", "Trigger", "describe_error"]
