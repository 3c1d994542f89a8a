"""The database goes away for 10 s under two `sweepd run` replicas, then comes back (SPEC §1, §6).

The shared servers cannot be stopped, so the outage is a TCP proxy between the replicas and the
server: stopping it closes every proxied connection and refuses new ones, as a stopped server
does. One sweep is in flight when the database goes: its renewals fail, the runner tells it the
lease is lost and the replica claims nothing until the database answers again.

What must hold: no replica dies, both say loudly that something is wrong, runs resume once the
database is back (on every replica), no tick runs twice, no sweep overlaps itself, and every
``sweep_runs`` row says how its run ended. SQLite is left out: a file has no server to stop.
"""

from __future__ import annotations

import math
import signal
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import MakeDatabase
from daemon_harness import (
    Cluster,
    Event,
    assert_each_tick_once_and_every_run_recorded,
    of,
    overlaps,
    read_rows,
    read_runs,
    seconds,
    sleep_until,
    stamp,
    stop_all,
    sweep,
    wait_for_backends_gone,
    write_config,
)
from sqlalchemy.engine import make_url
from tcp_proxy import port_below_ephemeral, proxy_for

from sweepd.db import migrate

pytestmark = pytest.mark.slow


# SQLite is not here: the outage is played by a proxy in front of a server, and a file has none.
SERVER_DIALECTS = ["postgresql", "mariadb"]
FAST = ("fast-a", "fast-b", "fast-c")
LONG = "long"
LONG_SECONDS = 6.0  # the long sweep's run, every 10 s with a 3 s ttl: renewals every second
BEFORE = 1.5  # seconds into the long run when the database goes: one renewal has got through
OUTAGE = 10.0
AFTER = 8.0  # seconds the replicas run once the database is back, before SIGTERM
# Seconds after the database returns by which every replica must claim again: time for the
# replica's once-a-second probe to get through, a new pooled connection and the next tick.
RECOVERY = 4.0
TIMEOUT = 30.0  # bounds every wait on a process
STOP_BOUND = 8.0  # seconds both replicas may take to drain and exit after SIGTERM
LOUD = {"lease.error", "lease.lost", "store.unavailable"}
TERMINAL = {"success", "failed", "timeout", "cancelled", "lost"}


# -- the rig --------------------------------------------------------------------------------


class Rig(Cluster):
    """A fresh database behind a proxy, and the replicas using it; none outlives the test."""

    def __init__(self, url: str, tmp: Path) -> None:
        super().__init__(url, tmp)
        # Below the ephemeral range: no outgoing connection takes the port while it is stopped.
        self.proxy, self.proxied = proxy_for(url, port_below_ephemeral())

    def close(self) -> None:
        for replica in self.replicas:
            replica.kill()
        self.proxy.stop()
        if make_url(self.url).get_backend_name() == "postgresql":
            wait_for_backends_gone(self.url)


@pytest.fixture(params=SERVER_DIALECTS)
def rig(
    request: pytest.FixtureRequest, make_database: MakeDatabase, tmp_path: Path
) -> Iterator[Rig]:
    # Asking for make_database orders this teardown before its own, which asserts that no
    # PostgreSQL connection is left open.
    url = make_database(str(request.param))
    # The schema is made on the server itself: the replicas find it current.
    migrate.upgrade(url)
    found = Rig(url, tmp_path)
    try:
        yield found
    finally:
        found.close()


# -- reading what happened ------------------------------------------------------------------


def between(events: list[Event], begin: float, end: float) -> list[Event]:
    return [e for e in events if "timestamp" in e and begin <= stamp(e) <= end]


def iso_z(instant: float) -> str:
    return datetime.fromtimestamp(instant, UTC).isoformat().replace("+00:00", "Z")


# -- the report ------------------------------------------------------------------------------


def describe(
    i: int, log: list[Event], holder: str, runs: list[Event], down_at: float, up_at: float
) -> str:
    """What one replica said while the database was gone, and how it did once it was back."""
    said = Counter(
        f"{e['event']}/{e['level']}" + (f"({e['reason']})" if "reason" in e else "")
        for e in between(log, down_at, up_at)
        if e.get("level") != "debug"
    )
    claims = [stamp(e) - up_at for e in of(log, "tick.claimed") if stamp(e) > up_at]
    started = sorted(
        r["at"] - up_at
        for r in runs
        if r["event"] == "start" and r["holder"] == holder and r["at"] > up_at
    )
    refused = [
        stamp(e) - up_at
        for e in of(log, "tick.skipped", reason="store_unavailable")
        if stamp(e) > up_at
    ]
    after = (
        f"first claim +{claims[0]:.2f}s, first run +{started[0]:.2f}s, {len(started)} runs"
        if claims and started
        else "no claim, no run"
    )
    if refused:
        after += f"; skipped store_unavailable {len(refused)}x, the last at +{refused[-1]:.1f}s"
    return f"  replica {i} {holder}:\n    during the outage: {dict(sorted(said.items()))}\n    after: {after}"


# -- the test --------------------------------------------------------------------------------


def test_a_ten_second_outage_under_two_replicas(rig: Rig, tmp_path: Path) -> None:
    out = tmp_path / "runs.jsonl"
    backend = make_url(rig.url).get_backend_name()
    # The long sweep's first tick a few seconds from now, once both replicas are up: its
    # run is then in flight when the database goes.
    anchor = math.ceil(time.time()) + 4
    config = write_config(
        tmp_path / "sweepd.yaml",
        rig.proxied,
        [
            *(sweep(name, out) for name in FAST),
            sweep(
                LONG,
                out,
                every="10s",
                ttl="3s",
                anchor=iso_z(anchor),
                args={"duration": LONG_SECONDS},
            ),
        ],
        # Room for every sweep at once: a fast tick never waits behind the long run.
        concurrency=8,
    )
    rig.start(config, 2)

    deadline = time.monotonic() + 20
    started: Event | None = None
    while started is None:
        for replica in rig.replicas:
            started = started or next(iter(of(replica.events(), "run.started", sweep=LONG)), None)
        assert time.monotonic() < deadline, "the long sweep never started"
        time.sleep(0.05)

    sleep_until(stamp(started) + BEFORE)
    down_at = time.time()
    rig.proxy.stop()
    sleep_until(down_at + OUTAGE)
    rig.proxy.start()
    up_at = time.time()
    sleep_until(up_at + AFTER)

    alive = [r.process is not None and r.process.poll() is None for r in rig.replicas]
    assert alive == [True, True], f"a replica died: {alive}"
    began = time.monotonic()
    codes = stop_all(rig.replicas, signal.SIGTERM, timeout=TIMEOUT)
    took = time.monotonic() - began
    events = [replica.events() for replica in rig.replicas]
    holders = [str(of(log, "daemon.started")[0]["holder"]) for log in events]
    runs, rows = read_runs(out), read_rows(rig.url)
    left_running = [r for r in rows if r["status"] not in TERMINAL]
    resumed = sorted(r["at"] - up_at for r in runs if r["event"] == "start" and r["at"] > up_at)
    report = [
        f"[{backend}] database gone {OUTAGE:.0f}s from {iso_z(down_at)};"
        f" the long run held by {started['holder']}",
        *(describe(i, log, holders[i], runs, down_at, up_at) for i, log in enumerate(events)),
        "  first run after the database came back: "
        + (f"+{resumed[0]:.2f}s" if resumed else "none"),
        f"  rows not terminal: {[(r['name'], r['status'], str(r['tick'])) for r in left_running]}",
    ]
    print("\n" + "\n".join(report))

    # -- no crash ---------------------------------------------------------------------------
    assert codes == [0, 0], codes
    assert took < STOP_BOUND, f"replicas took {took:.1f}s to drain and exit"
    for log in events:
        raw = [e["line"] for e in log if e.get("event") == "raw"]
        assert not raw, f"non-JSON output (a traceback?) from a replica: {raw[:5]}"
        assert not of(log, "daemon.flight_crashed"), of(log, "daemon.flight_crashed")
        assert of(log, "daemon.stopped"), log[-5:]

    # -- loud while the database is gone -----------------------------------------------------
    for i, log in enumerate(events):
        loud = [e for e in between(log, down_at, up_at) if e.get("event") in LOUD]
        assert any(e["level"] == "error" for e in loud), f"replica {i} was quiet: {loud[:3]}"
    # The run in flight was told at its second missed renewal, and did not run to its end.
    long_log = events[holders.index(str(started["holder"]))]
    lost = of(between(long_log, down_at, up_at), "lease.lost", sweep=LONG)
    assert [(e["level"], e["reason"]) for e in lost] == [("error", "unreachable")], lost
    told = [r for r in runs if r["sweep"] == LONG and r["event"] == "stopped"]
    assert len(told) == 1 and told[0]["lease_lost"], told
    assert down_at < told[0]["at"] < down_at + 4.0, (down_at, told)
    # That run did not reach its end. (A later tick's run may: one that fires before the
    # SIGTERM is drained to its end, if the machine started the first run late.)
    assert not [
        r
        for r in runs
        if r["sweep"] == LONG and r["event"] == "end" and r["tick"] == told[0]["tick"]
    ]

    # -- runs resume -------------------------------------------------------------------------
    for name in FAST:
        ticks = [
            r
            for r in runs
            if r["sweep"] == name and r["event"] == "start" and seconds(r["tick"]) > up_at
        ]
        assert ticks, f"{name}: no run for a tick after the database came back"
    # And on every replica: each reaches the database again (it claims, or loses races
    # quietly); none goes on refusing to claim once a probe could have got through.
    settled = up_at + RECOVERY
    for i, log in enumerate(events):
        fast = [
            e
            for e in log
            if e.get("sweep") in FAST and e.get("tick") and seconds(e["tick"]) > settled
        ]
        reached = [
            e
            for e in fast
            if e["event"] == "tick.claimed"
            or (e["event"] == "tick.skipped" and e["reason"] in ("lease_held", "already_run"))
        ]
        refused = of(fast, "tick.skipped", reason="store_unavailable")
        assert reached and not refused, (
            f"replica {i} still refuses to claim {RECOVERY:.0f}s after the database came back:"
            f" {len(refused)} store_unavailable skips, the last {refused[-1:]}"
        )

    # -- each tick at most once, never overlapping, every run with a row that says how it ended
    assert overlaps(runs) == []
    assert_each_tick_once_and_every_run_recorded(runs, rows)
