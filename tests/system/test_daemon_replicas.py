"""Several `sweepd run` replicas on one database: each tick once, no overlap (SPEC §4, §5, §6).

Real daemon processes (``daemon_harness``) run real side-effect sweeps (``daemon_sweeps``) on
every dialect. Each test judges what happened three ways that must agree: the lines the sweeps
wrote (what really ran, where, when), the ``sweep_runs`` rows, and the daemons' JSON logs (every
tick claimed by one replica and quietly lost by the others, queued and coalesced ticks counted).
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import (
    Cluster,
    Replica,
    of,
    overlaps,
    read_rows,
    read_runs,
    seconds,
    stamp,
    sweep,
    write_config,
)
from sqlalchemy.engine import make_url

pytestmark = pytest.mark.slow

Event = dict[str, Any]
Key = tuple[str, float]  # (sweep, tick as Unix seconds)

TIMEOUT = 60.0  # seconds; bounds stopping and every wait
QUIET = {"already_run", "lease_held"}  # losing to another replica: the system working
STOP_BOUND = 8.0  # seconds all replicas may take to drain and exit after SIGTERM
SKEW = 30.0  # seconds the skewed replica's wall clock is ahead


# -- helpers ----------------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


def starts_by_key(runs: list[Event], names: set[str]) -> dict[Key, list[Event]]:
    found: dict[Key, list[Event]] = defaultdict(list)
    for run in runs:
        if run["event"] == "start" and run["sweep"] in names:
            found[(run["sweep"], seconds(run["tick"]))].append(run)
    return found


def rows_by_key(rows: list[Event], names: set[str]) -> dict[Key, list[Event]]:
    found: dict[Key, list[Event]] = defaultdict(list)
    for row in rows:
        if row["name"] in names:
            found[(row["name"], seconds(row["tick"]))].append(row)
    return found


def assert_one_to_one(runs: list[Event], rows: list[Event], names: set[str]) -> set[Key]:
    """Every (sweep, tick) started once, has one finished success row, and they agree."""
    starts = starts_by_key(runs, names)
    recorded = rows_by_key(rows, names)
    twice = {key: len(found) for key, found in starts.items() if len(found) != 1}
    assert not twice, f"ticks whose code ran more than once: {twice}"
    twice_rows = {key: len(found) for key, found in recorded.items() if len(found) != 1}
    assert not twice_rows, f"ticks with more than one run row: {twice_rows}"
    assert set(starts) == set(recorded), (
        f"run without a row: {sorted(set(starts) - set(recorded))[:5]}; "
        f"row without a run: {sorted(set(recorded) - set(starts))[:5]}"
    )
    ends = {(r["sweep"], seconds(r["tick"])) for r in runs if r["event"] == "end"}
    assert ends == set(starts), f"runs that never ended: {sorted(set(starts) - ends)[:5]}"
    for key, (start,) in starts.items():
        (row,) = recorded[key]
        assert row["status"] == "success", row
        assert row["finished_at"] is not None, row
        assert (row["holder"], row["fencing_token"], row["attempt"], row["trigger"]) == (
            start["holder"],
            start["token"],
            1,
            "schedule",
        ), (row, start)
    return set(starts)


def assert_exit_cleanly(codes: list[int], took: float, events: list[list[Event]]) -> None:
    assert codes == [0] * len(codes), codes
    assert took < STOP_BOUND, f"replicas took {took:.1f}s to drain and exit"
    for log in events:
        raw = [e["line"] for e in log if e.get("event") == "raw"]
        assert not raw, f"non-JSON output from a replica: {raw[:5]}"
        assert of(log, "daemon.stopped"), log[-5:]


def stopped_stats(events: list[list[Event]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for log in events:
        (stopped,) = of(log, "daemon.stopped")
        total.update(stopped["stats"])
    return total


# -- 1. many replicas, many sweeps: each tick exactly once -------------------------------------


@pytest.mark.parametrize(
    ("count", "top"),
    [
        (10, {}),
        # As many slots as sweeps: once the replicas know of each other, each claims a
        # third of a burst per call and asks again for the rest (sweepd.slots.Peers).
        (48, {"concurrency": 48}),
    ],
    ids=["default-concurrency", "burst-shared"],
)
def test_three_replicas_run_every_tick_exactly_once(
    cluster: Cluster, database_url: str, tmp_path: Path, count: int, top: dict[str, Any]
) -> None:
    out = tmp_path / "runs.jsonl"
    names = {f"s{i}" for i in range(count)}
    config = write_config(
        tmp_path / "sweepd.yaml", database_url, [sweep(n, out) for n in sorted(names)], **top
    )
    cluster.start(config, 3, timeout=TIMEOUT)
    time.sleep(20.0)
    signalled, codes, took = cluster.stop(TIMEOUT)
    events = cluster.events()
    assert_exit_cleanly(codes, took, events)

    runs, rows = read_runs(out), read_rows(database_url)
    ran = assert_one_to_one(runs, rows, names)
    assert overlaps(runs) == []
    assert all(tick == int(tick) for _, tick in ran), "ticks not on whole seconds"

    # The window in which every replica was up and none was told to stop.
    all_started = max(stamp(of(log, "daemon.started")[0]) for log in events)
    first = math.floor(all_started) + 1
    last = math.floor(signalled) - 1
    assert last - first >= 15, (first, last)
    window = [float(t) for t in range(first, last + 1)]
    for name in sorted(names):
        ticks = {tick for sweep_name, tick in ran if sweep_name == name}
        missing = [t for t in window if t not in ticks]
        assert not missing, f"{name}: no replica ran ticks {missing}"

    # Every tick in the window is accounted for on every replica: one claim, two quiet losses.
    outcome: dict[Key, list[str]] = defaultdict(list)
    skips: Counter[str] = Counter()
    for log in events:
        for e in log:
            if e.get("sweep") not in names:
                continue
            if e.get("event") == "tick.skipped":
                skips[e["reason"]] += 1
                assert e["reason"] in QUIET | {"draining"}, e
                if e["reason"] in QUIET:
                    assert e["level"] == "debug", e  # a lost race is not news
                else:
                    assert seconds(e["tick"]) > last, e  # draining only at the end
            if e.get("event") in ("tick.claimed", "tick.skipped"):
                outcome[(e["sweep"], seconds(e["tick"]))].append(e.get("reason", "claimed"))
    for name in sorted(names):
        for tick in window:
            seen = sorted(outcome[(name, tick)])
            assert len(seen) == 3 and seen.count("claimed") == 1, (name, tick, seen)
            assert set(seen) - {"claimed"} <= QUIET, (name, tick, seen)
    assert skips["missed"] == 0, skips

    errors = [e for log in events for e in log if e.get("level") in ("error", "critical")]
    assert not errors, [(e["event"], e.get("sweep"), e.get("error")) for e in errors[:5]]
    claimed = [e for log in events for e in of(log, "tick.claimed") if e["sweep"] in names]
    assert len(claimed) == len(ran)
    stats = stopped_stats(events)
    assert stats["skipped.missed"] == 0, stats

    lateness = [float(e["lateness"]) for e in claimed]
    per_replica = [
        len([e for e in of(log, "tick.claimed") if e["sweep"] in names]) for log in events
    ]
    print(
        f"\n[{make_url(database_url).get_backend_name()}] runs={len(ran)} window={len(window)}s"
        f" per-replica={per_replica} skips={dict(skips)}"
        f" lateness p50={statistics.median(lateness):.4f}s p99={percentile(lateness, 0.99):.4f}s"
        f" max={max(lateness):.4f}s"
    )
    # A claim later than the misfire grace (1 s) would mean the replicas cannot keep up.
    assert percentile(lateness, 0.99) < 1.0, sorted(lateness)[-10:]


# -- 2. a sweep longer than its interval: queued, coalesced, never overlapping ----------------


def check_queue(log: list[Event], name: str, coalesce: str) -> int:
    """Replay one replica's log for one sweep: the tick it runs after a run is the waiting one.

    While a run is in flight at most one tick waits; ``latest`` keeps the newest fired tick,
    ``earliest`` the first. When the flight goes on, its next claim (won or lost) must be for
    exactly that tick. Returns how many claims came from the queue.
    """
    waiting: float | None = None
    newest = -math.inf  # newest tick this replica fired so far
    from_queue = 0
    for e in log:
        if e.get("sweep") != name:
            continue
        kind, reason = e.get("event"), e.get("reason")
        tick = seconds(e["tick"]) if "tick" in e and e["tick"] is not None else None
        if kind == "tick.queued":
            assert waiting is None, ("queued while a tick waits", e)
            assert tick is not None and tick > newest, e
            waiting, newest = tick, tick
        elif kind == "tick.skipped" and reason == "coalesced":
            assert waiting is not None and tick is not None, e
            kept = seconds(e["kept"])
            if coalesce == "latest":
                assert tick == waiting and kept > newest, ("latest kept an older tick", e)
                newest = kept
            else:
                assert kept == waiting and tick > newest, ("earliest kept a newer tick", e)
                newest = tick
            waiting = kept
        elif kind == "tick.claimed" or (kind == "tick.skipped" and reason in QUIET):
            assert tick is not None, e
            if waiting is not None:
                assert tick == waiting, ("ran a tick other than the one waiting", waiting, e)
                if coalesce == "latest":
                    assert tick == newest, ("latest ran an older tick than fired", newest, e)
                waiting = None
                from_queue += 1
            else:
                assert tick > newest or tick == newest, e
                newest = tick
        elif kind == "tick.skipped" and reason == "draining":
            waiting = None
    return from_queue


def test_a_long_sweep_queues_and_coalesces_without_overlap(
    cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    modes = {"slow-latest": "latest", "slow-earliest": "earliest"}
    config = write_config(
        tmp_path / "sweepd.yaml",
        database_url,
        [sweep(n, out, coalesce=mode, args={"duration": 2.5}) for n, mode in modes.items()],
    )
    cluster.start(config, 3, timeout=TIMEOUT)
    time.sleep(12.0)
    _, codes, took = cluster.stop(TIMEOUT)
    events = cluster.events()
    assert_exit_cleanly(codes, took, events)
    names = set(modes)

    runs, rows = read_runs(out), read_rows(database_url)
    ran = assert_one_to_one(runs, rows, names)
    # The side effects, on each process's clock, never overlap, in a replica or across them.
    assert overlaps(runs) == []
    # Nor do the rows, on the database's clock.
    for name in sorted(names):
        spans = sorted((r["started_at"], r["finished_at"]) for r in rows if r["name"] == name)
        assert len(spans) >= 3, (name, spans)
        for (_, finished), (started, _) in itertools.pairwise(spans):
            assert finished <= started, (name, spans)
        for start in (r for r in runs if r["event"] == "start" and r["sweep"] == name):
            end = next(
                r
                for r in runs
                if r["event"] == "end" and (r["sweep"], r["tick"]) == (name, start["tick"])
            )
            assert end["at"] - start["at"] >= 2.5, (start, end)

    # Ticks that fired during a run were queued and coalesced, counted and logged.
    stats = stopped_stats(events)
    all_events = [e for log in events for e in log]
    queued = of(all_events, "tick.queued")
    coalesced = of(all_events, "tick.skipped", reason="coalesced")
    for name in sorted(names):
        assert of(queued, "tick.queued", sweep=name), f"{name}: no tick.queued"
        assert of(coalesced, "tick.skipped", sweep=name), f"{name}: no coalesced skip"
    assert stats["ticks.queued"] == len(queued), (stats, len(queued))
    assert stats["skipped.coalesced"] == len(coalesced), (stats, len(coalesced))
    assert stats["skipped.missed"] == 0, stats

    # Each replica ran from its queue exactly the tick its coalesce mode keeps.
    from_queue = {
        name: sum(check_queue(log, name, mode) for log in events) for name, mode in modes.items()
    }
    assert all(from_queue.values()), from_queue

    # The same seen from the side effects: after a run, the same holder's next run, when it
    # comes at once, is for the newest tick fired by then (latest) or the first (earliest).
    for name, mode in modes.items():
        by_holder: dict[str, list[tuple[Event, Event]]] = defaultdict(list)
        ends = {(r["sweep"], r["tick"]): r for r in runs if r["event"] == "end"}
        for r in runs:
            if r["sweep"] == name and r["event"] == "start":
                by_holder[r["holder"]].append((r, ends[(name, r["tick"])]))
        checked = 0
        for spans_of_holder in by_holder.values():
            spans_of_holder.sort(key=lambda span: float(span[0]["at"]))
            for (prev_start, prev_end), (nxt, _) in itertools.pairwise(spans_of_holder):
                if nxt["at"] - prev_end["at"] > 0.5:
                    continue  # not straight from the queue
                tick = seconds(nxt["tick"])
                if mode == "latest":
                    assert prev_end["at"] - 1.2 < tick <= prev_end["at"] + 0.5, (prev_end, nxt)
                else:
                    window = (prev_start["at"] - 0.5, prev_start["at"] + 1.1)
                    assert window[0] < tick <= window[1], (prev_start, nxt)
                checked += 1
        assert checked, f"{name}: no run went straight from the queue"

    claimed = [e for e in of(all_events, "tick.claimed") if e["sweep"] in names]
    lateness = {
        name: [round(float(e["lateness"]), 2) for e in claimed if e["sweep"] == name]
        for name in sorted(names)
    }
    print(
        f"\n[{make_url(database_url).get_backend_name()}] ran={len(ran)} from_queue={from_queue}"
        f" queued={len(queued)} coalesced={len(coalesced)} lateness={lateness}"
    )


# -- 3. wall clocks 30 s apart ----------------------------------------------------------------


def test_replicas_with_skewed_wall_clocks_run_each_tick_once(
    cluster: Cluster, database_url: str, tmp_path: Path, fakeclock: Path
) -> None:
    """One replica's wall clock is 30 s ahead: it fires each tick 30 s early, real time.

    The plain replica starts first and runs a few ticks, the skewed one joins, then leaves
    first while the plain one keeps going for a few seconds: the order is fixed so that what
    happens at each hand-over is the same every time. Asserted: no tick runs twice, no run
    overlaps another, every run is recorded as it ended, and ticks do run. On the servers the
    lease refuses a tick still in the future by the database's clock, so no tick is skipped
    either; on SQLite the "database clock" is each process's own, and the skew shows.
    """
    out = tmp_path / "runs.jsonl"
    names = {"a", "b", "c"}
    backend = make_url(database_url).get_backend_name()
    # SQLite's clock is the calling process's own, so on a file database the skewed process
    # sees a lease with less than 30 s left as expired; a file SQLite coordinates processes on
    # one host, which share a clock, so there the lease gets a ttl longer than the skew.
    settings: dict[str, Any] = {"ttl": "2m"} if backend == "sqlite" else {}
    config = write_config(
        tmp_path / "sweepd.yaml",
        database_url,
        [sweep(n, out, **settings) for n in sorted(names)],
    )
    skewed_env = {
        "LD_PRELOAD": " ".join(filter(None, [str(fakeclock), os.environ.get("LD_PRELOAD")])),
        "FAKECLOCK_OFFSET": repr(SKEW),
    }
    cluster.start(config, 1, env=[{}], timeout=TIMEOUT)
    plain = cluster.replicas[0]
    real_start = time.time()
    plain.wait_for(
        lambda e: names <= {x["sweep"] for x in plain.events() if x.get("event") == "tick.claimed"}
    )
    time.sleep(1.0)
    skewed = Replica(config, tmp_path / "replica-1.log", skewed_env)
    cluster.replicas.append(skewed)
    skewed.start()
    skewed.wait_for(lambda e: e.get("event") == "daemon.started", timeout=TIMEOUT)
    joined = time.time()
    time.sleep(8.0)
    left = time.time()
    skewed.signal(signal.SIGTERM)
    assert skewed.wait(TIMEOUT) == 0
    time.sleep(3.0)
    _, codes, took = cluster.stop(TIMEOUT)
    events = cluster.events()
    assert codes == [0, 0], codes
    assert took < STOP_BOUND, took

    # Without this the test could pass because the shim did nothing.
    started = [stamp(of(log, "daemon.started")[0]) for log in events]
    assert abs(started[0] - real_start) < 10, started
    assert abs(started[1] - SKEW - joined) < 10, started

    runs, rows = read_runs(out), read_rows(database_url)
    # Side-effect times written by the skewed replica are on its clock: take the offset back.
    offsets = {plain.pid: 0.0, skewed.pid: SKEW}
    for r in runs:
        r["at"] -= offsets[r["pid"]]
    ran = assert_one_to_one(runs, rows, names)
    assert overlaps(runs) == []
    for name in sorted(names):
        assert any(n == name for n, _ in ran), f"{name}: no tick ran at all"
    if backend != "sqlite":
        # The database's clock refuses the fast replica's early claims: it runs nothing,
        # says why at error level, and the plain replica runs every tick, none skipped.
        assert not [r for r in runs if r["pid"] == skewed.pid and r["event"] == "start"]
        assert any(
            e.get("reason") == "clock_skew" and e.get("level") == "error"
            for e in of(events[1], "tick.skipped")
        )
        for name in sorted(names):
            ticks_run = sorted(round(t - real_start) for n, t in ran if n == name)
            assert ticks_run == list(range(ticks_run[0], ticks_run[-1] + 1)), (name, ticks_run)

    report = []
    for i, log in enumerate(events):
        holder = str(of(log, "daemon.started")[0]["holder"])
        effects = [r for r in runs if r["event"] == "start" and r["holder"] == holder]
        skips = Counter(e["reason"] for e in of(log, "tick.skipped") if e["sweep"] in names)
        claimed = [e for e in of(log, "tick.claimed") if e["sweep"] in names]
        # Ticks of sweep a this replica ran: (tick, real time it started), both in seconds
        # after the plain replica started.
        ticks = [
            (round(seconds(r["tick"]) - real_start), round(r["at"] - real_start, 1))
            for r in effects
            if r["sweep"] == "a"
        ]
        lateness = [float(e["lateness"]) for e in claimed]
        loud = Counter(str(e["event"]) for e in log if e.get("level") in ("warning", "error"))
        report.append(
            f"replica {i} (clock {[0.0, SKEW][i]:+.0f}s): runs={len(effects)} skips={dict(skips)}"
            f" loud={dict(loud)} lateness max={max(lateness, default=0.0):.3f}s"
            f"\n    sweep a (tick, started) in s after start: {ticks}"
        )
    per_sweep = {}
    for name in sorted(names):
        ticks_run = sorted(round(t - real_start) for n, t in ran if n == name)
        holes = [(a + 1, b - 1) for a, b in itertools.pairwise(ticks_run) if b - a > 1]
        per_sweep[name] = f"{len(ticks_run)} runs, never run: {holes}"
    after = [
        r for r in runs if r["event"] == "start" and r["pid"] == plain.pid and r["at"] > left + 0.5
    ]
    print(
        f"\n[{backend}] skewed joined at +{joined - real_start:.1f}s, left at"
        f" +{left - real_start:.1f}s; plain runs after it left: {len(after)};"
        f" per sweep: {per_sweep}\n  " + "\n  ".join(report)
    )
