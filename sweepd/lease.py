"""The lease: which replica runs a tick, decided by the database alone.

One row per (namespace, sweep) in ``sweep_leases``. Its statements are built
here, once (``LeaseStatements``), and know nothing of schedules: a tick is an
instant newer than the last one claimed. The tick stores (``sweepd.store``)
run them in their batches, but for PostgreSQL's one-statement batch.

Why a row and not an advisory lock: a session-level advisory lock belongs to
one pooled connection, and a release that lands on another connection
silently fails and strands the lock; a transaction-level one would hold a
transaction open for the whole run. A row with an expiry is ordinary SQL on
any connection, and a crashed holder frees itself when its time runs out.

Every comparison uses the database's clock, inside the statement, so
replicas whose clocks are minutes apart still agree on who holds what.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    Engine,
    and_,
    bindparam,
    func,
    insert,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from sweepd.db.engine import db_now, db_now_plus, is_duplicate_key, store_fault
from sweepd.db.schema import UtcDateTime, sweep_leases
from sweepd.errors import StoreError

MICRO = timedelta(microseconds=1)
# How early, by the database's clock, a replica may claim a tick: room for the
# ordinary disagreement of NTP-synced hosts, not for a clock that is wrong.
CLOCK_TOLERANCE = timedelta(seconds=1)


def make_holder() -> str:
    """``hostname:pid:random``: the hostname is the pod name in Kubernetes, the
    pid tells processes on one host apart, the random part a restarted pid."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Won:
    """This holder has the lease; ``token`` is one more than the last claim's."""

    token: int
    holder: str
    tick: datetime | None


@dataclass(frozen=True)
class Lost:
    """Another holder has it (``lease_held``), already claimed this tick (``already_run``),
    or the tick is still in the future by the database's clock (``clock_skew``: this
    replica's clock runs ahead, and claiming early would make the others skip it)."""

    reason: Literal["lease_held", "already_run", "clock_skew"]
    holder: str | None
    expires_at: datetime | None
    tick: datetime | None


Claim = Won | Lost


@dataclass(frozen=True)
class LeaseRow:
    namespace: str
    name: str
    holder: str
    acquired_at: datetime
    expires_at: datetime
    tick: datetime | None
    fencing_token: int


class LeaseStatements:
    """Every lease statement, built once per dialect with bind parameters.

    Building a Core statement and its cache key costs more client CPU than
    the round trip it sends; a lease store issues the same five shapes
    forever, so they are built when the store is made.
    """

    def __init__(self, dialect: str) -> None:
        mysql = dialect == "mysql"
        self._claims(mysql)
        self._holds(mysql)
        self.read = select(sweep_leases).where(_KEY)

    def _claims(self, mysql: bool) -> None:
        t = sweep_leases.c
        # MySQL has no UPDATE ... RETURNING; LAST_INSERT_ID(expr) hands the
        # new token back in the same reply instead.
        token = func.last_insert_id(t.fencing_token + 1) if mysql else t.fencing_token + 1
        # The free test and the tick test are one WHERE, so racing replicas
        # cannot both pass it: the database serialises the UPDATE and exactly
        # one sees a row changed.
        free = and_(_KEY, t.expires_at <= db_now())
        # A tick may be claimed at most CLOCK_TOLERANCE before it is due by the
        # database's clock. Without this, a replica whose clock runs ahead
        # claims tomorrow's ticks today, and every replica with a true clock
        # then skips them as "already run".
        due = db_now_plus(bindparam("p_tolerance", type_=BigInteger())) >= _TICK
        claimed = {
            "holder": bindparam("p_holder"),
            "acquired_at": db_now(),
            "expires_at": _TTL,
            "fencing_token": token,
        }
        claim_tick = (
            update(sweep_leases)
            .where(free, due, or_(t.tick.is_(None), t.tick < _TICK))
            .values(tick=_TICK, **claimed)
        )
        claim_any = update(sweep_leases).where(free).values(**claimed)
        self.claim_tick = claim_tick if mysql else claim_tick.returning(t.fencing_token)
        self.claim_any = claim_any if mysql else claim_any.returning(t.fencing_token)
        early = db_now_plus(bindparam("p_tolerance", type_=BigInteger())) < _TICK
        self.explain = select(t.holder, t.expires_at, t.tick, early.label("early")).where(_KEY)
        self.skewed = select(early)
        self.insert = insert(sweep_leases).values(
            namespace=bindparam("p_namespace"),
            name=bindparam("p_name"),
            holder=bindparam("p_holder"),
            acquired_at=db_now(),
            expires_at=_TTL,
            tick=_TICK,
            fencing_token=1,
        )

    def _holds(self, mysql: bool) -> None:
        t = sweep_leases.c
        mine = and_(
            _KEY, t.holder == bindparam("p_holder"), t.fencing_token == bindparam("p_token")
        )
        # A renewal finds the lease only while it has not expired: one that
        # expired (a holder paused past its ttl) may have been claimed and run
        # by another replica already, so its holder must learn it lost it, and
        # a renewal that lands after the release must not take the lease back.
        live = t.expires_at > db_now()
        # The renewals of one replica's leases that share a ttl, as one statement.
        held = tuple_(t.name, t.fencing_token).in_(bindparam("p_held", expanding=True))
        ours = and_(
            t.namespace == bindparam("p_namespace"), t.holder == bindparam("p_holder"), held
        )
        renew_many = update(sweep_leases).where(ours, live).values(expires_at=_TTL)
        self.renew_many = renew_many if mysql else renew_many.returning(t.name)
        # MySQL's UPDATE returns no rows: the leases still held are read after it.
        self.still_held = select(t.name).where(ours, live)
        self.release = update(sweep_leases).where(mine).values(expires_at=db_now())


_KEY = and_(
    sweep_leases.c.namespace == bindparam("p_namespace"), sweep_leases.c.name == bindparam("p_name")
)
_TTL = db_now_plus(bindparam("p_micros", type_=BigInteger()))
_TICK = bindparam("p_tick", type_=UtcDateTime())


class LeaseStore:
    """Claim, renew and release leases of one namespace over one engine.

    Claim is strict and release is tolerant, on purpose. A claim that cannot
    tell "someone else has it" from "the table does not exist" must raise,
    or a broken deployment looks exactly like a healthy one that keeps
    losing races. A release that raised would replace the caller's own
    exception, and the TTL frees the lease anyway.
    """

    def __init__(
        self,
        engine: Engine,
        namespace: str = "default",
        clock_tolerance: timedelta = CLOCK_TOLERANCE,
    ) -> None:
        self.engine = engine
        self.namespace = namespace
        self.clock_tolerance = clock_tolerance
        self._mysql = engine.dialect.name == "mysql"
        self.sql = LeaseStatements(engine.dialect.name)

    def _params(self, name: str, **more: Any) -> dict[str, Any]:
        return {"p_namespace": self.namespace, "p_name": name, **more}

    def claim(self, name: str, holder: str, ttl: timedelta, tick: datetime | None = None) -> Claim:
        """Take the lease for ``tick`` if it is free and the tick is newer than the last claimed.

        With ``tick=None`` (a manual run, or ``sweepd lock`` without a tick)
        the lease only prevents overlap, and the row's last tick is left as
        it was so the next scheduled tick is neither blocked nor shifted.
        """
        params = self._params(
            name,
            p_holder=holder,
            p_micros=ttl // MICRO,
            p_tick=tick,
            p_tolerance=self.clock_tolerance // MICRO,
        )
        statement = self.sql.claim_any if tick is None else self.sql.claim_tick
        try:
            with self.engine.connect() as connection:
                result = connection.execute(statement, params)
                if self._mysql:
                    if result.rowcount == 1:
                        return Won(token=int(result.lastrowid), holder=holder, tick=tick)
                else:
                    token = result.scalar()
                    if token is not None:
                        return Won(token=int(token), holder=holder, tick=tick)
                lost = self._explain(connection, tick, params)
                if lost is not None:
                    return lost
                if tick is not None and connection.execute(self.sql.skewed, params).scalar():
                    return Lost("clock_skew", None, None, tick)
                return self._first_claim(connection, holder, tick, params)
        except SQLAlchemyError as error:
            raise store_fault("lease claim", name, self.engine, error) from error

    def _first_claim(
        self, connection: Any, holder: str, tick: datetime | None, params: dict[str, Any]
    ) -> Claim:
        """No row at all: the sweep's first claim ever. A duplicate key means
        another replica inserted it first, the one error that means "lost the
        race" and not "broken"."""
        try:
            connection.execute(self.sql.insert, params)
        except DBAPIError as error:
            if not is_duplicate_key(error):
                raise
            return self._explain(connection, tick, params) or Lost("lease_held", None, None, None)
        return Won(token=1, holder=holder, tick=tick)

    def _explain(
        self, connection: Any, tick: datetime | None, params: dict[str, Any]
    ) -> Lost | None:
        """Why the UPDATE changed nothing, or None when there is no row yet."""
        row = connection.execute(self.sql.explain, params).first()
        return None if row is None else why_lost(tuple(row), tick)

    def renew(self, name: str, holder: str, token: int, ttl: timedelta) -> bool:
        """Push the expiry out by ``ttl`` from the database's now; False if the lease
        is no longer ours. Holder and token must both match: a holder whose lease
        was claimed by another has an old token, and must not extend the new lease."""
        return name in self.renew_many(holder, [(name, token, ttl)])

    def renew_many(self, holder: str, held: list[tuple[str, int, timedelta]]) -> set[str]:
        """``renew`` for several (name, token, ttl) leases of ``holder``: the names
        still held. One statement per distinct ttl (two on MySQL/MariaDB)."""
        by_ttl: dict[timedelta, list[tuple[str, int]]] = {}
        for name, token, ttl in held:
            by_ttl.setdefault(ttl, []).append((name, token))
        renewed: set[str] = set()
        try:
            with self.engine.connect() as connection:
                for ttl, leases in by_ttl.items():
                    params = {
                        "p_namespace": self.namespace,
                        "p_holder": holder,
                        "p_held": leases,
                        "p_micros": ttl // MICRO,
                    }
                    found = connection.execute(self.sql.renew_many, params)
                    if self._mysql:
                        found = connection.execute(self.sql.still_held, params)
                    renewed.update(found.scalars())
        except SQLAlchemyError as error:
            first = held[0][0] if held else None
            raise store_fault("lease renew", first, self.engine, error) from error
        return renewed

    def release(self, name: str, holder: str, token: int) -> bool:
        """Free the lease now, only if this holder and token still have it.

        Never raises: it runs in ``finally`` blocks, where an exception would
        hide the caller's own, and the TTL frees the lease regardless.
        Returns False when nothing was released (taken over, or a fault).
        """
        params = self._params(name, p_holder=holder, p_token=token)
        try:
            with self.engine.connect() as connection:
                return bool(connection.execute(self.sql.release, params).rowcount == 1)
        except SQLAlchemyError:
            return False

    def release_many(self, holder: str, held: list[tuple[str, int]]) -> list[bool]:
        """Per (name, token) lease of ``holder``, whether it was freed; a fault
        raises ``StoreError``, saying why, for a caller that retries. One
        statement each, on one connection: a batch's releases go with its
        rows, in the tick store's close."""
        name = held[0][0] if held else None  # the one a fault is reported for
        freed: list[bool] = []
        try:
            with self.engine.connect() as connection:
                for name, token in held:
                    mine = self._params(name, p_holder=holder, p_token=token)
                    freed.append(connection.execute(self.sql.release, mine).rowcount == 1)
        except SQLAlchemyError as error:
            raise store_fault("lease release", name, self.engine, error) from error
        return freed

    def read(self, name: str) -> LeaseRow | None:
        try:
            with self.engine.connect() as connection:
                row = connection.execute(self.sql.read, self._params(name)).first()
        except SQLAlchemyError as error:
            raise store_fault("lease read", name, self.engine, error) from error
        return None if row is None else LeaseRow(**row._mapping)

    def now(self) -> datetime:
        """The database's clock."""
        try:
            with self.engine.connect() as connection:
                value = connection.execute(select(db_now())).scalar_one()
        except SQLAlchemyError as error:
            raise store_fault("clock read", None, self.engine, error) from error
        assert isinstance(value, datetime)
        return value


def why_lost(found: tuple[Any, ...], tick: datetime | None) -> Lost:
    """Why a claim of ``tick`` lost, from the lease row as the claim found it:
    holder, expiry, last tick, and whether ``tick`` was early by its clock."""
    holder, expires_at, last, early = found
    if tick is not None and last is not None and last >= tick:
        return Lost("already_run", holder, expires_at, last)
    if tick is not None and early:
        return Lost("clock_skew", holder, expires_at, last)
    return Lost("lease_held", holder, expires_at, last)


__all__ = [
    "Claim",
    "LeaseRow",
    "LeaseStore",
    "Lost",
    "StoreError",
    "Won",
    "make_holder",
]
