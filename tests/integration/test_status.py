"""What `sweepd status` and `sweepd history` read, on every dialect.

Rows are written straight into ``sweep_runs`` (and leases through LeaseStore) at instants
counted from the database's clock, so each test knows exactly which ticks ran, which did not,
and when the last success was; the expectations are computed from the instant the report read.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, insert, update

from sweepd.db.schema import sweep_leases, sweep_runs
from sweepd.history import History
from sweepd.lease import LeaseStore, Won
from sweepd.model import Database, Settings, SweepDef
from sweepd.schedule import (
    Cron,
    Every,
    Schedule,
    next_tick,
    previous_tick,
    stale_after,
    ticks_between,
)
from sweepd.status import GAPS_SHOWN, Report, SweepStatus, as_json, read, render_text

NS = "test"
TEN = timedelta(seconds=10)
HOLDER = "host-a:101:0a1b2c3d"


def noop() -> None:
    """Never called: status reads the database, it runs nothing."""


def sweep(
    name: str,
    schedule: Schedule | None = None,
    *,
    ttl: timedelta = timedelta(seconds=5),
    grace: timedelta = timedelta(seconds=1),
    enabled: bool = True,
) -> SweepDef:
    return SweepDef(
        name=name,
        func=noop,
        target="tests:noop",
        schedule=schedule or Every(TEN),
        ttl=ttl,
        timeout=None,
        misfire_grace=grace,
        enabled=enabled,
    )


def settings(url: str, *sweeps: SweepDef, keep: timedelta = timedelta(days=14)) -> Settings:
    return Settings(
        path="sweepd.yaml",
        database=Database(url, explicit=True),
        namespace=NS,
        sweeps=sweeps,
        history_keep=keep,
    )


@pytest.fixture
def now(engine: Engine) -> datetime:
    """The database's clock, which every instant of a test is counted from."""
    return LeaseStore(engine, NS).now()


def last_tick(now: datetime) -> datetime:
    found = previous_tick(Every(TEN), now)
    assert found is not None
    return found


def run(
    name: str,
    tick: datetime | None,
    status: str = "success",
    *,
    started: datetime | None = None,
    trigger: str = "schedule",
    attempt: int = 1,
) -> dict[str, Any]:
    """One ``sweep_runs`` row; it starts at its tick and ends a moment later unless told."""
    began = started or tick
    assert began is not None
    return {
        "namespace": NS,
        "name": name,
        "tick": tick,
        "holder": HOLDER,
        "fencing_token": 1,
        "attempt": attempt,
        "trigger": trigger,
        "started_at": began,
        "finished_at": None if status == "running" else began + timedelta(milliseconds=200),
        "status": status,
        "error": "RuntimeError: on purpose" if status == "failed" else None,
    }


def write(engine: Engine, rows: list[dict[str, Any]]) -> None:
    with engine.connect() as connection:
        connection.execute(insert(sweep_runs), rows)


def every_tick(name: str, start: datetime, end: datetime, **fields: Any) -> list[dict[str, Any]]:
    """A row for each tick of the ten-second schedule in [start, end]."""
    return [run(name, t, **fields) for t in ticks_between(Every(TEN), start, end + TEN / 1000)]


def one(report: Report, name: str) -> SweepStatus:
    (found,) = [s for s in report.sweeps if s.sweep.name == name]
    return found


# -- the rules, without a database -----------------------------------------------------------


def test_stale_after_is_two_intervals_and_the_ttl() -> None:
    at = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)
    assert stale_after(Every(timedelta(seconds=30)), timedelta(minutes=10), at) == timedelta(
        minutes=11
    )


def test_a_cron_interval_is_the_gap_between_its_last_two_ticks() -> None:
    weekdays = Cron("0 9 * * 1-5", "UTC")
    ttl = timedelta(minutes=1)
    monday, tuesday = datetime(2026, 3, 2, 10, tzinfo=UTC), datetime(2026, 3, 3, 10, tzinfo=UTC)
    # Monday's last two ticks are Friday's and Monday's: three days apart.
    assert stale_after(weekdays, ttl, monday) == 2 * timedelta(days=3) + ttl
    assert stale_after(weekdays, ttl, tuesday) == 2 * timedelta(days=1) + ttl


# -- stale --------------------------------------------------------------------------------------


def test_a_sweep_that_ran_every_tick_is_neither_stale_nor_gapped(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    write(engine, every_tick("purge", last - 20 * TEN, last))
    report = read(engine, settings(database_url, sweep("purge")))
    state = one(report, "purge")
    assert report.now >= now
    assert not state.stale
    assert state.stale_after == 2 * TEN + timedelta(seconds=5)
    assert state.gaps.count == 0
    assert state.gaps.since == last - 20 * TEN
    assert state.last_run is not None and state.last_run.tick == last
    assert state.last_success is not None and state.last_success.tick == last
    assert state.next_tick == next_tick(Every(TEN), report.now)
    assert report.problems() == []


def test_no_success_within_two_intervals_and_the_ttl_is_stale(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    write(
        engine,
        [
            *every_tick("failing", last - 10 * TEN, last - 7 * TEN),
            *every_tick("failing", last - 6 * TEN, last, status="failed"),
            *every_tick("recovered", last - 10 * TEN, last - 2 * TEN, status="failed"),
            *every_tick("recovered", last - TEN, last),
        ],
    )
    report = read(engine, settings(database_url, sweep("failing"), sweep("recovered")))
    failing, recovered = one(report, "failing"), one(report, "recovered")
    assert failing.stale
    assert failing.last_run is not None and failing.last_run.status == "failed"
    assert failing.last_success is not None and failing.last_success.tick == last - 7 * TEN
    assert failing.gaps.count == 0  # every tick ran, it just failed
    assert not recovered.stale
    (problem,) = report.problems()
    assert problem.startswith("failing: STALE: last success ")


def test_a_sweep_that_never_succeeded_is_stale_once_its_first_row_is_older_than_the_limit(
    engine: Engine, now: datetime, database_url: str
) -> None:
    write(
        engine,
        [
            run("new", None, "failed", started=now - timedelta(seconds=5), trigger="manual"),
            run("broken", None, "failed", started=now - timedelta(seconds=60), trigger="manual"),
            run("broken", None, "failed", started=now - timedelta(seconds=2), trigger="manual"),
        ],
    )
    report = read(engine, settings(database_url, sweep("new"), sweep("broken"), sweep("silent")))
    assert not one(report, "new").stale
    assert one(report, "broken").stale
    silent = one(report, "silent")
    assert not silent.stale  # never ran at all: nothing to measure from yet
    assert (silent.last_run, silent.last_success, silent.lease) == (None, None, None)
    assert silent.gaps.count == 0 and silent.gaps.since is None
    assert [p.split(":")[0] for p in report.problems()] == ["broken"]
    assert "never succeeded" in report.problems()[0]


def test_a_disabled_sweep_is_never_stale_and_has_no_gaps(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    write(engine, [run("off", last - 30 * TEN, "failed"), run("off", last - 20 * TEN, "failed")])
    report = read(engine, settings(database_url, sweep("off", enabled=False)))
    state = one(report, "off")
    assert not state.stale and state.stale_after is None
    assert state.gaps.count == 0 and state.next_tick is None
    assert state.last_run is not None and state.last_run.status == "failed"
    assert report.problems() == []
    assert "disabled" in render_text(report, database_url)


# -- gaps ---------------------------------------------------------------------------------------


def test_gaps_are_the_ticks_no_replica_ran_since_the_first_recorded_run(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    rows = [
        r
        for r in every_tick("purge", last - 10 * TEN, last)
        if r["tick"] not in (last - 7 * TEN, last - 4 * TEN)
    ]
    # A retry is a second row of one tick; a manual run, long before, is no scheduled tick.
    rows += [
        run("purge", last - 9 * TEN, "failed", attempt=2, started=last - 9 * TEN + TEN / 2),
        run("purge", None, started=now - timedelta(hours=1), trigger="manual"),
    ]
    write(engine, rows)
    state = one(read(engine, settings(database_url, sweep("purge"))), "purge")
    assert state.gaps.count == 2
    assert state.gaps.ticks == (last - 7 * TEN, last - 4 * TEN)
    assert state.gaps.last == last - 4 * TEN
    assert state.gaps.since == last - 10 * TEN


def test_ticks_younger_than_misfire_grace_and_ttl_are_not_gaps_yet(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    write(engine, every_tick("slow", last - 20 * TEN, last - 10 * TEN))
    young = timedelta(seconds=30) + timedelta(seconds=25)
    slow = sweep("slow", grace=timedelta(seconds=30), ttl=timedelta(seconds=25))
    report = read(engine, settings(database_url, slow))
    state = one(report, "slow")
    missing = ticks_between(Every(TEN), last - 9 * TEN, report.now - young)
    assert state.gaps.count == len(missing) > 0
    assert state.gaps.until == report.now - young
    assert state.gaps.last == missing[-1]


def test_the_window_is_history_keep_or_the_one_asked_for(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    write(engine, [run("purge", last - 60 * TEN), run("purge", last)])
    config = settings(database_url, sweep("purge"), keep=timedelta(minutes=2))
    report = read(engine, config)
    kept = ticks_between(Every(TEN), report.now - timedelta(minutes=2), last)
    assert one(report, "purge").gaps.count == len(kept)
    assert one(report, "purge").gaps.since == report.now - timedelta(minutes=2)
    narrow = read(engine, config, window=timedelta(seconds=35))
    asked = ticks_between(Every(TEN), narrow.now - timedelta(seconds=35), last)
    assert one(narrow, "purge").gaps.count == len(asked)


def test_the_gaps_listed_are_capped_and_all_are_counted(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    write(engine, [run("purge", last - 30 * TEN), run("purge", last)])
    report = read(engine, settings(database_url, sweep("purge")))
    gaps = one(report, "purge").gaps
    assert gaps.count == 29
    assert gaps.ticks == tuple(last - (30 - k) * TEN for k in range(1, GAPS_SHOWN + 1))
    assert gaps.last == last - TEN
    (problem,) = report.problems()
    assert problem.startswith("purge: 29 ticks no replica ran")


def test_rows_of_an_earlier_schedule_do_not_count_as_gaps(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    # The schedule used to be five seconds off the current one's ticks.
    old = Every(TEN, anchor=datetime(1970, 1, 1, 0, 0, 5, tzinfo=UTC))
    before = [run("moved", t) for t in ticks_between(old, last - 20 * TEN, last - 9 * TEN)]
    write(engine, [*before, *every_tick("moved", last - 9 * TEN, last)])
    state = one(read(engine, settings(database_url, sweep("moved"))), "moved")
    assert state.gaps.count == 0
    assert state.gaps.since == before[-1]["tick"] + timedelta(microseconds=1)


# -- the lease ----------------------------------------------------------------------------------


def test_the_lease_is_shown_held_or_expired_by_the_databases_clock(
    engine: Engine, now: datetime, database_url: str
) -> None:
    store = LeaseStore(engine, NS)
    last = last_tick(now)
    assert isinstance(store.claim("held", HOLDER, timedelta(hours=1), last), Won)
    assert isinstance(store.claim("expired", "host-b:7:ffff0000", timedelta(hours=1), last), Won)
    with engine.connect() as connection:
        connection.execute(
            update(sweep_leases)
            .where(sweep_leases.c.name == "expired")
            .values(expires_at=now - timedelta(seconds=5))
        )
    report = read(engine, settings(database_url, sweep("held"), sweep("expired"), sweep("none")))
    held, expired = one(report, "held"), one(report, "expired")
    assert held.lease is not None and held.lease.holder == HOLDER and held.lease.tick == last
    assert held.lease_expired is False
    assert expired.lease is not None and expired.lease.holder == "host-b:7:ffff0000"
    assert expired.lease_expired is True
    assert (one(report, "none").lease, one(report, "none").lease_expired) == (None, None)
    text = render_text(report, database_url)
    assert HOLDER in text and "expired" in text


# -- the report's two forms -----------------------------------------------------------------------


def test_the_json_form_is_stable_and_parses(
    engine: Engine, now: datetime, database_url: str
) -> None:
    last = last_tick(now)
    write(
        engine,
        [
            run("purge", last - 5 * TEN),
            run("purge", last - TEN, "failed"),
            run("purge", last, "failed"),
        ],
    )
    report = read(engine, settings(database_url, sweep("purge"), sweep("off", enabled=False)))
    data = json.loads(json.dumps(as_json(report, database_url)))
    assert data["version"] == 1
    assert data["namespace"] == NS
    assert data["ok"] is False and data["problems"] == report.problems()
    purge = next(s for s in data["sweeps"] if s["name"] == "purge")
    assert purge["schedule"] == {"kind": "every", "every": "10s", "anchor": None, "timezone": "UTC"}
    assert purge["last_run"]["status"] == "failed"
    assert purge["last_success"]["tick"] == (last - 5 * TEN).isoformat().replace("+00:00", "Z")
    assert purge["stale"] is True and purge["stale_after"] == "25s"
    assert purge["gaps"]["count"] == 3
    assert set(purge) >= {"lease", "next_tick", "enabled"}


def test_the_text_form_never_shows_a_password(engine: Engine, database_url: str) -> None:
    shown = render_text(
        read(engine, settings(database_url, sweep("purge"))), "postgresql://app:hunter2@db/app"
    )
    assert "hunter2" not in shown and "app:***@db" in shown


# -- history ------------------------------------------------------------------------------------


def test_history_filters_by_sweep_status_and_age_newest_first(
    engine: Engine, now: datetime
) -> None:
    write(
        engine,
        [
            run("purge", now - timedelta(hours=2), "success"),
            run("purge", now - timedelta(minutes=30), "failed"),
            run("purge", None, "success", started=now - timedelta(minutes=5), trigger="manual"),
            run("other", now - timedelta(minutes=1), "timeout"),
        ],
    )
    history = History(engine, NS)
    assert [r.name for r in history.runs(limit=20)] == ["other", "purge", "purge", "purge"]
    assert [r.trigger for r in history.runs("purge", limit=2)] == ["manual", "schedule"]
    assert [r.status for r in history.runs("purge", status="failed")] == ["failed"]
    recent = history.runs(since=timedelta(hours=1))
    assert [(r.name, r.status) for r in recent] == [
        ("other", "timeout"),
        ("purge", "success"),
        ("purge", "failed"),
    ]
    assert history.runs("nobody") == []
