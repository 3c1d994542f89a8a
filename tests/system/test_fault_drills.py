"""Fault drills on real `sweepd run` replicas: what breaks under them, and what must still hold.

Each drill puts a fault under running replicas and then asserts the two promises every fault
must keep: no tick runs twice, and every run that started has a row in ``sweep_runs`` that says
how it ended. Beyond those, each asserts that the fault was loud and that the replicas recover.

1. **A stalled network.** One replica's connections are held by a TCP proxy for twice the ttl,
   every byte kept and delivered late, while it runs a sweep whose last write goes over that
   network too. The run is told ``lease_lost``, another replica takes the sweep over under the
   next fencing token, and the stale write, arriving once the network heals, is refused.
2. **A full disk under SQLite.** The database file lives on a small tmpfs that the drill fills.
   Writes fail loudly, the daemons stay up, and once space returns ticks run again and the row
   of a run that was in flight during the fill says how it ended.
3. **A thousand sweeps**, loaded, reloaded with half of them replaced, and drained.
4. **Sweeps that misbehave in their own thread**: one leaks a thread that never ends with each
   run, one never returns from a sync call past its timeout. The hung run keeps its lease (no
   replica runs the sweep beside it), its row says ``timeout``, and neither keeps the replicas
   from draining and exiting.

The database restart drill is tests/system/test_database_restart.py; the SIGKILL and SIGSTOP
drills are tests/system/test_daemon_takeover.py.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import IN_CI, MakeDatabase
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
    wait_until,
    write_config,
)
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from tcp_proxy import port_below_ephemeral, proxy_for

from sweepd.db import migrate

pytestmark = pytest.mark.slow


TTL = 3.0  # the default lease ttl, which these drills do not set
TIMEOUT = 60.0  # bounds every wait on a process
ENDS = ("end", "stopped", "cancelled", "fail")


# -- what every drill asserts -------------------------------------------------------------------


def assert_no_traceback(logs: list[list[Event]]) -> None:
    for i, log in enumerate(logs):
        raw = [e["line"] for e in log if e.get("event") == "raw"]
        assert not raw, f"replica {i} wrote lines that are not JSON (a traceback?): {raw[:5]}"
        assert of(log, "daemon.stopped"), f"replica {i} did not drain: {log[-5:]}"


def holder_in(log: list[Event]) -> str:
    return str(of(log, "daemon.started")[0]["holder"])


def loud(events: list[Event], begin: float, end: float) -> list[Event]:
    return [
        e
        for e in events
        if e.get("level") in ("error", "critical") and begin <= stamp(e) <= end + 1.0
    ]


# -- 1. a stalled network: told, overtaken, fenced off -------------------------------------------

FENCE_NAME = "fenced"
STALL = 2 * TTL
# Seconds after the network heals by which the cut-off replica must reach the database again:
# its held statements land, the next probe (a second) gets through, the next tick is claimed.
RECOVERY = 4.0


@pytest.mark.parametrize("server", ["postgresql", "mariadb"])
def test_a_replica_cut_off_for_two_ttls_is_told_overtaken_and_its_stale_write_refused(
    server: str, make_database: MakeDatabase, tmp_path: Path
) -> None:
    url = make_database(server)
    migrate.upgrade(url)
    fence = create_engine(url)
    with fence.begin() as connection:
        connection.execute(text("CREATE TABLE fence (name VARCHAR(64) PRIMARY KEY, token BIGINT)"))
        connection.execute(text("INSERT INTO fence VALUES (:name, 0)"), {"name": FENCE_NAME})
    fence.dispose()
    proxy, proxied = proxy_for(url, port_below_ephemeral())
    out = tmp_path / "runs.jsonl"

    def config(name: str, database: str) -> Path:
        entry = sweep(FENCE_NAME, out, callable="daemon_sweeps:fenced_sql", args={"url": database})
        return write_config(tmp_path / f"{name}.yaml", database, [entry])

    cluster = Cluster(url, tmp_path)
    try:
        (cut,) = cluster.start(config("cut", proxied))
        # The cut-off replica runs the sweep first. A run is as long as the interval, so its
        # holder claims each next tick as it releases the last, and keeps the sweep.
        wait_until(lambda: read_runs(out) or None, 20, "a run of the cut-off replica")
        cluster.start(config("direct", url))
        # A run of the cut-off replica that has just begun: its claim is through, its first
        # renewal (a second after the claim) and its write (a second into the run) are not.
        first = wait_until(
            lambda: next(
                (
                    r
                    for r in read_runs(out)
                    if r["event"] == "start" and r["pid"] == cut.pid and time.time() - r["at"] < 0.3
                ),
                None,
            ),
            30,
            "a run of the cut-off replica once the other is up",
        )
        proxy.stall()
        stalled = time.time()
        sleep_until(stalled + STALL)
        proxy.resume()
        healed = time.time()
        old = int(first["token"])
        wait_until(
            lambda: (
                [r for r in read_runs(out) if r["event"] == "end" and r["token"] == old] or None
            ),
            10,
            "the stale run's write",
        )
        sleep_until(healed + RECOVERY + 2.0)
        _, codes, _ = cluster.stop(TIMEOUT)
    finally:
        cluster.close()
        proxy.stop()
    runs, rows, logs = read_runs(out), read_rows(url), cluster.events()
    cut_log, direct_log = logs
    cut_holder, direct_holder = holder_in(cut_log), holder_in(direct_log)
    (stale,) = [r for r in runs if r["event"] == "end" and r["token"] == old]
    newer = [
        r for r in runs if r["event"] == "end" and r["holder"] == direct_holder and r["token"] > old
    ]
    told = of(cut_log, "lease.lost", sweep=FENCE_NAME, fencing_token=old)
    print(
        f"\n[{server}] stalled {healed - stalled:.2f}s, {stalled - first['at']:.2f}s into the run;"
        f" told {[(e['reason'], round(stamp(e) - stalled, 2)) for e in told]};"
        f" newer writes {[(r['token'], r['accepted'], round(r['at'] - stalled, 2)) for r in newer]};"
        f" the stale write +{stale['at'] - stalled:.2f}s accepted={stale['accepted']}"
    )

    assert codes == [0, 0], codes
    assert_no_traceback(logs)
    # Told while cut off, by the replica's own clock: renewals unanswered for 2/3 of the ttl.
    assert [(e["reason"], e["level"]) for e in told][:1] == [("unreachable", "error")], told
    assert stalled < stamp(told[0]) < stalled + TTL, (stalled, told)
    # Overtaken while cut off: the other replica claimed the sweep under the next token, and
    # its write went through before the stale one arrived.
    takeover = [r for r in runs if r["event"] == "start" and r["token"] == old + 1]
    assert [(r["holder"], r["at"] < healed) for r in takeover] == [(direct_holder, True)], takeover
    assert newer and newer[0]["accepted"] and newer[0]["at"] < stale["at"], newer
    # The stale write arrived when the network healed, and the token refused it.
    assert stale["holder"] == cut_holder and stale["at"] > healed - 0.1, stale
    assert stale["accepted"] is False, stale
    (row,) = [r for r in rows if r["name"] == FENCE_NAME and r["fencing_token"] == old]
    assert row["status"] == "lost", row
    # Back once the network healed: the cut-off replica reaches the database again (it claims,
    # or loses a race quietly) and refuses no tick for want of it.
    later = [e for e in cut_log if e.get("tick") and seconds(e["tick"]) > healed + RECOVERY]
    assert of(later, "tick.claimed") or of(later, "tick.skipped", reason="lease_held"), later[-5:]
    assert not of(later, "tick.skipped", reason="store_unavailable"), later[-5:]
    # The one overlap of two runs is the stale one with those that overtook it.
    for a, b in overlaps(runs):
        assert old in (a["token"], b["token"]), (a, b)
    assert_each_tick_once_and_every_run_recorded(runs, rows)
    assert not loud(direct_log, 0, math.inf), loud(direct_log, 0, math.inf)
    if make_url(url).get_backend_name() == "postgresql":
        wait_for_backends_gone(url)


# -- 2. a full disk under SQLite ----------------------------------------------------------------

DISK = "16m"  # room for the database and its WAL until the drill fills the rest
FULL = 5.0  # seconds the disk stays full


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of its own, unmounted after the test."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        message = "a tmpfs of the test's own needs root and mount"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> Path:
    """Take every free byte of ``folder``'s filesystem; the file that holds them."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as file:
        for size in (65536, 512):  # then the last bytes, fewer than a chunk
            try:
                while True:
                    file.write(b"\0" * size)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
    assert os.statvfs(folder).f_bavail == 0
    return filler


def test_a_full_disk_under_sqlite_is_loud_and_the_replicas_recover_when_space_returns(
    small_disk: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{small_disk / 'sweepd.db'}"
    migrate.upgrade(url)
    out = tmp_path / "runs.jsonl"
    sweeps = [
        sweep("quick", out),
        # Runs from each tick to 1.5 s past it: in flight when the disk fills, and it ends
        # while the disk is full, so its row can only be written once space returns.
        sweep("slow", out, every="3s", args={"duration": 1.5}),
    ]
    config = write_config(tmp_path / "sweepd.yaml", url, sweeps)
    cluster = Cluster(url, tmp_path)
    try:
        cluster.start(config, 2)
        time.sleep(3.0)
        # Half a second into a tick that is a multiple of 3: slow's run is in flight.
        sleep_until(math.floor(time.time() / 3) * 3 + 3.5)
        filler = fill(small_disk)
        full = time.time()
        sleep_until(full + FULL)
        filler.unlink()
        freed = time.time()
        sleep_until(freed + RECOVERY + 3.0)
        stopped_at, codes, _ = cluster.stop(TIMEOUT)
    finally:
        cluster.close()
    runs, rows, logs = read_runs(out), read_rows(url), cluster.events()
    said = Counter(e["event"] for log in logs for e in loud(log, full, freed))
    in_flight = [
        r
        for r in runs
        if r["sweep"] == "slow" and r["event"] == "start" and r["at"] < full < r["at"] + 1.5
    ]
    print(
        f"\n[sqlite] disk full {freed - full:.1f}s: errors {dict(said)}; in flight: {len(in_flight)}"
    )

    assert codes == [0, 0], codes
    assert_no_traceback(logs)
    # Loud while the disk was full, on every replica.
    for i, log in enumerate(logs):
        assert loud(log, full, freed), f"replica {i} said nothing while the disk was full"
    # The run in flight when the disk filled ended while it was full; its row says how.
    assert len(in_flight) == 1, in_flight
    (row,) = [
        r for r in rows if r["name"] == "slow" and r["fencing_token"] == in_flight[0]["token"]
    ]
    assert row["status"] == "success", row
    # Recovered: every quick tick due from RECOVERY after space returned until the stop ran.
    ran = {seconds(r["tick"]) for r in runs if r["sweep"] == "quick" and r["event"] == "start"}
    due = range(math.ceil(freed + RECOVERY), math.floor(stopped_at))
    missed = [t for t in due if t not in ran]
    assert not missed, f"ticks due after space returned that never ran: {missed}"
    assert_each_tick_once_and_every_run_recorded(runs, rows)


# -- 3. a thousand sweeps: loaded, reloaded, drained ---------------------------------------------

MANY = 1000
EVERY = 6  # seconds: a burst of a thousand runs drains well inside it on two cores
DRAIN_BOUND = 10.0  # seconds both replicas may take to drain and exit


def many(prefix: str, out: Path, count: int) -> list[dict[str, Any]]:
    return [sweep(f"{prefix}-{i:04d}", out, every=f"{EVERY}s") for i in range(count)]


def write_many(path: Path, url: str, sweeps: list[dict[str, Any]]) -> Path:
    # A burst of a thousand takes a second or so to claim: room for that before a tick is
    # recorded missed.
    config = write_config(path, url, sweeps)
    document = yaml.safe_load(config.read_text())
    document["defaults"]["misfire_grace"] = f"{EVERY}s"
    config.write_text(yaml.safe_dump(document, sort_keys=False))
    return config


def ticks_between(begin: float, end: float) -> list[float]:
    return [float(t) for t in range(math.ceil(begin / EVERY) * EVERY, math.floor(end), EVERY)]


def test_a_thousand_sweeps_are_loaded_reloaded_and_drained(
    cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    kept, removed, added = (
        many("kept", out, MANY // 2),
        many("gone", out, MANY // 2),
        many("new", out, MANY // 2),
    )
    config = write_many(tmp_path / "sweepd.yaml", database_url, kept + removed)
    replicas = cluster.start(config, 2, timeout=TIMEOUT)
    started = time.time()
    # Two bursts with the first config, then the reload half a tick before the third.
    sleep_until((math.ceil(started / EVERY) + 2) * EVERY + EVERY / 2)
    write_many(config, database_url, kept + added)
    reloaded = time.time()
    for replica in replicas:
        replica.signal(signal.SIGHUP)
    for replica in replicas:
        replica.wait_for(lambda e: e.get("event") == "config.reloaded", timeout=TIMEOUT)
    sleep_until((math.ceil(reloaded / EVERY) + 2) * EVERY + EVERY / 2)
    stopped_at, codes, took = cluster.stop(TIMEOUT)
    runs, rows, logs = read_runs(out), read_rows(database_url), cluster.events()
    backend = make_url(database_url).get_backend_name()
    ran = Counter((r["sweep"], seconds(r["tick"])) for r in runs if r["event"] == "start")
    print(f"\n[{backend}] {len(ran)} runs, drained in {took:.2f}s")

    assert codes == [0, 0], codes
    assert took < DRAIN_BOUND, f"drained in {took:.1f}s"
    assert_no_traceback(logs)
    for log in logs:
        (event,) = of(log, "config.reloaded")
        assert (len(event["added"]), len(event["removed"])) == (MANY // 2, MANY // 2), event
    # Every tick of every sweep between the first full burst and the reload ran...
    before = ticks_between(started + 1.0, reloaded)
    assert len(before) >= 2, before
    names = [s["name"] for s in kept + removed]
    missing = [(n, t) for t in before for n in names if (n, t) not in ran]
    assert not missing, f"{len(missing)} ticks before the reload never ran: {missing[:5]}"
    # ...and after it, those of the new config, and none of a removed sweep.
    after = ticks_between(reloaded + 1.0, stopped_at)
    assert len(after) >= 2, after
    names = [s["name"] for s in kept + added]
    missing = [(n, t) for t in after for n in names if (n, t) not in ran]
    assert not missing, f"{len(missing)} ticks after the reload never ran: {missing[:5]}"
    late = [(n, t) for (n, t) in ran if n.startswith("gone-") and t > reloaded + 1.0]
    assert not late, f"removed sweeps ran after the reload: {late[:5]}"
    assert_each_tick_once_and_every_run_recorded(runs, rows)


# -- 4. sweeps that misbehave in their own thread -----------------------------------------------

HUNG_TIMEOUT = "1s"
WATCHED = 6.0  # seconds the replicas run with the hung call: two ttls
DRAIN_TIMEOUT = 3.0  # seconds; the config's drain_timeout
# The drain deadline, its 2 s grace for a sync run to return, and a margin for the exit.
EXIT_BOUND = DRAIN_TIMEOUT + 2.0 + 3.0


def test_a_hung_sync_call_and_a_leaked_thread_neither_overlap_nor_hold_the_exit(
    cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    sweeps = [
        sweep("leaky", out, callable="daemon_sweeps:leaky"),
        sweep("hung", out, callable="daemon_sweeps:hung", timeout=HUNG_TIMEOUT),
    ]
    config = write_config(tmp_path / "sweepd.yaml", database_url, sweeps, drain_timeout="3s")
    replicas = cluster.start(config, 2, timeout=TIMEOUT)
    first = wait_until(
        lambda: next((r for r in read_runs(out) if r["sweep"] == "hung"), None), 20, "a hung run"
    )
    sleep_until(first["at"] + WATCHED)
    rows_while = read_rows(database_url)
    signalled = time.monotonic()
    codes = stop_all(replicas, timeout=TIMEOUT)
    took = time.monotonic() - signalled
    runs, rows, logs = read_runs(out), read_rows(database_url), cluster.events()
    backend = make_url(database_url).get_backend_name()
    print(f"\n[{backend}] both exited {took:.2f}s after SIGTERM, codes {codes}")

    assert codes == [0, 0], codes
    assert took < EXIT_BOUND, f"the replicas took {took:.1f}s to exit after SIGTERM"
    assert_no_traceback(logs)
    # The hung call kept its lease by heartbeat for two ttls: no replica ran the sweep beside
    # it, and its row said `timeout` a timeout after the claim.
    hung = [r for r in runs if r["sweep"] == "hung" and r["event"] == "start"]
    assert len(hung) == 1, hung
    (row,) = [r for r in rows_while if r["name"] == "hung"]
    assert row["status"] == "timeout", row
    assert (row["finished_at"] - row["started_at"]).total_seconds() < 2.5, row
    holder = hung[0]["holder"]
    (told,) = [log for log in logs if of(log, "run.timed_out", sweep="hung")]
    assert [e["level"] for e in of(told, "run.timed_out", sweep="hung")] == ["warning"]
    assert of(told, "tick.skipped", sweep="hung", reason="coalesced"), "no tick was coalesced"
    others = [log for log in logs if holder_in(log) != holder]
    for log in others:
        assert not of(log, "tick.claimed", sweep="hung"), "another replica claimed the hung sweep"
    # The leaky sweep ran on, a tick at a time, whatever its threads did.
    leaky = [r for r in runs if r["sweep"] == "leaky" and r["event"] == "end"]
    assert len(leaky) >= WATCHED - 2, leaky
    # The threads it left are named at the exit, which they did not hold.
    for log in logs:
        if any(r["sweep"] == "leaky" and r["holder"] == holder_in(log) for r in leaky):
            (left,) = of(log, "daemon.threads_left")
            assert left["level"] == "warning" and left["threads"], left
    assert_each_tick_once_and_every_run_recorded(runs, rows)
