"""`sweepd status`, `history` and `trigger` as an operator runs them: real processes, real databases.

Each command is `python -m sweepd ...` in a subprocess, judged by its exit status and what it
printed; the daemon, where one is needed, is a real `sweepd run` (daemon_harness), and the sweeps
are daemon_sweeps' ``record``, which leaves a line per start and end that the test reads back.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import HERE, Cluster, overlaps, read_rows, read_runs, sweep, write_config

from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.history import History
from sweepd.lease import LeaseStore, Won
from sweepd.schedule import Every, previous_tick

pytestmark = pytest.mark.slow

TIMEOUT = 60.0  # seconds; bounds every subprocess and every wait
HOLDER = rf"{re.escape(socket.gethostname())}:(?P<pid>\d+):[0-9a-f]{{8}}"
HELD_LINE = re.compile(
    rf"sweepd trigger: (?P<name>\S+): held by (?P<holder>{HOLDER}) until (?P<until>\S+); not running"
)
FAILS_ALWAYS = {"fail_times": 1_000_000}


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str
    pid: int

    def json(self) -> Any:
        return json.loads(self.stdout)


class Commands:
    """Starts `python -m sweepd ...` with no SWEEPD_* of ours; none outlives the test."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPD_")}
        # daemon_sweeps must import, as it does for the daemon: status resolves the config.
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(HERE), environment.get("PYTHONPATH")])
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "sweepd", *args],
            cwd=self.cwd,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.started.append(process)
        return process

    def run(self, *args: str) -> Result:
        return self.finish(self.start(*args))

    @staticmethod
    def finish(process: subprocess.Popen[str]) -> Result:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
        result = Result(process.returncode, stdout, stderr, process.pid)
        # A failed run's own traceback is a field of its JSON log line; sweepd's is not.
        if any(line.startswith("Traceback") for line in (stdout + stderr).splitlines()):
            pytest.fail("traceback printed: " + " | ".join(stderr.strip().splitlines()[-3:]))
        return result

    def kill_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.communicate(timeout=TIMEOUT)


@pytest.fixture
def sweepd(tmp_path: Path) -> Iterator[Commands]:
    commands = Commands(tmp_path)
    try:
        yield commands
    finally:
        commands.kill_all()


def config(tmp_path: Path, url: str, *sweeps: dict[str, Any]) -> str:
    path = write_config(tmp_path / "sweepd.yaml", url, list(sweeps))
    text = path.read_text().replace("level: debug", "level: info")  # the run's lines, not ours
    path.write_text(text)
    return str(path)


def until(check: Callable[[], Result | None], what: str, timeout: float = 30.0) -> Result:
    """Poll a command until ``check`` returns its result; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None:
            return found
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.3)


def successes(url: str, name: str) -> int:
    return sum(1 for r in read_rows(url) if r["name"] == name and r["status"] == "success")


def iso(instant: datetime) -> str:
    return instant.astimezone(UTC).isoformat().replace("+00:00", "Z")


# -- status ---------------------------------------------------------------------------------------


def test_status_check_flags_a_sweep_that_fails_every_time(
    sweepd: Commands, cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    fast = {"every": "1s", "ttl": "2s", "misfire_grace": "3s"}  # stale after 2 x 1s + 2s
    path = config(
        tmp_path,
        database_url,
        sweep("healthy", out, **fast),
        sweep("broken", out, **fast, args=FAILS_ALWAYS),
    )
    cluster.start(Path(path))

    def stale() -> Result | None:
        result = sweepd.run("status", "--check", "--config", path)
        return result if result.returncode == 1 and "broken: STALE" in result.stdout else None

    found = until(stale, "status --check reports broken as stale")
    assert not [line for line in found.stdout.splitlines() if line.startswith("healthy:")]
    # Stopped, so that the last run read below has ended (a tick a second may be in flight).
    _, codes, _ = cluster.stop()
    assert codes == [0]
    report = sweepd.run("status", "--config", path, "--format", "json")
    assert report.returncode == 0  # without --check the report is only a report
    states = {s["name"]: s for s in report.json()["sweeps"]}
    assert states["broken"]["stale"] is True
    assert states["broken"]["last_run"]["status"] == "failed"
    assert states["broken"]["last_success"] is None
    assert states["healthy"]["last_success"] is not None
    assert states["broken"]["lease"]["holder"].startswith(socket.gethostname())
    table = sweepd.run("status", "--config", path)
    assert table.returncode == 0
    assert re.search(r"^broken\s.*STALE", table.stdout, re.MULTILINE), table.stdout


def test_status_check_passes_on_a_healthy_deployment_and_fails_once_it_stops(
    sweepd: Commands, cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    fast = {"every": "1s", "ttl": "2s", "misfire_grace": "2s"}
    path = config(tmp_path, database_url, sweep("one", out, **fast), sweep("two", out, **fast))
    cluster.start(Path(path), count=2)
    # Enough ticks that some are past the young ones (misfire_grace + ttl) and so are judged.
    deadline = time.monotonic() + TIMEOUT
    while successes(database_url, "one") < 8 or successes(database_url, "two") < 8:
        assert time.monotonic() < deadline, "the daemons did not run eight ticks each"
        time.sleep(0.2)
    healthy = sweepd.run("status", "--check", "--config", path)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert healthy.stdout.startswith("ok: 2 sweeps"), healthy.stdout
    assert len(healthy.stdout.splitlines()) == 1

    _, codes, _ = cluster.stop()
    assert codes == [0, 0]

    def gaps() -> Result | None:
        result = sweepd.run("status", "--check", "--config", path)
        return result if result.returncode == 1 and "no replica ran" in result.stdout else None

    stopped = until(gaps, "status --check reports the ticks nobody ran")
    problems = stopped.stdout.splitlines()
    assert {line.split(":")[0] for line in problems} == {"one", "two"}, problems


def test_status_check_reports_a_tick_that_no_replica_ran(
    sweepd: Commands, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    # Young ticks (misfire_grace + ttl = 40s) are not judged: the rows written below stay the
    # whole story however slowly the commands start.
    path = config(
        tmp_path,
        database_url,
        sweep("gappy", out, every="1s", ttl="30s", misfire_grace="10s"),
    )
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    try:
        last = previous_tick(Every(timedelta(seconds=1)), LeaseStore(engine, "system").now())
        assert last is not None
        history = History(engine, "system")
        missing = last - timedelta(seconds=50)
        for age in range(60, -1, -1):
            tick = last - timedelta(seconds=age)
            if tick != missing:
                run_id = history.start("gappy", tick, "host-a:1:0a0b0c0d", 1, 1, "schedule")
                history.finish(run_id, "gappy", "success")
    finally:
        engine.dispose()

    check = sweepd.run("status", "--check", "--config", path)
    assert check.returncode == 1, check.stdout + check.stderr
    (line,) = check.stdout.splitlines()
    assert line.startswith("gappy: 1 tick no replica ran"), line
    assert iso(missing) in line
    report = sweepd.run("status", "--config", path, "--format", "json").json()
    (gappy,) = report["sweeps"]
    assert gappy["gaps"]["count"] == 1
    assert gappy["gaps"]["ticks"] == [iso(missing)]
    assert gappy["stale"] is False
    assert report["ok"] is False


# -- trigger and history --------------------------------------------------------------------------


def test_three_triggers_at_once_never_overlap_and_history_shows_them_manual(
    sweepd: Commands, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    path = config(
        tmp_path, database_url, sweep("slow", out, every="1h", ttl="10s", args={"duration": 1.5})
    )
    # The schema first, so the three race for the lease and not for the migration lock.
    assert sweepd.run("db", "upgrade", "--config", path).returncode == 0
    processes = [sweepd.start("trigger", "slow", "--config", path) for _ in range(3)]
    results = [sweepd.finish(process) for process in processes]

    runs = read_runs(out)
    assert overlaps(runs) == []
    winners = [r for r in results if r.returncode == 0]
    assert winners, [r.stderr for r in results]
    ended = [r for r in runs if r["event"] == "end"]
    assert sorted(r["pid"] for r in ended) == sorted(r.pid for r in winners)
    for loser in (r for r in results if r.returncode != 0):
        assert loser.returncode == 1, loser.stderr
        (line,) = [line for line in loser.stderr.splitlines() if line.startswith("sweepd trigger:")]
        held = HELD_LINE.fullmatch(line)
        assert held is not None, line
        assert int(held["pid"]) in {r.pid for r in winners}, line
    for winner in winners:
        assert winner.stdout == "slow: success\n"

    shown = sweepd.run("history", "slow", "--config", path, "--format", "json")
    assert shown.returncode == 0
    rows = shown.json()["runs"]
    assert [(r["trigger"], r["status"], r["tick"]) for r in rows] == [
        ("manual", "success", None)
    ] * len(winners)
    table = sweepd.run("history", "--config", path)
    assert table.returncode == 0
    assert len(re.findall(r"\bslow\b.*\bmanual\b.*\bsuccess\b", table.stdout)) == len(winners)


def test_a_manual_trigger_leaves_the_next_scheduled_tick_alone(
    sweepd: Commands, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    path = config(tmp_path, database_url, sweep("steady", out, every="1s", ttl="10s"))
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    try:
        store = LeaseStore(engine, "system")
        # A tick some seconds ago, so that the one after it is due too when claimed below.
        latest = previous_tick(Every(timedelta(seconds=1)), store.now())
        assert latest is not None
        scheduled = latest - timedelta(seconds=5)
        claim = store.claim("steady", "daemon-a:1:00000001", timedelta(seconds=10), scheduled)
        assert isinstance(claim, Won)
        assert store.release("steady", "daemon-a:1:00000001", claim.token)

        result = sweepd.run("trigger", "steady", "--config", path, "--format", "json")
        assert result.returncode == 0, result.stderr
        assert result.json() == {"sweep": "steady", "outcome": "success"}

        row = store.read("steady")
        assert row is not None
        assert row.tick == scheduled  # the manual run recorded no tick
        assert row.fencing_token == 2
        assert row.holder.split(":")[1] == str(result.pid)
        assert row.expires_at <= store.now()  # and gave the lease back
        following = scheduled + timedelta(seconds=1)
        assert isinstance(
            store.claim("steady", "daemon-b:1:00000002", timedelta(seconds=10), following), Won
        )
    finally:
        engine.dispose()
    (manual,) = [r for r in read_rows(database_url) if r["name"] == "steady"]
    assert (manual["trigger"], manual["tick"], manual["status"]) == ("manual", None, "success")


def test_a_failed_manual_run_exits_1_and_is_recorded(
    sweepd: Commands, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    path = config(tmp_path, database_url, sweep("broken", out, every="1h", args=FAILS_ALWAYS))
    result = sweepd.run("trigger", "broken", "--config", path)
    assert result.returncode == 1
    assert "sweepd trigger: broken: failed" in result.stderr.splitlines()
    # The run's own log lines, as the daemon writes them.
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert any(e["event"] == "run.finished" and e["status"] == "failed" for e in events)
    failed = sweepd.run("history", "--config", path, "--status", "failed", "--since", "1h")
    assert failed.returncode == 0
    assert re.search(r"\bbroken\b.*\bmanual\b.*\bfailed\b.*RuntimeError", failed.stdout)
    nothing = sweepd.run("history", "nobody", "--config", path)
    assert (nothing.returncode, nothing.stdout) == (0, "no runs found\n")


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["trigger", "nope"],
            "sweepd: trigger: unknown sweep 'nope' (known: healthy)",
        ),
        (
            ["history", "--since", "yesterday"],
            "sweepd: --since: invalid duration 'yesterday' (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)",
        ),
        (["history", "--status", "done"], "sweepd history: Invalid value for '--status': *"),
        (["status", "--window", "0s"], "sweepd: --window: must be longer than zero"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    sweepd: Commands, tmp_path: Path, argv: list[str], message: str
) -> None:
    import fnmatch

    url = f"sqlite:///{tmp_path / 'sweepd.db'}"
    path = config(tmp_path, url, sweep("healthy", tmp_path / "runs.jsonl"))
    result = sweepd.run(*argv, "--config", path)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert fnmatch.fnmatchcase(line, message), line


def test_an_interrupted_manual_run_is_recorded_cancelled_and_gives_the_lease_back(
    sweepd: Commands, make_database: Callable[[str], str], tmp_path: Path
) -> None:
    url = make_database("sqlite")
    out = tmp_path / "runs.jsonl"
    path = config(tmp_path, url, sweep("long", out, every="1h", ttl="1m", args={"duration": 30}))
    process = sweepd.start("trigger", "long", "--config", path)
    deadline = time.monotonic() + TIMEOUT
    while not read_runs(out):
        assert time.monotonic() < deadline and process.poll() is None, "the run never started"
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    result = sweepd.finish(process)
    assert result.returncode == 1, result.stderr
    assert "sweepd trigger: long: cancelled" in result.stderr.splitlines()
    assert [r["event"] for r in read_runs(out)] == ["start", "stopped"]
    (row,) = read_rows(url)
    assert (row["status"], row["trigger"]) == ("cancelled", "manual")
    engine = make_engine(url)
    try:
        store = LeaseStore(engine, "system")
        lease = store.read("long")
        assert lease is not None and lease.expires_at <= store.now()
    finally:
        engine.dispose()
