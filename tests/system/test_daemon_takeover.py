"""A replica that dies or freezes mid-run, under the default 3 s lease (SPEC §4, §5, §6).

Since a replica renews every lease it holds in one statement a second, the default ``ttl`` is
3 s, and a renewal finds a lease only while it has not expired. Two things follow, and both are
tested here on real daemon processes (``daemon_harness``) on every dialect, with the default
ttl and concurrency:

1. **SIGKILL.** A replica killed while it runs sweeps blocks them for about one ttl, not 30 s:
   every sweep, those it had in flight included, starts a run again on a survivor within
   ``RERUN_BOUND`` of the kill; no tick runs twice; the rows it left ``running`` end ``lost``,
   marked by the survivor that next won each sweep. The kill→rerun delays are printed (``-s``):
   they are the figure the 3 s default was chosen for.
2. **SIGSTOP past the ttl.** Another replica claims the paused one's sweep under a higher
   fencing token, marks the paused run's row ``lost`` and runs the next tick. On SIGCONT the
   paused replica logs ``lease.lost`` (reason ``taken``) at its first renewal, and the write its
   run makes after resuming, under the old token, is refused by a fenced resource
   (``daemon_sweeps.fenced``) that accepted the newer holder's. Its row stays ``lost``, its
   release changes nothing, and the one overlap of two runs is the one the token made harmless.
3. **SIGSTOP past the ttl, and the code returns as it resumes.** A sweep timed by the clock
   (``daemon_sweeps.record_async``) whose deadline passed while its replica was stopped
   returns at once on SIGCONT, before the overdue renewal can say the lease was taken. The
   release is where the replica learns it: it logs ``lease.lost`` (reason ``taken``, found at
   the release) and ``run.finished`` with status ``lost``, never ``success``, as its row says.
"""

from __future__ import annotations

import signal
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from daemon_harness import (
    Cluster,
    Replica,
    of,
    overlaps,
    read_rows,
    read_runs,
    row_time,
    seconds,
    sleep_until,
    stamp,
    stop_all,
    sweep,
    wait_until,
    write_config,
)
from sqlalchemy.engine import make_url

from sweepd.db.engine import make_engine
from sweepd.history import LOST_ERROR
from sweepd.lease import LeaseRow, LeaseStore

pytestmark = pytest.mark.slow

Event = dict[str, Any]
T = TypeVar("T")

TIMEOUT = 60.0  # seconds; bounds starting and stopping the replicas
TTL = 3.0  # the default lease ttl (sweepd.config), which these tests must not set
SWEEPS = 16
RUN_SECONDS = 0.5
WARM_SECONDS = 4.0  # how long the three replicas run before one is killed
RERUN_BOUND = 5.0  # seconds from the kill by which every sweep must have started again
KEPT_UP = 4.0  # seconds the survivors go on after RERUN_BOUND, to see whether they keep up
NAME = "fenced"
FENCED_RUN = 3.0  # seconds of work in each run of the fenced sweep
PAUSE = 6.0  # at least this long stopped: twice the ttl
ENDS = ("end", "stopped", "cancelled", "fail")
RETURNING = "returning"
# Seconds of each run: shorter than the first renewal beat, a second after the claim, so on
# SIGCONT the loop wakes the run (its sleep's timer is due first) before it sends the renewal.
RETURNING_RUN = 0.8
# What run.finished says of a lost run (sweepd.runner.LOST_MESSAGE), spelled out: operators
# search for it, and the code before the fix must be able to import this file.
LOST_MESSAGE = "the lease was lost while the run was in flight"
STOP_AFTER = 0.4  # seconds into a run: past its claim, before its end and its first renewal


# -- helpers ----------------------------------------------------------------------------------


def holder_of(replica: Replica) -> str:
    return str(of(replica.events(), "daemon.started")[0]["holder"])


def in_flight(runs: list[Event], pid: int) -> dict[str, Event]:
    """The runs process ``pid`` started and had not ended: sweep -> its start line."""
    ended = {(r["sweep"], r["tick"]) for r in runs if r["pid"] == pid and r["event"] in ENDS}
    return {
        r["sweep"]: r
        for r in runs
        if r["pid"] == pid and r["event"] == "start" and (r["sweep"], r["tick"]) not in ended
    }


def claimed_unfinished(log: list[Event]) -> set[str]:
    """Sweeps whose tick a replica's log says it claimed, without a ``run.finished``."""
    finished = {(e["sweep"], e["tick"]) for e in of(log, "run.finished")}
    return {e["sweep"] for e in of(log, "tick.claimed") if (e["sweep"], e["tick"]) not in finished}


def busiest(replicas: list[Replica], runs: list[Event], least: int) -> Replica | None:
    """The replica with the most runs in flight now, if it has at least ``least``."""
    count, replica = max(((len(in_flight(runs, r.pid)), r) for r in replicas), key=lambda x: x[0])
    return replica if count >= least else None


def first_starts(runs: list[Event], pids: set[int], after: float) -> dict[str, Event]:
    """Per sweep, the first run that one of ``pids`` started after ``after`` (Unix seconds)."""
    found: dict[str, Event] = {}
    for r in sorted(runs, key=lambda r: float(r["at"])):
        if r["event"] == "start" and r["pid"] in pids and r["at"] > after:
            found.setdefault(r["sweep"], r)
    return found


def wait_for_reruns(
    out: Path, pids: set[int], after: float, names: set[str], timeout: float
) -> dict[str, Event]:
    """``first_starts`` once every sweep in ``names`` has one, or whatever there is by the
    deadline: the delays are measured even when they are too long."""
    deadline = time.monotonic() + timeout
    while True:
        found = first_starts(read_runs(out), pids, after)
        if set(found) >= names or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def twice_run(runs: list[Event]) -> dict[tuple[str, str], int]:
    started = Counter((r["sweep"], r["tick"]) for r in runs if r["event"] == "start")
    return {key: n for key, n in started.items() if n > 1}


def row_key(row: Event) -> tuple[str, float]:
    return row["name"], row_time(row["tick"])


def run_key(run: Event) -> tuple[str, float]:
    return run["sweep"], seconds(run["tick"])


def read_lease(url: str, name: str) -> LeaseRow:
    engine = make_engine(url)
    try:
        row = LeaseStore(engine, "system").read(name)
    finally:
        engine.dispose()
    assert row is not None, f"no lease row for {name}"
    return row


def after(events: Iterable[Event], instant: float) -> list[Event]:
    return [e for e in events if "timestamp" in e and stamp(e) > instant]


def is_event(name: str, **fields: Any) -> Callable[[Event], bool]:
    return lambda e: e.get("event") == name and all(e.get(k) == v for k, v in fields.items())


def is_loud(event: Event) -> bool:
    """An error, or a line that is not JSON."""
    return event.get("level") in ("error", "critical") or event.get("event") == "raw"


def start_one_sweep(
    cluster: Cluster, database_url: str, tmp_path: Path, entry: dict[str, Any], count: int
) -> tuple[list[Replica], Event, Replica]:
    """Start ``count`` replicas with one sweep; its first run, and the replica running it."""
    config = write_config(tmp_path / "sweepd.yaml", database_url, [entry])
    replicas = cluster.start(config, count, timeout=TIMEOUT)
    out = Path(entry["args"]["out"])
    first = wait_until(
        lambda: next((r for r in read_runs(out) if r["event"] == "start"), None), 20, "a run"
    )
    return replicas, first, next(r for r in replicas if r.pid == first["pid"])


# -- 1. SIGKILL: the killed replica's sweeps run again within about one ttl -------------------


def test_sigkill_blocks_the_killed_replicas_sweeps_for_about_one_ttl(
    cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    names = {f"k{i:02d}" for i in range(SWEEPS)}
    sweeps = [sweep(n, out, args={"duration": RUN_SECONDS}) for n in sorted(names)]
    config = write_config(tmp_path / "sweepd.yaml", database_url, sweeps)
    replicas = cluster.start(config, 3, timeout=TIMEOUT)
    began = time.monotonic()
    wait_until(
        lambda: True if {r["sweep"] for r in read_runs(out)} >= names else None,
        15,
        "every sweep to run once",
    )
    time.sleep(max(0.0, began + WARM_SECONDS - time.monotonic()))

    victim = wait_until(
        lambda: busiest(replicas, read_runs(out), least=2), 10, "a replica with two runs"
    )
    killed_at = time.time()
    victim.kill()
    survivors = [r for r in replicas if r is not victim]
    dead_holder, pids = holder_of(victim), {r.pid for r in survivors}
    # Read once it is dead: it writes nothing more. The log may miss its last 50 ms of lines,
    # the side-effect file misses nothing.
    dead_runs = in_flight(read_runs(out), victim.pid)
    claimed = claimed_unfinished(victim.events())
    held = set(dead_runs) | claimed
    assert dead_runs, "the victim had no run in flight when it was killed"

    reran = wait_for_reruns(out, pids, killed_at, names, timeout=RERUN_BOUND + 10)
    sleep_until(killed_at + RERUN_BOUND + KEPT_UP)
    stopped_at = time.time()
    codes = stop_all(survivors, timeout=TIMEOUT)
    runs, rows = read_runs(out), read_rows(database_url)
    logs = [r.events() for r in survivors]
    report_kill(database_url, killed_at, stopped_at, dead_runs, held, reran, runs, rows, logs)
    delays = {name: run["at"] - killed_at for name, run in reran.items()}

    assert codes == [0, 0], codes
    never = sorted(names - set(reran))
    assert not never, f"sweeps no survivor ran again within {RERUN_BOUND + 10}s: {never}"
    late = {n: round(d, 3) for n, d in sorted(delays.items()) if d >= RERUN_BOUND}
    assert not late, f"sweeps that took {RERUN_BOUND}s or more to run again: {late}"
    assert not twice_run(runs), f"ticks run twice: {twice_run(runs)}"
    rows_twice = {k: n for k, n in Counter(row_key(r) for r in rows).items() if n > 1}
    assert not rows_twice, f"ticks with two rows: {rows_twice}"

    # Each sweep the victim had in flight was next won by a survivor, the token one higher:
    # nothing but the dead holder's lease stood between them.
    for name, dead in sorted(dead_runs.items()):
        rerun = reran[name]
        assert rerun["token"] == dead["token"] + 1, (dead, rerun)
        assert seconds(rerun["tick"]) > seconds(dead["tick"]), (dead, rerun)

    # Its rows: none left running; those of runs that never ended are lost, and each was
    # marked so by the survivor that next won its sweep.
    assert not [r for r in rows if r["status"] == "running"], "rows left running"
    mine = [r for r in rows if r["holder"] == dead_holder and r["name"] in names]
    ended = {run_key(r) for r in runs if r["pid"] == victim.pid and r["event"] == "end"}
    assert {r["status"] for r in mine} <= {"success", "lost"}, Counter(r["status"] for r in mine)
    unended = [r for r in mine if row_key(r) not in ended]
    assert {row_key(r) for r in unended} >= {run_key(r) for r in dead_runs.values()}
    for row in unended:
        assert (row["status"], row["error"]) == ("lost", LOST_ERROR), row
    lost = [r for r in mine if r["status"] == "lost"]
    marked = [e for log in logs for e in of(log, "run.marked_lost")]
    assert sum(e["count"] for e in marked) == len(lost), (marked, lost)
    assert Counter(e["sweep"] for e in marked) == Counter(r["name"] for r in lost)
    # And the survivors took over without a fault of their own.
    loud = [(e["event"], e.get("error")) for log in logs for e in log if is_loud(e)]
    assert not loud, loud


def lease_expiries(
    rows: list[Event], dead_runs: dict[str, Event], killed_at: float
) -> dict[str, float]:
    """When each lease of the runs the victim had in flight expired, in seconds after the kill:
    one ttl after its claim (a 0.5 s run is never renewed), whose instant its row's started_at
    is, on the database's clock."""
    dead = {run_key(run) for run in dead_runs.values()}
    return {
        row["name"]: row_time(row["started_at"]) + TTL - killed_at
        for row in rows
        if row["tick"] is not None and row_key(row) in dead
    }


def claim_lateness(logs: list[list[Event]], reran: dict[str, Event]) -> dict[str, float]:
    """Per sweep, how late after its tick the rerun was claimed: time spent queued for a slot."""
    wanted = {(run["sweep"], run["tick"]): run["sweep"] for run in reran.values()}
    return {
        wanted[key]: float(e["lateness"])
        for log in logs
        for e in of(log, "tick.claimed")
        if (key := (e["sweep"], e["tick"].replace("Z", "+00:00"))) in wanted
    }


def keeping_up(
    runs: list[Event], logs: list[list[Event]], killed_at: float, stopped_at: float
) -> str:
    """Whether two survivors keep up with all 16 sweeps: how many ran each whole-second tick
    before the kill (three replicas) and once the reruns are done (two), the busy slots, how
    late the survivors' claims came before and after, and the ticks skipped since the kill."""
    steady = killed_at + RERUN_BOUND
    per_tick = Counter(seconds(r["tick"]) for r in runs if r["event"] == "start")
    before = [per_tick[t] for t in sorted(per_tick) if min(per_tick) < t < killed_at - 1]
    settled = [per_tick[t] for t in sorted(per_tick) if steady <= t < stopped_at - 1]
    started = [r for r in runs if r["event"] == "start" and steady <= r["at"] < stopped_at]
    claims = [e for log in logs for e in of(log, "tick.claimed")]
    late = {
        "before": sorted(float(e["lateness"]) for e in claims if stamp(e) < killed_at),
        "after": sorted(float(e["lateness"]) for e in claims if stamp(e) > steady),
    }
    skips = Counter(e["reason"] for log in logs for e in of(after(log, killed_at), "tick.skipped"))
    return (
        f"sweeps run per tick: {before} by 3 replicas before the kill,"
        f" {settled} by 2 from kill+{RERUN_BOUND:.0f}s, with"
        f" {len(started) * RUN_SECONDS / (stopped_at - steady):.1f} of 8 slot-seconds/s busy;"
        " survivors' claim lateness "
        + ", ".join(
            f"{when} p50={statistics.median(values) if values else 0:.3f}s"
            f" max={max(values, default=0):.3f}s"
            for when, values in late.items()
        )
        + f"; skips since the kill {dict(skips)}"
    )


def report_kill(
    database_url: str,
    killed_at: float,
    stopped_at: float,
    dead_runs: dict[str, Event],
    held: set[str],
    reran: dict[str, Event],
    runs: list[Event],
    rows: list[Event],
    logs: list[list[Event]],
) -> None:
    """The figures, in the -s output: kill→rerun per sweep (* the victim's, by its log), with
    its dead lease's expiry and its rerun's wait for a slot, and whether the survivors kept up."""
    backend = make_url(database_url).get_backend_name()
    delays = {name: run["at"] - killed_at for name, run in reran.items()}
    free, late = lease_expiries(rows, dead_runs, killed_at), claim_lateness(logs, reran)
    per_sweep = ", ".join(
        f"{name}{'*' if name in held else ''}={delays[name]:.2f}"
        f"[{f'free {free[name]:.2f}, ' if name in free else ''}late {late.get(name, -1):.2f}]"
        for name in sorted(delays)
    )
    held_delays = [d for n, d in delays.items() if n in held]
    print(
        f"\n[{backend}] SIGKILL with {len(dead_runs)} runs in flight ({len(held)} sweeps, *,"
        " claimed in its log without a run.finished):"
        f" kill->rerun max={max(delays.values(), default=0):.3f}s,"
        f" held max={max(held_delays, default=0):.3f}s,"
        f" others max={max((d for n, d in delays.items() if n not in held), default=0):.3f}s"
        f"\n  per sweep, s after the kill [dead lease expiry; rerun's claim after its tick]:"
        f" {per_sweep}\n  {keeping_up(runs, logs, killed_at, stopped_at)}"
    )


# -- 2. SIGSTOP past the ttl: overtaken, told, and fenced off ---------------------------------


def test_a_replica_paused_past_its_ttl_is_overtaken_and_fenced_off(
    cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    out, resource = tmp_path / "runs.jsonl", tmp_path / "fenced.jsonl"
    args = {"resource": str(resource), "duration": FENCED_RUN}
    entry = sweep(NAME, out, callable="daemon_sweeps:fenced", args=args)
    replicas, first, paused = start_one_sweep(cluster, database_url, tmp_path, entry, 3)
    old, holder = int(first["token"]), str(first["holder"])
    others = {holder_of(r) for r in replicas if r is not paused}

    # Half a second into the run: past its claim and before its first renewal (a second after
    # the claim), so the process holds no database lock while it is stopped. The run then has
    # 2.5 s of work left when it resumes: it is still in flight at the first renewal after
    # SIGCONT, which is when the daemon learns of the loss.
    sleep_until(first["at"] + 0.5)
    assert run_key(first) not in {run_key(r) for r in read_runs(out) if r["event"] in ENDS}
    paused.signal(signal.SIGSTOP)
    stopped, stopped_wall = time.monotonic(), time.time()
    try:
        newer = wait_until(
            lambda: newer_write(resource, old, others, stopped + PAUSE), PAUSE + 20, "a newer write"
        )
        lease_paused = read_lease(database_url, NAME)
        rows_paused = read_rows(database_url)
    finally:
        paused.signal(signal.SIGCONT)
    resumed = time.time()
    paused_for = time.monotonic() - stopped

    lost = paused.wait_for(is_event("lease.lost", sweep=NAME, fencing_token=old), timeout=10)
    lease_told = read_lease(database_url, NAME)
    done = paused.wait_for(
        is_event("run.finished", sweep=NAME, fencing_token=old), timeout=FENCED_RUN + 10
    )
    lease_done = read_lease(database_url, NAME)
    _, codes, _ = cluster.stop(TIMEOUT)
    runs, rows, ledger = read_runs(out), read_rows(database_url), read_runs(resource)
    paused_log = paused.events()
    mine = next(r for r in runs if r["event"] == "end" and r["token"] == old)
    takeover = next(r for r in runs if r["event"] == "start" and r["token"] == old + 1)
    backend = make_url(database_url).get_backend_name()
    print(
        f"\n[{backend}] stopped {paused_for:.2f}s, {takeover['at'] - stopped_wall:.2f}s"
        f" from SIGSTOP to the newer holder's start; SIGCONT -> lease.lost"
        f" {stamp(lost) - resumed:.3f}s, -> run.finished {stamp(done) - resumed:.3f}s"
        f" ({done['status']}); the paused run's write: accepted={mine['accepted']}"
        f" (highest {mine['highest']}, its token {old}, told lease_lost={mine['lease_lost']});"
        f" ledger tokens {[(t['token'], t['accepted']) for t in ledger]}"
    )

    assert codes == [0, 0, 0], codes
    # Overtaken while stopped: the next claim's token is one higher, by another replica,
    # which marked the paused run's row lost and held the lease.
    assert (newer["token"], newer["accepted"]) == (old + 1, True), newer
    assert seconds(newer["tick"]) > seconds(first["tick"]), (first, newer)
    assert lease_paused.holder in others and lease_paused.fencing_token > old, lease_paused
    (row_paused,) = [r for r in rows_paused if r["name"] == NAME and r["fencing_token"] == old]
    assert (row_paused["holder"], row_paused["status"]) == (holder, "lost"), row_paused
    (marker,) = [r for r in replicas if holder_of(r) == newer["holder"]]
    marked = of(marker.events(), "run.marked_lost", sweep=NAME, fencing_token=old + 1)
    assert [e["count"] for e in marked] == [1], marked

    # Told at its first renewal after SIGCONT (a beat is a second), reason taken.
    assert (lost["reason"], lost["level"], lost["holder"]) == ("taken", "error", holder), lost
    assert resumed - 0.1 <= stamp(lost) <= resumed + 2.0, (resumed, lost)
    assert done["status"] == "lost", done
    # Its write after resuming, under the old token, was refused; the newer holder's had been
    # accepted before it. Every accepted write is in token order: nothing the token would not
    # stop got through.
    assert (mine["holder"], mine["accepted"]) == (holder, False), mine
    assert mine["lease_lost"] is True, "ctx.lease_lost was not set by the time it wrote"
    assert mine["at"] > resumed and mine["highest"] >= old + 1, mine
    (refused,) = [t for t in ledger if not t["accepted"]]
    assert (refused["holder"], refused["token"]) == (holder, old), refused
    assert ledger.index(newer) < ledger.index(refused), ledger
    accepted = [int(t["token"]) for t in ledger if t["accepted"]]
    assert accepted == sorted(accepted), accepted

    # Its row stays lost, and its release under the old token changed nothing: the lease was
    # the newer holders' once it was told, and still past its token once its run ended (by
    # then it may have won a later tick itself, fairly).
    (row,) = [r for r in rows if r["name"] == NAME and r["fencing_token"] == old]
    assert (row["holder"], row["status"], row["error"]) == (holder, "lost", LOST_ERROR), row
    assert not [r for r in rows if r["status"] == "running"], rows
    assert lease_told.holder in others and lease_told.fencing_token > old, lease_told
    assert lease_done.fencing_token > old, lease_done
    assert not of(paused_log, "lease.released", sweep=NAME, fencing_token=old)
    # Nothing else went wrong anywhere: the only errors are the paused replica's two.
    loud = [(e["event"], e.get("holder")) for log in cluster.events() for e in log if is_loud(e)]
    assert sorted(loud) == [("lease.lost", holder), ("run.finished", holder)], loud

    # The only overlap of two runs is the paused one with those that overtook it, and no tick
    # ran twice.
    pairs = overlaps(runs)
    assert pairs, "the paused run overlapped nothing: the scenario did not happen"
    for a, b in pairs:
        assert old in (a["token"], b["token"]), (a, b)
    assert not twice_run(runs), twice_run(runs)


def newer_write(resource: Path, old: int, others: set[str], not_before: float) -> Event | None:
    """The accepted write of another holder under a token above ``old``, once it exists and
    the monotonic clock has passed ``not_before``."""
    if time.monotonic() < not_before:
        return None
    return next(
        (
            t
            for t in read_runs(resource)
            if t["accepted"] and t["token"] > old and t["holder"] in others
        ),
        None,
    )


# -- 3. SIGSTOP past the ttl, the code returning as it resumes: lost, found at the release ----


def test_a_run_returning_as_its_paused_replica_resumes_is_lost_not_a_success(
    cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    out, args = tmp_path / "runs.jsonl", {"duration": RETURNING_RUN}
    entry = sweep(RETURNING, out, callable="daemon_sweeps:record_async", args=args)
    replicas, first, paused = start_one_sweep(cluster, database_url, tmp_path, entry, 2)
    (other,) = [r for r in replicas if r is not paused]
    old, holder, other_holder = int(first["token"]), str(first["holder"]), holder_of(other)

    # Stopped mid-run, before its first renewal, and held until another replica runs the next
    # tick, long past the run's deadline: on SIGCONT the run's sleep and the renewal beat are
    # both overdue, the sleep first, so the code returns before the renewal is even sent.
    sleep_until(first["at"] + STOP_AFTER)
    assert run_key(first) not in {run_key(r) for r in read_runs(out) if r["event"] in ENDS}
    paused.signal(signal.SIGSTOP)
    stopped_wall = time.time()
    try:
        newer = wait_until(
            lambda: next(
                (r for r in read_runs(out) if r["event"] == "start" and r["token"] > old), None
            ),
            TTL + 10,
            "another replica's run of the next tick",
        )
        lease_paused = read_lease(database_url, RETURNING)
    finally:
        continued = time.time()
        paused.signal(signal.SIGCONT)

    done = paused.wait_for(is_event("run.finished", sweep=RETURNING, fencing_token=old), timeout=10)
    newer_done = other.wait_for(
        is_event("run.finished", sweep=RETURNING, fencing_token=old + 1),
        timeout=RETURNING_RUN + 10,
    )
    _, codes, _ = cluster.stop(TIMEOUT)
    runs, rows = read_runs(out), read_rows(database_url)
    paused_log, other_log = paused.events(), other.events()
    (mine,) = [r for r in runs if run_key(r) == run_key(first) and r["event"] in ENDS]
    backend = make_url(database_url).get_backend_name()
    print(
        f"\n[{backend}] stopped {continued - stopped_wall:.2f}s,"
        f" {newer['at'] - stopped_wall:.2f}s from SIGSTOP to the newer holder's start;"
        f" SIGCONT -> the code's {mine['event']} {mine['at'] - continued:.3f}s,"
        f" -> run.finished {stamp(done) - continued:.3f}s ({done['status']})"
    )

    assert codes == [0, 0], codes
    # Overtaken while stopped: the next tick ran on the other replica under the next token,
    # which marked the paused run's row lost and held the lease.
    assert (newer["pid"], newer["holder"], newer["token"]) == (other.pid, other_holder, old + 1)
    assert seconds(newer["tick"]) > seconds(first["tick"]), (first, newer)
    assert newer_done["status"] == "success", newer_done
    assert lease_paused.holder == other_holder and lease_paused.fencing_token > old, lease_paused
    marked = of(other_log, "run.marked_lost", sweep=RETURNING, fencing_token=old + 1)
    assert [e["count"] for e in marked] == [1], marked

    # Its code returned as it resumed, before any renewal came round to tell it.
    assert (mine["event"], mine["pid"]) == ("end", paused.pid), mine
    assert continued < mine["at"] < continued + 0.5, (continued, mine)
    # The release found the lease another's, and said so: the run was lost, not a success.
    lost = of(paused_log, "lease.lost", sweep=RETURNING, fencing_token=old)
    assert [(e["reason"], e["level"], e.get("note")) for e in lost] == [
        ("taken", "error", "found at the release")
    ], lost
    finished = of(paused_log, "run.finished", sweep=RETURNING, fencing_token=old)
    assert [(e["status"], e["level"], e.get("error")) for e in finished] == [
        ("lost", "error", LOST_MESSAGE)
    ], finished
    assert not of(paused_log, "run.finished", sweep=RETURNING, fencing_token=old, status="success")
    assert not of(paused_log, "lease.released", sweep=RETURNING, fencing_token=old)
    assert not of(paused_log, "lease.release_failed"), of(paused_log, "lease.release_failed")
    (stopped,) = of(paused_log, "daemon.stopped")
    assert stopped["stats"].get("leases_lost") == 1, stopped["stats"]

    # Its row stays lost, as the other replica marked it: the close changed nothing.
    (row,) = [r for r in rows if r["name"] == RETURNING and r["fencing_token"] == old]
    assert (row["holder"], row["status"], row["error"]) == (holder, "lost", LOST_ERROR), row
    assert not [r for r in rows if r["status"] == "running"], rows
    # Nothing else went wrong anywhere: the only errors are the paused replica's two.
    loud = [(e["event"], e.get("holder")) for log in cluster.events() for e in log if is_loud(e)]
    assert sorted(loud) == [("lease.lost", holder), ("run.finished", holder)], loud
    assert not twice_run(runs), twice_run(runs)
