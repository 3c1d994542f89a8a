"""Eight processes race for the same 200 ticks; the database gives each tick one winner.

Every racer (race_worker.py) walks the same tick list in order and claims each tick
through ``LeaseStore.claim``, releasing what it wins. Their wall clocks are moved up to
ten minutes apart with the fakeclock LD_PRELOAD shim, which must not matter: the lease
compares times on the database's clock only (on SQLite, which has no server, that is each
process's own clock, so there only the tick column keeps the ticks apart). A second test
races the very first claim of new leases, where every racer takes the INSERT path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.lease import LeaseStore

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("race_worker.py")
TICKS = 200
T0 = datetime(2026, 1, 1, tzinfo=UTC)  # the racers' first tick; tick k is T0 + k seconds
# Wall-clock offsets of the racers, in seconds: up to ten minutes either way.
BATCH_LEASES = 20  # leases each racer claims per tick in one batch
OFFSETS = [-600, -300, -120, 0, 60, 180, 420, 600]
READY_TIMEOUT = 60.0  # seconds for every racer to import, connect and report ready
WORKER_TIMEOUT = 90.0  # seconds for the race itself, all racers together
START_DELAY = 0.3  # seconds from the start signal to the start instant, for all to see it
OFFSET_SLACK = 5.0  # seconds of error allowed when measuring a racer's offset


def start_racer(
    url: str, barrier: Path, index: int, shim: Path, offset: int, extra: tuple[str, ...]
) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(shim), env.get("LD_PRELOAD")]))
    env["FAKECLOCK_OFFSET"] = str(offset)
    args = [sys.executable, str(WORKER), "--url", url, "--barrier", str(barrier)]
    return subprocess.Popen(
        [*args, "--index", str(index), "--ticks", str(TICKS), *extra],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until_ready(racers: list[subprocess.Popen[str]], barrier: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while not all((barrier / f"ready-{i}").exists() for i in range(len(racers))):
        for racer in racers:
            if racer.poll() is not None:
                _, stderr = racer.communicate(timeout=5)
                pytest.fail(f"a racer exited before the start: {racer.returncode}\n{stderr}")
        if time.monotonic() > deadline:
            pytest.fail(f"racers not ready within {READY_TIMEOUT}s")
        time.sleep(0.01)


def run_race(
    url: str, barrier: Path, shim: Path, extra: tuple[str, ...] = ()
) -> tuple[list[dict[str, Any]], float]:
    """Start the racers, release them together, and return their reports and the race time."""
    racers: list[subprocess.Popen[str]] = []
    try:
        for index, offset in enumerate(OFFSETS):
            racers.append(start_racer(url, barrier, index, shim, offset, extra))
        wait_until_ready(racers, barrier)
        began = time.monotonic() + START_DELAY
        # Written whole then renamed, so no racer reads a half-written start instant.
        (barrier / "go.tmp").write_text(repr(began))
        (barrier / "go.tmp").rename(barrier / "go")
        reports = []
        for racer in racers:
            remaining = max(0.1, began + WORKER_TIMEOUT - time.monotonic())
            stdout, stderr = racer.communicate(timeout=remaining)
            assert racer.returncode == 0, stderr
            assert "Traceback" not in stderr, stderr
            reports.append(json.loads(stdout))
        return reports, time.monotonic() - began
    finally:
        # A failed assertion or a timeout must not leave racers holding connections.
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
            racer.communicate(timeout=10)


def test_every_tick_has_exactly_one_winner_across_skewed_processes(
    dialect: str,
    make_database: Callable[[str], str],
    fakeclock: Path,
    tmp_path: Path,
) -> None:
    url = make_database(dialect)
    migrate.upgrade(url)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    wall_base = time.time() - time.monotonic()

    reports, elapsed = run_race(url, barrier, fakeclock)
    # Printed first, so a failure below shows how the race went.
    retries = [r["retries"] for r in reports]
    spread = [len(r["wins"]) for r in reports]
    print(
        f"\n{dialect}: race {elapsed:.1f}s, wins per racer {spread}, lease_held retries "
        f"{retries} (max {max(r['max_retries_one_tick'] for r in reports)} on one tick), "
        f"store errors {[len(r['errors']) for r in reports]}, "
        f"releases taken over {[len(r['release_failures']) for r in reports]}"
    )

    # The shim really moved the clocks, or this test says nothing about skew.
    measured = [r["wall_start"] - r["monotonic_start"] - wall_base for r in reports]
    for offset, seen in zip(OFFSETS, measured, strict=True):
        assert abs(seen - offset) < OFFSET_SLACK, (offset, seen)
    assert max(measured) - min(measured) >= 15 * 60, measured

    # Nothing went wrong in any racer: no store error, no give-up, no misreported loss.
    for report in reports:
        assert report["errors"] == [], (report["index"], report["errors"][:3])
        assert report["gave_up"] == [], (report["index"], report["gave_up"])
        assert report["bad_losses"] == [], (report["index"], report["bad_losses"][:3])
        if dialect == "sqlite":
            # SQLite's "now" is each racer's own wall clock (see the end of this test): a
            # racer ten minutes ahead sees a fresh lease as expired and takes it over, so
            # the holder's release finds a newer token. A release lost to anything else
            # (a locked database) is a fault.
            for failure in report["release_failures"]:
                assert failure.get("row_token", 0) > failure["token"], failure
        else:
            assert report["release_failures"] == [], (report["index"], report["release_failures"])
        # Each tick ended in a win or an already_run loss for this racer, exactly once.
        assert len(report["wins"]) + report["losses"].get("already_run", 0) == TICKS, report
        assert set(report["losses"]) <= {"already_run", "lease_held"}, report["losses"]
        assert report["losses"].get("lease_held", 0) == report["retries"]
    assert len({r["holder"] for r in reports}) == len(OFFSETS)

    wins = [(win, report) for report in reports for win in report["wins"]]
    winners: dict[int, list[str]] = {}
    for win, report in wins:
        winners.setdefault(win["tick"], []).append(report["holder"])
        assert win["holder"] == report["holder"]
        assert win["seen_tick"] is not None
    assert sorted(winners) == list(range(TICKS)), "some tick was never won"
    doubles = {tick: holders for tick, holders in winners.items() if len(holders) != 1}
    assert doubles == {}, f"ticks won more than once: {doubles}"

    # Claims happen in tick order, so the fencing tokens, sorted by tick, are 1..200.
    by_tick = sorted(wins, key=lambda pair: pair[0]["tick"])
    assert [win["token"] for win, _ in by_tick] == list(range(1, TICKS + 1))
    # In the order each racer saw its own wins, its tokens and ticks only grow.
    for report in reports:
        tokens = [win["token"] for win in report["wins"]]
        assert tokens == sorted(set(tokens)), (report["index"], tokens)
    # Across racers, on the shared monotonic clock: a claim cannot have returned token b
    # before a claim that got an earlier token a was even sent.
    latest_start = float("-inf")
    for win, _ in by_tick:
        assert win["returned"] >= latest_start, win
        latest_start = max(latest_start, win["started"])

    engine = make_engine(url)
    try:
        store = LeaseStore(engine, "race")
        row = store.read("race-sweep")
        assert row is not None
        assert row.fencing_token == TICKS
        assert row.tick == T0 + timedelta(seconds=TICKS - 1)
        # SQLite has no server: its "now" is the wall clock of the process running the
        # statement, so a racer whose clock is ahead releases to a time still ahead of ours.
        # One SQLite file serves one host, and one host has one wall clock, so only this
        # test can skew it; the tick column kept every tick to one winner anyway.
        if dialect != "sqlite":
            # Released after the last claim: the lease is free on the database's clock.
            assert row.expires_at <= store.now()
    finally:
        engine.dispose()


FIRST_CLAIMS = 20  # new leases whose very first claim the racers fight over


def race_without_errors(
    url: str, tmp_path: Path, shim: Path, extra: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Migrate ``url``, race on it with ``extra`` arguments, and check no racer met an error."""
    migrate.upgrade(url)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    reports, _ = run_race(url, barrier, shim, extra)
    errors = [error for report in reports for error in report["errors"]]
    assert errors == [], f"{len(errors)} claims failed, e.g. {errors[0]}"
    return reports


def test_racing_the_first_claim_ever_is_a_lost_race_not_an_error(
    dialect: str,
    make_database: Callable[[str], str],
    fakeclock: Path,
    tmp_path: Path,
) -> None:
    """With no row yet every racer tries the INSERT; a duplicate key must read as "lost".

    The tick race above meets this only once, on its first tick, so it misses it often;
    twenty new leases make the collision all but certain.
    """
    reports = race_without_errors(
        make_database(dialect), tmp_path, fakeclock, ("--first-claims", str(FIRST_CLAIMS))
    )
    outcomes: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        for claim in report["first_claims"]:
            outcomes.setdefault(claim["name"], []).append(claim)
    assert sorted(outcomes) == sorted(f"first-{n}" for n in range(FIRST_CLAIMS))
    for name, claims in outcomes.items():
        assert len(claims) == len(OFFSETS), name
        won = [claim for claim in claims if claim["won"]]
        assert [claim["token"] for claim in won] == [1], (name, claims)
        lost = [claim["reason"] for claim in claims if not claim["won"]]
        assert lost == ["already_run"] * (len(OFFSETS) - 1), (name, claims)


def test_batch_claims_give_each_tick_of_each_lease_one_winner(
    dialect: str,
    make_database: Callable[[str], str],
    fakeclock: Path,
    tmp_path: Path,
) -> None:
    """Every racer opens each tick of the same sweeps in batches through the daemon's
    tick store, then closes its wins (rows finished, leases released).

    On PostgreSQL each batch is one statement that skips rows busy at that
    instant and wins at most a quarter of the leases, and on SQLite one write
    transaction; the racer asks again for what it left undecided. Each racer
    prefers its own order, and the closes lock rows too: a deadlock or a wait
    would show up as an error.
    A racer does not retry a lease it found held, so a tick may go unwon when
    every racer met the previous tick's holder; no tick may be won twice.
    """
    reports = race_without_errors(
        make_database(dialect), tmp_path, fakeclock, ("--batch", str(BATCH_LEASES))
    )
    winners: dict[tuple[str, int], list[int]] = {}
    for report in reports:
        for win in report["wins"]:
            winners.setdefault((win["name"], win["tick"]), []).append(win["token"])
    failures = [failure for report in reports for failure in report["release_failures"]]
    if dialect == "sqlite":
        # SQLite's "now" is each racer's own shifted clock, so a racer far ahead
        # takes fresh leases over (see the tick race above): a release may find
        # a newer token, never one that nobody won.
        for failure in failures:
            newer = [t for (name, _), ts in winners.items() if name == failure["name"] for t in ts]
            assert max(newer) > failure["token"], failure
    else:
        assert failures == []
    doubled = {key: tokens for key, tokens in winners.items() if len(tokens) > 1}
    assert doubled == {}, f"ticks won twice: {sorted(doubled)[:5]}"
    tokens: dict[str, list[int]] = {}
    for (name, _), (token,) in sorted(winners.items(), key=lambda item: item[0][1]):
        tokens.setdefault(name, []).append(token)
    # Whatever was won was won in tick order, one token per claim.
    for name, claimed in tokens.items():
        assert claimed == list(range(1, len(claimed) + 1)), name
