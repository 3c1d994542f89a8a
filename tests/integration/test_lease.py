"""The lease protocol on every dialect, against real databases."""

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.engine import make_url

from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.lease import LeaseStore, Lost, Won
from sweepd.library import Lease, LeaseUnavailable, leased

TTL = timedelta(seconds=30)
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def tick(n: int) -> datetime:
    return T0 + timedelta(minutes=n)


@pytest.fixture
def store(engine: Engine) -> LeaseStore:
    return LeaseStore(engine, "test")


def test_first_claim_wins_token_one_and_the_same_tick_is_not_won_twice(store: LeaseStore) -> None:
    assert store.claim("purge", "a", TTL, tick(1)) == Won(token=1, holder="a", tick=tick(1))
    lost = store.claim("purge", "b", TTL, tick(1))
    assert isinstance(lost, Lost)
    assert (lost.reason, lost.holder, lost.tick) == ("already_run", "a", tick(1))


def test_a_newer_tick_waits_for_the_lease_and_tokens_grow_by_one(store: LeaseStore) -> None:
    first = store.claim("purge", "a", TTL, tick(1))
    assert isinstance(first, Won)
    held = store.claim("purge", "b", TTL, tick(2))
    assert isinstance(held, Lost)
    assert (held.reason, held.holder) == ("lease_held", "a")
    assert held.expires_at is not None and held.expires_at > store.now()
    assert store.release("purge", "a", first.token)
    second = store.claim("purge", "b", TTL, tick(2))
    assert second == Won(token=2, holder="b", tick=tick(2))
    # An older tick than the last claimed is never run, even with the lease free.
    assert store.release("purge", "b", 2)
    stale = store.claim("purge", "c", TTL, tick(1))
    assert isinstance(stale, Lost) and stale.reason == "already_run"


def test_namespaces_and_names_are_separate_leases(engine: Engine) -> None:
    one, two = LeaseStore(engine, "one"), LeaseStore(engine, "two")
    assert isinstance(one.claim("purge", "a", TTL, tick(1)), Won)
    assert isinstance(two.claim("purge", "b", TTL, tick(1)), Won)
    assert isinstance(one.claim("prune", "c", TTL, tick(1)), Won)


def test_a_claim_without_a_tick_guards_overlap_but_leaves_the_tick_alone(store: LeaseStore) -> None:
    scheduled = store.claim("purge", "a", TTL, tick(5))
    assert isinstance(scheduled, Won)
    store.release("purge", "a", scheduled.token)
    manual = store.claim("purge", "m", TTL)
    assert manual == Won(token=2, holder="m", tick=None)
    assert isinstance(store.claim("purge", "x", TTL), Lost)  # overlap refused
    row = store.read("purge")
    assert row is not None and row.tick == tick(5)  # the manual run recorded no tick
    store.release("purge", "m", manual.token)
    assert isinstance(store.claim("purge", "b", TTL, tick(6)), Won)  # next tick not shifted


def test_expiry_is_measured_on_the_database_clock_below_a_second(store: LeaseStore) -> None:
    won = store.claim("purge", "a", timedelta(milliseconds=300), tick(1))
    assert isinstance(won, Won)
    row = store.read("purge")
    assert row is not None
    assert (
        timedelta(milliseconds=290)
        <= row.expires_at - row.acquired_at
        <= timedelta(milliseconds=310)
    )
    assert isinstance(store.claim("purge", "b", TTL, tick(2)), Lost)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        outcome = store.claim("purge", "b", TTL, tick(2))
        if isinstance(outcome, Won):
            break
        time.sleep(0.05)
    else:
        pytest.fail("an expired 300 ms lease was not claimable within 5 s")
    assert outcome.token == 2
    assert store.now() - row.acquired_at < timedelta(seconds=5)


def test_renew_extends_only_for_the_holder_and_token(store: LeaseStore) -> None:
    won = store.claim("purge", "a", timedelta(seconds=2), tick(1))
    assert isinstance(won, Won)
    before = store.read("purge")
    assert store.renew("purge", "a", won.token, timedelta(minutes=5))
    after = store.read("purge")
    assert before is not None and after is not None
    assert after.expires_at - before.expires_at > timedelta(minutes=4)
    assert not store.renew("purge", "a", won.token + 1, TTL)
    assert not store.renew("purge", "b", won.token, TTL)
    assert not store.release("purge", "b", won.token)


def test_renew_many_renews_only_what_this_holder_still_holds(store: LeaseStore) -> None:
    short, long = timedelta(seconds=3), timedelta(minutes=5)
    tokens = {}
    for name in ("a1", "a2", "a3", "released", "taken"):
        won = store.claim(name, "a", short, tick(1))
        assert isinstance(won, Won)
        tokens[name] = won.token
    assert store.release("released", "a", tokens["released"])
    assert store.release("taken", "a", tokens["taken"])
    assert isinstance(store.claim("taken", "b", short, tick(2)), Won)
    before = {name: store.read(name) for name in ("a1", "a2", "a3")}

    held = [(name, tokens[name], short) for name in ("a1", "a2", "released", "taken")]
    renewed = store.renew_many("a", [*held, ("a3", tokens["a3"], long)])

    # A released lease is not taken back, and another holder's is left alone.
    assert renewed == {"a1", "a2", "a3"}
    after = {name: store.read(name) for name in ("a1", "a2", "a3")}
    for name in ("a1", "a2", "a3"):
        old, new = before[name], after[name]
        assert old is not None and new is not None
        assert new.expires_at >= old.expires_at, name
    a3 = after["a3"]
    assert a3 is not None and a3.expires_at - store.now() > timedelta(minutes=4)
    taken = store.read("taken")
    assert taken is not None and taken.holder == "b"
    assert store.renew_many("a", [("a1", tokens["a1"] + 1, short)]) == set()
    assert store.renew_many("b", [("a1", tokens["a1"], short)]) == set()


def test_a_lease_past_its_expiry_is_not_renewed(store: LeaseStore) -> None:
    """Its holder was paused past the ttl: another replica may have run the
    sweep meanwhile, so the holder must learn it lost the lease."""
    won = store.claim("purge", "a", timedelta(milliseconds=300), tick(1))
    assert isinstance(won, Won)
    time.sleep(0.5)
    assert store.renew_many("a", [("purge", won.token, TTL)]) == set()
    assert not store.renew("purge", "a", won.token, TTL)


def test_a_winning_claim_is_one_statement_once_the_row_exists(
    engine: Engine, store: LeaseStore
) -> None:
    store.release("purge", "a", _won(store.claim("purge", "a", TTL, tick(1))).token)
    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        won = _won(store.claim("purge", "a", TTL, tick(2)))
        assert len(statements) == 1, statements
        store.release("purge", "a", won.token)
        assert len(statements) == 2, statements
    finally:
        event.remove(engine, "before_cursor_execute", count)


@contextmanager
def statements_sent(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The statements sent while inside: on PostgreSQL, as the driver's cursors
    see them, since the batch statements bypass SQLAlchemy's execution layer."""
    statements: list[str] = []
    if engine.dialect.name == "postgresql":
        execute = psycopg.Cursor.execute

        def counted(cursor: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append(str(query))
            return execute(cursor, query, *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(psycopg.Cursor, "execute", counted)
            yield statements
        return

    def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_a_batch_release_frees_only_what_the_holder_still_has_under_its_token(
    engine: Engine, store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = _won(store.claim("mine", "a", TTL, tick(1)))
    stale = _won(store.claim("stale", "a", TTL, tick(1)))  # then taken over: an old token
    store.release("stale", "a", stale.token)
    taken = _won(store.claim("stale", "b", TTL, tick(2)))
    theirs = _won(store.claim("theirs", "b", TTL, tick(1)))
    held = [("mine", mine.token), ("stale", stale.token), ("theirs", theirs.token), ("none", 1)]
    assert store.release_many("a", held) == [True, False, False, False]
    # Only "a"'s lease was freed: the others still hold theirs.
    for name, holder, token in (("stale", "b", taken.token), ("theirs", "b", theirs.token)):
        assert store.renew(name, holder, token, TTL), name
    assert _won(store.claim("mine", "c", TTL, tick(2))).token == mine.token + 1


def _won(outcome: object) -> Won:
    assert isinstance(outcome, Won), outcome
    return outcome


# -- the library face --------------------------------------------------------------------


def test_lease_context_manager_holds_heartbeats_and_releases(engine: Engine) -> None:
    store = LeaseStore(engine, "default")
    with Lease(engine, "export", ttl=timedelta(milliseconds=900), tick=tick(1)) as held:
        assert held.token == 1
        # Held for over three ttls: only heartbeats can keep it.
        time.sleep(2.0)
        assert not held.lost.is_set()
        assert isinstance(store.claim("export", "other", TTL, tick(2)), Lost)
    # Released on exit: the next tick is claimable at once.
    assert isinstance(store.claim("export", "other", TTL, tick(2)), Won)


def test_lease_context_manager_refuses_when_held(engine: Engine) -> None:
    with Lease(engine, "export", ttl="30s", tick=tick(1)):
        with pytest.raises(LeaseUnavailable, match=r"^export: held by .+ until "):
            with Lease(engine, "export", ttl="30s", tick=tick(2)):
                pytest.fail("ran while another holder had the lease")
    with pytest.raises(
        LeaseUnavailable, match=r"^export: tick 2026-01-01T00:01:00\+00:00 was already claimed by "
    ):
        with Lease(engine, "export", ttl="30s", tick=tick(1)):
            pytest.fail("ran a tick twice")


def test_lease_releases_when_the_body_raises_and_keeps_its_exception(engine: Engine) -> None:
    with pytest.raises(KeyError, match="boom"), Lease(engine, "export", ttl="30s"):
        raise KeyError("boom")
    assert isinstance(LeaseStore(engine, "default").claim("export", "x", TTL), Won)


def test_async_lease(engine: Engine) -> None:
    async def main() -> int | None:
        async with Lease(engine, "export", ttl="30s", tick=tick(1)) as held:
            await asyncio.sleep(0)
            return held.token

    assert asyncio.run(main()) == 1


def test_leased_decorator_runs_only_the_winner(engine: Engine) -> None:
    calls: list[str] = []

    @leased(engine, "nightly", ttl="30s")
    def job(label: str) -> str:
        calls.append(label)
        return label.upper()

    @leased(engine, "nightly", ttl="30s")
    async def async_job() -> str:
        return "async"

    assert job("first") == "FIRST"
    with Lease(engine, "nightly", ttl="30s"):
        assert job("while held") is None
        assert asyncio.run(async_job()) is None
    assert asyncio.run(async_job()) == "async"
    assert calls == ["first"]


def test_a_tick_still_in_the_future_is_refused_as_clock_skew(store: LeaseStore) -> None:
    """A replica whose clock runs ahead must not claim ticks early, or the others skip them."""
    now = store.now()
    ahead = now + timedelta(minutes=30)
    first = store.claim("skewed", "fast", TTL, ahead)  # no row yet: the INSERT path
    assert isinstance(first, Lost)
    assert first.reason == "clock_skew"
    assert store.read("skewed") is None
    assert isinstance(store.claim("purge", "a", TTL, now - timedelta(seconds=1)), Won)
    store.release("purge", "a", 1)
    again = store.claim("purge", "fast", TTL, ahead)  # row exists: the UPDATE path
    assert isinstance(again, Lost)
    assert again.reason == "clock_skew"
    # Within the tolerance (one second early) is ordinary NTP disagreement: allowed.
    assert isinstance(store.claim("purge", "a", TTL, now + timedelta(milliseconds=500)), Won)


def test_a_lost_claim_is_explained_in_utc_whatever_the_sessions_time_zone(
    make_database: Callable[[str], str],
) -> None:
    url = make_database("postgresql")
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as admin:
            database = make_url(url).database
            admin.execute(text(f"ALTER DATABASE \"{database}\" SET timezone TO 'America/St_Johns'"))
        engine.dispose()  # new sessions, in that time zone
        store = LeaseStore(engine, "test")
        _won(store.claim("purge", "a", TTL, tick(1)))
        lost = store.claim("purge", "b", TTL, tick(1))
        assert isinstance(lost, Lost)
        assert (lost.reason, lost.holder, lost.tick) == ("already_run", "a", tick(1))
        assert lost.tick is not None and lost.tick.tzinfo is UTC
        assert lost.expires_at is not None and lost.expires_at.tzinfo is UTC
        with engine.connect() as connection:
            assert connection.execute(text("SHOW timezone")).scalar() == "America/St_Johns"
    finally:
        engine.dispose()
