"""The tick store on every dialect: a tick's open and close are committed, explained and loud.

On PostgreSQL, every tick after a sweep's first is one batched statement that runs on the
driver's own cursor, outside SQLAlchemy's execution layer. These tests hold that path to what
``Connection.execute`` gave: committed at once (autocommit), times in UTC whatever the
session's time zone, a fault raised as a ``StoreError`` that says whether it may pass, and a
connection that died in a fault never handed out again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, event, select, text
from sqlalchemy.engine import make_url
from tcp_proxy import proxy_for

from sweepd.db import migrate
from sweepd.db.engine import db_now, make_engine
from sweepd.db.schema import sweep_leases, sweep_runs
from sweepd.errors import StoreError
from sweepd.history import History
from sweepd.lease import LeaseStore, Lost, Won
from sweepd.model import SweepDef
from sweepd.schedule import Every
from sweepd.store import Ask, Closed, Hand, Opened, TickStore, tick_store
from sweepd.store.postgresql import PLAN_EACH_TIME_OVER, pg_array

MakeDatabase = Callable[[str], str]
NAMESPACE = "ticks"
TTL = timedelta(seconds=30)
T0 = datetime(2026, 1, 1, tzinfo=UTC)  # in the past: the claim refuses ticks from the future
SWEEPS = [
    SweepDef(
        name=f"sweep-{i}",
        func=lambda: None,
        target="tests:nothing",
        schedule=Every(timedelta(minutes=1)),
        ttl=TTL,
        timeout=None,
        misfire_grace=timedelta(minutes=5),
    )
    for i in range(3)
]


def tick(n: int) -> datetime:
    return T0 + timedelta(minutes=n)


@pytest.fixture
def engines() -> Iterator[Callable[[str], Engine]]:
    made: list[Engine] = []

    def make(url: str) -> Engine:
        engine = make_engine(url, timeout=timedelta(seconds=2))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.dispose()


def ticks_of(engine: Engine, holder: str) -> TickStore:
    return tick_store(LeaseStore(engine, NAMESPACE), History(engine, NAMESPACE), holder)


def open_all(store: TickStore, n: int) -> list[Opened]:
    """Open tick ``n`` of every sweep; each must be decided."""
    found = store.open([Ask(sweep, tick(n), "schedule") for sweep in SWEEPS], len(SWEEPS))
    assert all(isinstance(opened, Opened) for opened in found), found
    return [opened for opened in found if isinstance(opened, Opened)]


def close_all(store: TickStore, opened: list[Opened]) -> list[object]:
    hands = []
    for sweep, one in zip(SWEEPS, opened, strict=True):
        assert isinstance(one.claim, Won)
        assert isinstance(one.started, int)
        hands.append(Hand(sweep.name, one.claim.token, (one.started, sweep.name, "success", None)))
    return list(store.close(hands))


def released(engine: Engine) -> bool:
    """Whether every lease has expired by the database's clock (a release sets it to now)."""
    with engine.connect() as connection:
        expiries = connection.execute(select(sweep_leases.c.expires_at)).scalars().all()
        now = connection.execute(select(db_now())).scalar_one()
    assert len(expiries) == len(SWEEPS)
    return all(expiry <= now for expiry in expiries)


def test_each_open_and_close_is_committed_when_it_returns(
    dialect: str, make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    url = make_database(dialect)
    migrate.upgrade(url)
    store, other = ticks_of(engines(url), "a"), engines(url)
    # Tick 1 is each sweep's first claim (an INSERT); tick 2, on PostgreSQL, the batched statement.
    for n in (1, 2):
        opened = open_all(store, n)
        assert [o.claim for o in opened] == [Won(n, "a", tick(n))] * len(SWEEPS)
        with other.connect() as seen:
            leases = seen.execute(
                select(sweep_leases.c.holder, sweep_leases.c.fencing_token, sweep_leases.c.tick)
            ).all()
            assert sorted(leases) == [("a", n, tick(n))] * len(SWEEPS)
            running = seen.execute(
                select(sweep_runs.c.id).where(sweep_runs.c.status == "running")
            ).scalars()
            assert set(running) == {o.started for o in opened}
        assert not released(other)

        assert close_all(store, opened) == [Closed(None, True)] * len(SWEEPS)
        with other.connect() as seen:
            statuses = seen.execute(
                select(sweep_runs.c.status).where(sweep_runs.c.tick == tick(n))
            ).scalars()
            assert list(statuses) == ["success"] * len(SWEEPS)
        assert released(other)
    # Another replica takes the next tick at once: the releases were committed.
    assert [o.claim for o in open_all(ticks_of(other, "b"), 3)] == [Won(3, "b", tick(3))] * len(
        SWEEPS
    )


def test_a_lost_tick_is_explained_in_utc_whatever_the_sessions_time_zone(
    make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    url = make_database("postgresql")
    migrate.upgrade(url)
    with engines(url).connect() as admin:
        database = make_url(url).database
        admin.execute(text(f"ALTER DATABASE \"{database}\" SET timezone TO 'America/St_Johns'"))
    a, b = ticks_of(engines(url), "a"), ticks_of(engines(url), "b")
    with b.engine.connect() as connection:
        assert connection.execute(text("SHOW timezone")).scalar() == "America/St_Johns"
    close_all(a, open_all(a, 1))  # the first claims, so that tick 2 is the batched statement
    assert all(isinstance(o.claim, Won) for o in open_all(a, 2))
    for lost in (o.claim for o in open_all(b, 2)):
        assert isinstance(lost, Lost)
        assert (lost.reason, lost.holder, lost.tick) == ("already_run", "a", tick(2))
        assert lost.tick is not None and lost.tick.tzinfo is UTC
        assert lost.expires_at is not None and lost.expires_at.tzinfo is UTC


def test_array_literals_carry_any_text_and_any_time_exactly(
    make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    """The batched statements pass their lists as array literals: nothing may be lost in them."""
    texts = [
        "null",
        "NULL",
        'say "hi"',
        "back\\slash\\",
        "a,b",
        "{x}",
        " pad ",
        "",
        "é ✓",
        "a\nb",
        None,
    ]
    india = timezone(timedelta(hours=5, minutes=30))
    times = [tick(1), datetime(2026, 3, 29, 1, 30, 0, 123456, tzinfo=india), None]
    numbers = [0, -1, 2**62]
    with engines(make_database("postgresql")).connect() as connection:
        connection.execute(text("SET timezone TO 'America/St_Johns'"))

        def cast(values: Sequence[str | int | datetime | None], to: str) -> list[object]:
            literal = pg_array(values)
            return list(
                connection.execute(text(f"SELECT CAST(:p AS {to})"), {"p": literal}).scalar_one()
            )

        assert cast(texts, "text[]") == texts
        assert cast(times, "timestamptz[]") == times  # the same instants
        assert cast(numbers, "bigint[]") == numbers


def migrated(
    dialect: str, make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> tuple[Engine, TickStore]:
    """A new database at head, an engine on it, and holder a's store on that engine."""
    url = make_database(dialect)
    migrate.upgrade(url)
    engine = engines(url)
    return engine, ticks_of(engine, "a")


def test_a_stopped_server_fails_opens_and_closes_loudly_and_the_pool_recovers(
    make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    url = make_database("postgresql")
    migrate.upgrade(url)
    proxy, proxied = proxy_for(url)
    try:
        store = ticks_of(engines(proxied), "a")
        close_all(store, open_all(store, 1))
        opened = open_all(store, 2)

        proxy.stop()  # closes the pooled connection under the store
        with pytest.raises(StoreError, match="lease claim for 'sweep-0' failed") as raised:
            store.open([Ask(SWEEPS[0], tick(3), "schedule")], 1)
        assert raised.value.transient
        failed = close_all(store, opened)
        assert all(isinstance(f, Closed) and "run finish" in str(f.row_error) for f in failed)
        # The release failed with the rows, and says so: the runner retries it.
        assert all(isinstance(f, Closed) and not f.released and f.release_error for f in failed)

        proxy.start()
        # The dead connection was dropped, not pooled: the very next call goes through.
        assert close_all(store, opened) == [Closed(None, True)] * len(SWEEPS)
        assert [o.claim for o in open_all(store, 3)] == [Won(3, "a", tick(3))] * len(SWEEPS)
    finally:
        proxy.stop()


def test_a_missing_table_fails_the_batched_open_as_a_fault_that_will_not_pass(
    make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    engine, store = migrated("postgresql", make_database, engines)
    close_all(store, open_all(store, 1))
    with engine.connect() as connection:
        connection.execute(text("DROP TABLE sweep_runs"))
    with pytest.raises(StoreError, match="UndefinedTable") as raised:
        open_all(store, 2)
    assert not raised.value.transient


def after_one_tick(
    dialect: str, make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> tuple[str, TickStore, TickStore]:
    """A database where holder a ran tick 1 of every sweep: its URL, and the stores
    of a and b (on one engine of their own)."""
    url = make_database(dialect)
    migrate.upgrade(url)
    engine = engines(url)
    a, b = ticks_of(engine, "a"), ticks_of(engine, "b")
    close_all(a, open_all(a, 1))
    return url, a, b


def test_a_batch_explains_each_tick_it_does_not_win_and_leaves_the_rest_undecided(
    dialect: str, make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    _, a, b = after_one_tick(dialect, make_database, engines)
    held, ran, early = SWEEPS
    [holding] = b.open([Ask(held, tick(2), "schedule")], 1)  # b holds it, still running
    [newer] = b.open([Ask(ran, tick(3), "schedule")], 1)
    assert isinstance(holding, Opened) and isinstance(newer, Opened)
    assert isinstance(newer.claim, Won) and isinstance(newer.started, int)
    b.close([Hand(ran.name, newer.claim.token, (newer.started, ran.name, "success", None))])
    future = datetime.now(UTC) + timedelta(hours=1)

    found = a.open(
        [
            Ask(held, tick(5), "schedule"),
            Ask(ran, tick(2), "schedule"),
            Ask(early, future, "schedule"),
        ],
        3,
    )
    claims = [one.claim if isinstance(one, Opened) else one for one in found]
    assert [c.reason if isinstance(c, Lost) else c for c in claims] == [
        "lease_held",
        "already_run",
        "clock_skew",
    ]
    lease_held, already_run, _ = claims
    assert isinstance(lease_held, Lost) and isinstance(already_run, Lost)
    assert lease_held.holder == "b" and lease_held.tick == tick(2)
    assert lease_held.expires_at is not None and lease_held.expires_at > datetime.now(UTC)
    assert already_run.tick == tick(3) and already_run.expires_at is not None
    assert already_run.expires_at.tzinfo is not None

    # Two open ticks and a limit of one: the second is not decided, and stays unclaimed.
    first, second = a.open([Ask(ran, tick(4), "schedule"), Ask(early, tick(4), "schedule")], 1)
    assert isinstance(first, Opened) and first.claim == Won(3, "a", tick(4))
    assert second is None
    [later] = a.open([Ask(early, tick(4), "schedule")], 1)
    assert isinstance(later, Opened) and later.claim == Won(2, "a", tick(4))


def test_a_batch_marks_the_rows_an_older_holder_left_running_lost(
    dialect: str, make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    url, a, b = after_one_tick(dialect, make_database, engines)
    engine = engines(url)
    crashed = open_all(a, 2)  # a dies here: its rows stay running, its leases run out
    with engine.connect() as connection:
        connection.execute(sweep_leases.update().values(expires_at=T0))

    taken = open_all(b, 3)
    assert [o.claim for o in taken] == [Won(3, "b", tick(3))] * len(SWEEPS)
    assert [o.lost_runs for o in taken] == [1] * len(SWEEPS)
    with engine.connect() as connection:
        rows = dict(connection.execute(select(sweep_runs.c.id, sweep_runs.c.status)).all())
    assert {rows[o.started] for o in crashed if isinstance(o.started, int)} == {"lost"}
    assert {rows[o.started] for o in taken if isinstance(o.started, int)} == {"running"}


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_batch_whose_rows_cannot_be_written_claims_nothing(
    dialect: str, make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    url, store, _ = after_one_tick(dialect, make_database, engines)
    other = engines(url)  # its own pool: no connection of the store's is handed out here
    with other.connect() as connection:
        if dialect == "sqlite":
            connection.execute(
                text(
                    "CREATE TRIGGER no_rows BEFORE INSERT ON sweep_runs "
                    "BEGIN SELECT RAISE(ABORT, 'no rows today'); END"
                )
            )
        else:
            connection.execute(
                text(
                    "CREATE FUNCTION no_rows() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'no rows today'; END $$"
                )
            )
            connection.execute(
                text(
                    "CREATE TRIGGER no_rows BEFORE INSERT ON sweep_runs "
                    "FOR EACH ROW EXECUTE FUNCTION no_rows()"
                )
            )

    with pytest.raises(StoreError, match="no rows today"):
        store.open([Ask(sweep, tick(2), "schedule") for sweep in SWEEPS], len(SWEEPS))

    with other.connect() as connection:
        leases = connection.execute(select(sweep_leases.c.fencing_token, sweep_leases.c.tick)).all()
        assert leases == [(1, tick(1))] * len(SWEEPS)  # no claim of tick 2 survived
        # Nothing holds SQLite's write lock either: this would wait out the busy timeout.
        connection.execute(
            text("DROP TRIGGER no_rows" + (" ON sweep_runs" if dialect != "sqlite" else ""))
        )
    assert [o.claim for o in open_all(store, 2)] == [Won(2, "a", tick(2))] * len(SWEEPS)


def test_a_large_batch_is_planned_for_its_own_arrays_and_a_small_one_is_prepared(
    make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    engine, store = migrated("postgresql", make_database, engines)
    many = [replace(SWEEPS[0], name=f"many-{i}") for i in range(PLAN_EACH_TIME_OVER + 1)]

    def prepared_opens() -> int:
        with engine.connect() as connection:  # the pool's one connection, the store's too
            return int(
                connection.execute(
                    text(
                        "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%wanted%'"
                    )
                ).scalar_one()
            )

    def expire_all() -> None:
        with engine.connect() as connection:
            connection.execute(sweep_leases.update().values(expires_at=T0))

    store.open([Ask(sweep, tick(0), "schedule") for sweep in many], len(many))  # first claims
    for n in range(1, 11):
        expire_all()
        found = store.open([Ask(sweep, tick(n), "schedule") for sweep in many], len(many))
        assert all(isinstance(o, Opened) and isinstance(o.claim, Won) for o in found)
    # psycopg prepares a statement at its fifth run; ten runs of the large batch were not.
    assert prepared_opens() == 0
    for n in range(11, 21):
        expire_all()
        [opened] = store.open([Ask(many[0], tick(n), "schedule")], 1)
        assert isinstance(opened, Opened) and isinstance(opened.claim, Won)
    assert prepared_opens() == 1


def test_two_asks_for_one_sweep_in_one_batch_never_both_win(
    dialect: str, make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    # Reachable when a reload removes a sweep whose tick waits for a slot and
    # the next adds it back: the old and the new flight ask in one batch.
    _, a, _ = after_one_tick(dialect, make_database, engines)
    sweep, other, _ = SWEEPS
    asks = [Ask(sweep, tick(2), "schedule"), Ask(other, tick(2), "schedule")]
    found = a.open([*asks, Ask(sweep, tick(3), "schedule")], 3)
    assert [type(f) for f in found] == [Opened, Opened, type(None)]
    won = [f for f in found if isinstance(f, Opened) and isinstance(f.claim, Won)]
    assert len(won) == 2 and len({f.started for f in won}) == 2  # one row each
    with a.engine.connect() as connection:
        runs = connection.execute(
            select(sweep_runs.c.name).where(sweep_runs.c.status == "running")
        ).scalars()
        assert sorted(runs) == [sweep.name, other.name]


def test_the_portable_store_writes_the_rows_it_won_in_one_insert_from_its_first_open(
    make_database: MakeDatabase, engines: Callable[[str], Engine]
) -> None:
    # MariaDB returns a multi-row INSERT's ids, but its dialect learns so only at
    # its first connect: read before that, it said no and wrote a row per INSERT.
    url = make_database("mariadb")
    migrate.upgrade(url)
    engine = engines(url)  # not yet connected
    store = ticks_of(engine, "a")
    close_all(store, open_all(store, 1))  # the first claims, which insert the lease rows
    inserts: list[bool] = []

    def count(_c: object, _cur: object, sql: str, _p: object, _x: object, many: bool) -> None:
        if sql.lstrip().upper().startswith("INSERT INTO SWEEP_RUNS"):
            inserts.append(many)

    event.listen(engine, "before_cursor_execute", count)
    try:
        opened = open_all(store, 2)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert all(isinstance(o.claim, Won) for o in opened)
    assert inserts == [True]  # one statement for the three rows
