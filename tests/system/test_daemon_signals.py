"""`sweepd run` and its signals, on real processes and every dialect (SPEC §6, §7, §8).

Each test starts real daemon replicas (``daemon_harness``), waits for a sweep
from ``daemon_sweeps`` to be in flight, signals or kills a replica, and judges
the outcome the way an operator would: the exit status and how long it took
(measured from the signal), the ``sweep_runs`` rows, the lease row, the
side-effect lines the sweep wrote, and the daemon's JSON log.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Cluster, Replica, read_rows, read_runs, sweep, write_config

from sweepd.db.engine import make_engine
from sweepd.lease import LeaseStore

pytestmark = pytest.mark.slow

NAME = "s"
# What a cancelled run gets past drain_timeout to return (sweepd.daemon.CANCEL_GRACE_SECONDS,
# repeated here so a change to it is a deliberate change to this contract).
CANCEL_GRACE = 2.0

Event = dict[str, Any]


def is_event(name: str, **fields: Any) -> Callable[[Event], bool]:
    return lambda e: e.get("event") == name and all(e.get(k) == v for k, v in fields.items())


def wait_any(
    replicas: list[Replica], predicate: Callable[[Event], bool], timeout: float = 20.0
) -> tuple[Replica, Event]:
    """The first replica (and its event) whose log has an event matching ``predicate``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for replica in replicas:
            for event in replica.events():
                if predicate(event):
                    return replica, event
        time.sleep(0.02)
    raise AssertionError(f"no replica logged a matching event within {timeout}s")


def holder_of(replica: Replica) -> str:
    started = next(e for e in replica.events() if e.get("event") == "daemon.started")
    return str(started["holder"])


def instant(value: str) -> datetime:
    return datetime.fromisoformat(value)


def instant_row(value: datetime) -> datetime:
    """A row's datetime as an aware UTC one, whatever the driver returned."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def rows_of(url: str, name: str = NAME) -> list[dict[str, Any]]:
    return [row for row in read_rows(url) if row["name"] == name]


def signal_and_wait(replica: Replica, signum: int, timeout: float = 20.0) -> tuple[int, float]:
    """Send ``signum`` and return (exit status, seconds from the signal to the exit)."""
    sent = time.monotonic()
    replica.signal(signum)
    status = replica.wait(timeout)
    elapsed, exited = time.monotonic() - sent, time.time()
    stopped = [e for e in replica.events() if e.get("event") == "daemon.stopped"]
    if stopped:
        # Kept in the -s output: how much of the exit time is the interpreter's own teardown.
        teardown = exited - instant(stopped[0]["timestamp"]).timestamp()
        print(f"MEASURE daemon.stopped -> exit: {teardown:.3f}s")
    return status, elapsed


def assert_released(url: str, name: str, holder: str) -> None:
    """The lease row is still ``holder``'s but already expired on the database's clock."""
    engine = make_engine(url)
    try:
        store = LeaseStore(engine, "system")
        row = store.read(name)
        now = store.now()
    finally:
        engine.dispose()
    assert row is not None
    assert row.holder == holder
    assert row.expires_at <= now, f"lease held until {row.expires_at}, database time {now}"


def one_sweep_config(
    tmp: Path, url: str, out: Path, *, drain_timeout: str, **settings: Any
) -> Path:
    return write_config(
        tmp / "sweepd.yaml", url, [sweep(NAME, out, **settings)], drain_timeout=drain_timeout
    )


def test_sigterm_lets_the_run_finish_and_hands_the_next_tick_over(
    cluster: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    # The next tick (T+4s) comes after the run ends (T+3s), well inside the 30 s
    # ttl: only a released lease lets the other replica have it.
    config = one_sweep_config(
        tmp_path,
        cluster.url,
        out,
        drain_timeout="10s",
        every="4s",
        ttl="30s",
        args={"duration": 3},
    )
    replicas = cluster.start(config, 2)
    a, started = wait_any(replicas, is_event("run.started", sweep=NAME), timeout=15)
    (b,) = (r for r in replicas if r is not a)
    tick = instant(started["tick"])

    status, elapsed = signal_and_wait(a, signal.SIGTERM)
    print(f"MEASURE sigterm drain (3 s run, drain 10s): exit {status} after {elapsed:.3f}s")

    assert status == 0
    assert elapsed < 4.0
    assert_released(cluster.url, NAME, holder_of(a))
    (row,) = rows_of(cluster.url)
    assert (instant_row(row["tick"]), row["holder"], row["status"]) == (
        tick,
        holder_of(a),
        "success",
    )
    assert [r["event"] for r in read_runs(out)] == ["start", "end"]

    events = a.events()
    names = [e["event"] for e in events]
    assert "daemon.draining" in names
    assert "daemon.stopped" in names
    after_signal = events[names.index("daemon.signal") :]
    assert not [e for e in after_signal if e["event"] == "tick.claimed"]

    following = tick + timedelta(seconds=4)
    claimed = b.wait_for(
        lambda e: (
            e.get("event") == "tick.claimed"
            and e.get("sweep") == NAME
            and instant(e["tick"]) > tick
        ),
        timeout=10,
    )
    assert instant(claimed["tick"]) == following


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_drain_timeout_cancels_the_run(cluster: Cluster, tmp_path: Path, kind: str) -> None:
    out = tmp_path / "runs.jsonl"
    target = "daemon_sweeps:record" if kind == "sync" else "daemon_sweeps:record_async"
    config = one_sweep_config(
        tmp_path,
        cluster.url,
        out,
        drain_timeout="1s",
        every="1s",
        callable=target,
        args={"duration": 5},
    )
    (replica,) = cluster.start(config, 1)
    replica.wait_for(is_event("run.started", sweep=NAME), timeout=10)

    status, elapsed = signal_and_wait(replica, signal.SIGTERM)
    print(f"MEASURE sigterm drain_timeout 1s ({kind}): exit {status} after {elapsed:.3f}s")

    assert status == 0
    # It waited out the drain timeout, then cancelled without using all the grace.
    assert 0.9 <= elapsed < 1.0 + CANCEL_GRACE
    (row,) = rows_of(cluster.url)
    assert row["status"] == "cancelled"
    assert row["finished_at"] is not None
    assert_released(cluster.url, NAME, holder_of(replica))
    lines = read_runs(out)
    if kind == "sync":
        assert [r["event"] for r in lines] == ["start", "stopped"]
        assert lines[1]["cancelled"] is True
        assert lines[1]["lease_lost"] is False
    else:
        assert [r["event"] for r in lines] == ["start", "cancelled"]


@pytest.mark.parametrize(
    ("signum", "expected"),
    [
        pytest.param(signal.SIGTERM, 143, id="SIGTERM"),
        pytest.param(signal.SIGINT, 130, id="SIGINT"),
    ],
)
def test_second_signal_exits_at_once(
    cluster: Cluster, tmp_path: Path, signum: int, expected: int
) -> None:
    out = tmp_path / "runs.jsonl"
    config = one_sweep_config(
        tmp_path, cluster.url, out, drain_timeout="10s", every="1s", args={"duration": 10}
    )
    (replica,) = cluster.start(config, 1)
    replica.wait_for(is_event("run.started", sweep=NAME), timeout=10)
    replica.signal(signum)
    replica.wait_for(is_event("daemon.draining"), timeout=5)

    status, elapsed = signal_and_wait(replica, signum, timeout=10)
    print(f"MEASURE second {signal.Signals(signum).name}: exit {status} after {elapsed:.3f}s")

    assert status == expected
    assert elapsed < 1.0
    events = replica.events()
    assert "daemon.stopped" not in [e["event"] for e in events]
    # Written although os._exit skips every flush: the loop's lines wait to be written together.
    assert [e.get("action") for e in events if e["event"] == "daemon.signal"] == [
        "drain",
        "exit now",
    ]
    assert [r["event"] for r in read_runs(out)] == ["start"]


def test_kill_9_the_holder_and_another_replica_takes_over_within_ttl(
    cluster: Cluster, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    ttl = 3.0
    config = one_sweep_config(
        tmp_path,
        cluster.url,
        out,
        drain_timeout="1s",
        every="2s",
        ttl="3s",
        args={"duration": 4},
    )
    replicas = cluster.start(config, 2)
    a, started = wait_any(replicas, is_event("run.started", sweep=NAME), timeout=10)
    (b,) = (r for r in replicas if r is not a)
    tick, token = instant(started["tick"]), started["fencing_token"]
    killed_at = time.time()
    a.kill()

    b_started = b.wait_for(is_event("run.started", sweep=NAME), timeout=15)
    b_line = next(
        r for r in read_runs(out) if r["event"] == "start" and r["holder"] == holder_of(b)
    )
    takeover = b_line["at"] - killed_at
    print(f"MEASURE kill -9 takeover (ttl 3s, every 2s): {takeover:.3f}s")

    assert takeover < ttl + 2.0
    assert instant(b_started["tick"]) > tick
    assert b_started["fencing_token"] == token + 1
    marked = b.wait_for(is_event("run.marked_lost", sweep=NAME), timeout=1)
    assert marked["count"] == 1
    rows = {instant_row(r["tick"]): r for r in rows_of(cluster.url)}
    dead = rows[tick]
    assert (dead["holder"], dead["status"], dead["fencing_token"]) == (
        holder_of(a),
        "lost",
        token,
    )
    assert dead["finished_at"] is not None
    # Nobody ran the ticks in between: the dead holder's lease kept them off.
    assert sorted(rows) == [tick, instant(b_started["tick"])]
    assert rows[instant(b_started["tick"])]["holder"] == holder_of(b)


# stubborn sleeps through the exit; restless is running Python code when it comes.
@pytest.mark.parametrize("code", ["stubborn", "restless"])
def test_stubborn_sync_sweep_does_not_hold_the_exit(
    cluster: Cluster, tmp_path: Path, code: str
) -> None:
    out = tmp_path / "runs.jsonl"
    config = one_sweep_config(
        tmp_path,
        cluster.url,
        out,
        drain_timeout="1s",
        every="1s",
        callable=f"daemon_sweeps:{code}",
        args={"duration": 6},
    )
    (replica,) = cluster.start(config, 1)
    replica.wait_for(is_event("run.started", sweep=NAME), timeout=10)

    status, elapsed = signal_and_wait(replica, signal.SIGTERM)
    print(f"MEASURE sigterm {code} sweep, drain 1s: exit {status} after {elapsed:.3f}s")

    assert status == 0, replica.log_path.read_text(errors="replace")[-3000:]
    # drain_timeout + the cancel grace, plus room for the exit (which skips the
    # interpreter's teardown here) on a loaded 2-core machine.
    assert elapsed < 1.0 + CANCEL_GRACE + 1.5
    (row,) = rows_of(cluster.url)
    assert row["status"] == "cancelled"
    assert_released(cluster.url, NAME, holder_of(replica))
    # The process exit ended the thread: the run never reached its end.
    assert [r["event"] for r in read_runs(out)] == ["start"]
    # That exit is abrupt, but it wrote out every log line first.
    assert replica.events()[-1]["event"] == "daemon.stopped"
