"""Retries, timeouts, renewals and history pruning, through a real `sweepd run`."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from daemon_harness import Replica, read_rows, read_runs, sweep, write_config
from sqlalchemy import select, update

from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.db.schema import sweep_leases, sweep_runs
from sweepd.history import History

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, make_database: Callable[[str], str]) -> str:
    return make_database(str(request.param))


def run_until(
    replica: Replica, predicate: Callable[[list[dict[str, object]]], bool], timeout: float = 25.0
) -> None:
    try:
        replica.wait_for(lambda _e: predicate(replica.events()), timeout=timeout)
    finally:
        replica.signal(signal.SIGTERM)
        assert replica.wait(30) == 0


def finished(events: list[dict[str, object]], status: str) -> int:
    return sum(1 for e in events if e.get("event") == "run.finished" and e.get("status") == status)


def test_a_failed_attempt_is_retried_in_the_same_tick_under_the_same_lease(
    url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    flaky = sweep(
        "flaky",
        out,
        every="1h",
        anchor="2026-01-01T00:00:00Z",
        catch_up="latest",
        retries={"max": 2, "backoff": "200ms"},
        args={"fail_times": 2},
    )
    replica = Replica(
        write_config(tmp_path / "sweepd.yaml", url, [flaky]), tmp_path / "r.log"
    ).start()
    try:
        run_until(replica, lambda events: finished(events, "success") >= 1)
    finally:
        replica.kill()
    rows = [r for r in read_rows(url) if r["name"] == "flaky"]
    assert [(r["attempt"], r["status"]) for r in rows] == [
        (1, "failed"),
        (2, "failed"),
        (3, "success"),
    ]
    assert len({(r["tick"], r["fencing_token"]) for r in rows}) == 1  # one tick, one claim
    assert rows[0]["error"] == "RuntimeError: failing attempt 1 on purpose"
    assert [r["attempt"] for r in read_runs(out) if r["event"] == "start"] == [1, 2, 3]


def test_a_run_longer_than_its_ttl_keeps_its_lease_by_renewing_it(
    database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    ttl = 3.0
    long_run = sweep(
        "long",
        out,
        every="1h",
        anchor="2026-01-01T00:00:00Z",
        catch_up="latest",
        ttl=f"{ttl:g}s",
        args={"duration": 5.0},
    )
    replica = Replica(
        write_config(tmp_path / "sweepd.yaml", database_url, [long_run]), tmp_path / "r.log"
    ).start()
    engine = make_engine(database_url)
    try:
        replica.wait_for(lambda _e: any(r["event"] == "start" for r in read_runs(out)))
        began = next(r["at"] for r in read_runs(out) if r["event"] == "start")
        # Past the ttl the claim gave, before the run's end: only renewals can have kept it.
        time.sleep(max(0.0, began + ttl + 0.8 - time.time()))
        with engine.connect() as connection:
            lease = connection.execute(
                select(sweep_leases.c.acquired_at, sweep_leases.c.expires_at).where(
                    sweep_leases.c.name == "long"
                )
            ).one()
        read_at = time.time()
        run_until(replica, lambda events: finished(events, "success") >= 1)
    finally:
        replica.kill()
        engine.dispose()
    held_for = (lease.expires_at - lease.acquired_at).total_seconds()
    assert held_for > ttl + 0.5, (
        f"the lease was not renewed: it ran out {held_for:.2f}s after the claim"
    )
    assert [r["status"] for r in read_rows(database_url) if r["name"] == "long"] == ["success"]
    # Read while the run was still going: a released lease's expiry is the release time.
    assert next(r["at"] for r in read_runs(out) if r["event"] == "end") > read_at


@pytest.mark.parametrize("callable_", ["daemon_sweeps:record", "daemon_sweeps:record_async"])
def test_a_run_past_its_timeout_is_recorded_timeout(
    url: str, tmp_path: Path, callable_: str
) -> None:
    out = tmp_path / "runs.jsonl"
    slow = sweep(
        "slow",
        out,
        every="1h",
        anchor="2026-01-01T00:00:00Z",
        catch_up="latest",
        callable=callable_,
        timeout="500ms",
        args={"duration": 5},
    )
    replica = Replica(
        write_config(tmp_path / "sweepd.yaml", url, [slow]), tmp_path / "r.log"
    ).start()
    try:
        run_until(replica, lambda events: finished(events, "timeout") >= 1, timeout=15)
    finally:
        replica.kill()
    (row,) = [r for r in read_rows(url) if r["name"] == "slow"]
    assert row["status"] == "timeout"
    assert row["finished_at"] - row["started_at"] < timedelta(seconds=3)
    ends = {r["event"] for r in read_runs(out)} - {"start"}
    # The sync sweep was told (ctx.cancelled) and stopped; the async one was cancelled.
    assert ends == ({"stopped"} if callable_.endswith(":record") else {"cancelled"})


def test_history_prune_deletes_only_old_finished_rows(url: str) -> None:
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        history = History(engine, "system")
        old = history.start("a", None, "h", 1, 1, "manual")
        history.finish(old, "a", "success")
        still_running = history.start("a", None, "h", 2, 1, "manual")
        recent = history.start("b", None, "h", 1, 1, "manual")
        history.finish(recent, "b", "failed", "boom")
        with engine.connect() as connection:
            connection.execute(
                update(sweep_runs)
                .where(sweep_runs.c.id.in_([old, still_running]))
                .values(started_at=datetime.now(UTC) - timedelta(days=30))
            )
        assert history.prune(timedelta(days=14)) == 1
        assert sorted(r.id for r in history.runs()) == sorted([still_running, recent])
    finally:
        engine.dispose()
