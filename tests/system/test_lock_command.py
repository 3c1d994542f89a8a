"""`sweepd lock` as a crontab runs it: a real process per host, on every dialect.

Each test starts `python -m sweepd lock ...` as a subprocess and judges it by what an operator
sees: which COMMAND ran (it leaves a trace in tmp_path), the exit status, and what was printed.
The lease row itself is read back through LeaseStore where release must be proved.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sweepd.db.engine import make_engine
from sweepd.lease import LeaseRow, LeaseStore

pytestmark = pytest.mark.slow

TIMEOUT = 60.0  # seconds; bounds every subprocess and every wait
TICK = "2026-01-01T00:00:00Z"
HOLDER = rf"{re.escape(socket.gethostname())}:(?P<pid>\d+):[0-9a-f]{{8}}"
HELD_LINE = re.compile(
    rf"sweepd lock: (?P<name>\S+): held by (?P<holder>{HOLDER}) until (?P<until>\S+); not running"
)
CLAIMED_LINE = re.compile(
    rf"sweepd lock: (?P<name>\S+): tick (?P<tick>\S+) already claimed by (?P<holder>{HOLDER}); not running"
)


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str
    pid: int


def environment() -> dict[str, str]:
    """Our environment without any SWEEPD_* setting, so only the arguments choose the database."""
    return {key: value for key, value in os.environ.items() if not key.startswith("SWEEPD_")}


class Processes:
    """Starts sweepd commands and makes sure none outlives the test."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "sweepd", *args],
            cwd=self.cwd,
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Its own group, as a cron job or a terminal's foreground job would have.
            start_new_session=True,
        )
        self.started.append(process)
        return process

    def run(self, *args: str) -> Result:
        return self.finish(self.start(*args))

    @staticmethod
    def finish(process: subprocess.Popen[str]) -> Result:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
        return Result(process.returncode, stdout, stderr, process.pid)

    def kill_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.communicate(timeout=TIMEOUT)


@pytest.fixture
def sweepd(tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.kill_all()


def lock(url: str, name: str, *options: str, command: Sequence[str]) -> list[str]:
    return ["lock", name, *options, "--database", url, "--", *command]


def read_lease(url: str, name: str) -> tuple[LeaseRow | None, datetime]:
    """The lease row and the database's clock, read the way sweepd reads them."""
    engine = make_engine(url)
    try:
        store = LeaseStore(engine, "default")
        return store.read(name), store.now()
    finally:
        engine.dispose()


def assert_clean(result: Result) -> None:
    # The last lines of a traceback say what went wrong; the rest only floods the report.
    if "Traceback" in result.stdout + result.stderr:
        pytest.fail("traceback printed: " + " | ".join(result.stderr.strip().splitlines()[-2:]))


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def current_hour_slot() -> datetime:
    """The --every 1h tick, after waiting out the last seconds of an hour so all three agree."""
    now = datetime.now(UTC)
    next_hour = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    if next_hour - now < timedelta(seconds=15):
        time.sleep((next_hour - now).total_seconds() + 0.5)
        now = datetime.now(UTC)
    return now.replace(minute=0, second=0, microsecond=0)


# COMMAND for the race: record which sweepd ran it ($PPID is the sweepd process), linger so the
# three overlap, then exit with a status the winner must hand back.
RACE_COMMAND = ["/bin/sh", "-c", 'echo "$PPID" >> "$1"; sleep 1; exit 7', "sh"]


@pytest.mark.parametrize(
    ("schedule", "skip_exit"),
    [
        # Losers exit 0 by default; --skip-exit is checked on the other way of naming the tick.
        pytest.param("tick", None, id="tick"),
        pytest.param("every", 75, id="every-1h-skip-exit-75"),
    ],
)
def test_three_invocations_for_one_tick_run_the_command_once(
    sweepd: Processes, database_url: str, tmp_path: Path, schedule: str, skip_exit: int | None
) -> None:
    runs = tmp_path / "runs"
    if schedule == "tick":
        options = ["--ttl", "1m", "--tick", TICK]
        tick = datetime(2026, 1, 1, tzinfo=UTC)
    else:
        tick = current_hour_slot()
        options = ["--ttl", "1m", "--every", "1h"]
    if skip_exit is not None:
        options += ["--skip-exit", str(skip_exit)]

    began = time.monotonic()
    processes = [
        sweepd.start(*lock(database_url, "nightly", *options, command=[*RACE_COMMAND, str(runs)]))
        for _ in range(3)
    ]
    results = [sweepd.finish(process) for process in processes]
    elapsed = time.monotonic() - began

    lines = runs.read_text().splitlines()
    assert len(lines) == 1, lines
    (winner,) = [result for result in results if result.pid == int(lines[0])]
    losers = [result for result in results if result is not winner]
    for result in results:
        assert_clean(result)
    assert winner.returncode == 7, winner.stderr
    assert winner.stderr == ""
    for loser in losers:
        assert loser.returncode == (skip_exit or 0), loser.stderr
        line = one_line(loser.stderr)
        held, claimed = HELD_LINE.fullmatch(line), CLAIMED_LINE.fullmatch(line)
        match = held or claimed
        assert match is not None, line
        assert match["name"] == "nightly"
        assert int(match["pid"]) == winner.pid, (line, winner.pid)
        if held is not None:
            assert datetime.fromisoformat(held["until"]) > datetime(2026, 1, 1, tzinfo=UTC)
        if claimed is not None:
            assert datetime.fromisoformat(claimed["tick"]) == tick
    row, _ = read_lease(database_url, "nightly")
    assert row is not None
    assert row.tick == tick
    assert row.fencing_token == 1
    assert elapsed < 30, f"three lock runs took {elapsed:.1f}s"


# name -> (COMMAND, expected exit status)
STATUSES: dict[str, tuple[list[str], int]] = {
    "ok": (["/bin/sh", "-c", "exit 0"], 0),
    "three": (["/bin/sh", "-c", "exit 3"], 3),
    "missing": (["sweepd-test-no-such-command"], 127),
    "killed": (["/bin/sh", "-c", "kill -KILL $$"], 128 + signal.SIGKILL),
    "terminated": (["/bin/sh", "-c", "kill -TERM $$"], 128 + signal.SIGTERM),
}


def test_exit_status_is_the_commands(sweepd: Processes, database_url: str) -> None:
    # Distinct lease names, so the five can run side by side.
    processes = {
        name: sweepd.start(*lock(database_url, name, "--ttl", "1m", command=command))
        for name, (command, _) in STATUSES.items()
    }
    results = {name: sweepd.finish(process) for name, process in processes.items()}

    for name, (_, expected) in STATUSES.items():
        result = results[name]
        assert_clean(result)
        assert result.returncode == expected, (name, result.stderr)
        if name == "missing":
            assert "sweepd-test-no-such-command" in one_line(result.stderr)
        else:
            assert result.stderr == "", (name, result.stderr)
        # Whatever became of COMMAND, the lease is handed back at once, not left to its ttl.
        row, now = read_lease(database_url, name)
        assert row is not None
        assert row.expires_at <= now, (name, row)


# The child: count the given signal for half a second after the first one, record it, exit 42.
CHILD = """
import os, signal, sys, time
out, ready, name = sys.argv[1], sys.argv[2], sys.argv[3]
received = 0
def on_signal(signum, frame):
    global received
    received += 1
signal.signal(getattr(signal, name), on_signal)
with open(ready, "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 30
while not received and time.monotonic() < deadline:
    time.sleep(0.01)
if not received:
    sys.exit(99)
time.sleep(0.5)
with open(out, "w") as f:
    f.write(f"got {name[3:]}\\n{received}\\n")
sys.exit(42)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("signame", "to_group"),
    [
        # SIGTERM as a supervisor sends it: to sweepd's pid alone.
        pytest.param("SIGTERM", False, id="SIGTERM"),
        # SIGINT as a terminal's Ctrl-C sends it: to sweepd's whole process group.
        pytest.param("SIGINT", True, id="SIGINT"),
    ],
)
def test_signal_is_forwarded_once_and_the_lease_released(
    sweepd: Processes, database_url: str, tmp_path: Path, signame: str, to_group: bool
) -> None:
    out, ready = tmp_path / "child.out", tmp_path / "child.ready"
    command = [sys.executable, "-c", CHILD, str(out), str(ready), signame]
    process = sweepd.start(*lock(database_url, "forwarded", "--ttl", "1m", command=command))
    child_pid: int | None = None
    try:
        wait_for(ready)
        child_pid = int(ready.read_text())
        assert os.getpgid(child_pid) != os.getpgid(process.pid), "child shares sweepd's group"
        signum = getattr(signal, signame)
        sent = time.monotonic()
        if to_group:
            os.killpg(process.pid, signum)
        else:
            os.kill(process.pid, signum)
        result = sweepd.finish(process)
        elapsed = time.monotonic() - sent
    finally:
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)

    assert_clean(result)
    assert result.returncode == 42, result.stderr
    assert out.read_text().splitlines() == [f"got {signame[3:]}", "1"]
    assert elapsed < 10, f"sweepd took {elapsed:.1f}s to exit after {signame}"
    row, now = read_lease(database_url, "forwarded")
    assert row is not None
    assert row.expires_at <= now, row


def test_heartbeat_keeps_the_lease_past_its_ttl(
    sweepd: Processes, database_url: str, tmp_path: Path
) -> None:
    started, done, runs = tmp_path / "started", tmp_path / "done", tmp_path / "runs"
    # The first command runs until the test lets it go, so the second claim is
    # sure to come while it runs, however slow the machine is to start processes.
    first_command = [
        "/bin/sh",
        "-c",
        'touch "$1"; i=0; while [ ! -e "$2" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; echo first >> "$3"',
        "sh",
    ]
    first = sweepd.start(
        *lock(
            database_url,
            "long",
            "--ttl",
            "1s",
            command=[*first_command, str(started), str(done), str(runs)],
        )
    )
    wait_for(started)
    time.sleep(3)  # three ttls: without heartbeats the lease would have lapsed

    second = sweepd.run(
        *lock(
            database_url,
            "long",
            "--ttl",
            "1s",
            command=["/bin/sh", "-c", 'echo second >> "$1"', "sh", str(runs)],
        )
    )
    done.touch()
    result = sweepd.finish(first)

    assert_clean(second)
    assert second.returncode == 0, second.stderr
    held = HELD_LINE.fullmatch(one_line(second.stderr))
    assert held is not None, second.stderr
    assert int(held["pid"]) == first.pid
    assert_clean(result)
    assert result.returncode == 0, result.stderr
    assert runs.read_text().splitlines() == ["first"]


# (NAME and options before `--database`, whether a database is given at all)
USAGE_ERRORS = [
    pytest.param(["job"], True, id="missing-ttl"),
    pytest.param(["job", "--ttl", "10x"], True, id="bad-ttl"),
    pytest.param(
        ["job", "--ttl", "1m", "--every", "1h", "--tick", TICK], True, id="every-and-tick"
    ),
    pytest.param(["Bad Name", "--ttl", "1m"], True, id="bad-name"),
    pytest.param(["job", "--ttl", "1m"], False, id="no-database"),
]


@pytest.mark.parametrize(("args", "with_database"), USAGE_ERRORS)
def test_usage_errors_exit_2_with_one_line(
    sweepd: Processes, tmp_path: Path, args: list[str], with_database: bool
) -> None:
    database, marker = tmp_path / "never.db", tmp_path / "ran"
    where = ["--database", f"sqlite:///{database}"] if with_database else []

    result = sweepd.run("lock", *args, *where, "--", "/bin/sh", "-c", f"touch {marker}")

    assert_clean(result)
    assert result.returncode == 2, result.stderr
    one_line(result.stderr)
    assert result.stdout == ""
    assert not marker.exists(), "COMMAND ran despite a usage error"
    assert not database.exists(), "a usage error still touched the database"


def test_database_password_is_never_printed(sweepd: Processes, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    url = "postgresql+psycopg://postgres:s3cr3t@127.0.0.1:1/test"  # port 1: refused at once

    result = sweepd.run(*lock(url, "job", "--ttl", "1m", command=["touch", str(marker)]))

    assert "s3cr3t" not in result.stdout + result.stderr
    assert_clean(result)
    assert result.returncode == 1, result.stderr
    assert one_line(result.stderr).startswith("sweepd: ")
    assert not marker.exists()
