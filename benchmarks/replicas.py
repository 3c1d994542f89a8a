"""Real ``sweepd run`` replicas sharing one database: is every tick run once, on time, cheaply?

    python benchmarks/replicas.py --replicas 3 --sweeps 200 --interval 1s --seconds 60 \\
                                  --dialect postgresql
    python benchmarks/replicas.py --idle [--seconds 60] [--dialect postgresql]
    python benchmarks/replicas.py --replicas 3 --sweeps 200 --interval 1s --seconds 30 --spread

By default every sweep is due at the same instant, an aligned burst; ``--spread`` gives sweep i
the ``anchor`` epoch + i x interval / sweeps instead, so that the ticks come evenly apart.

Each run gets a database of its own (a SQLite file in a temporary folder, or a fresh
``sweepd_bench_<random>`` database on the server), migrated once by the benchmark and dropped
at the end. The replicas are ``python -m sweepd run`` processes with a generated config
(health off unless --health, JSON logs at level info, one file per replica); their sweeps call ``tick`` in a
module written into the temporary folder (on their ``PYTHONPATH``), which appends one line per
run: sweep, tick, the time the sweep's code started, pid.

The measured window is ``--seconds`` long and starts half an interval after the first tick
that follows ``--warmup`` seconds after every replica logged ``daemon.started``: the samples
taken at its edges fall between bursts, and every sweep's first claim ever (an INSERT) is
behind it. Reported, for the ticks in the window:

* ticks expected (sweeps x ticks in the window), run, duplicated (a tick run more than once,
  by any replica) and missed (never run);
* lateness, from the side-effect lines (the sweep's ``time.time()`` at its start minus the
  scheduled tick) and, for comparison, from ``tick.claimed`` (its ``lateness`` field);
* per replica: CPU seconds (user + sys, ``/proc/PID/stat``), peak RSS (``VmHWM``), voluntary
  context switches (summed over the threads in ``/proc/PID/task``; a wakeup each);
* where a run's time goes: tick to ``tick.claimed`` to the sweep's line to
  ``run.finished``, from the log's timestamps;
* where the machine's CPU went (``/proc/stat``; the PostgreSQL server through its postmaster,
  MariaDB's through its pid file) and, on PostgreSQL, what the benchmark database's backends
  were doing (``pg_stat_activity`` sampled every 50 ms);
* SQL per tick: PostgreSQL's ``pg_stat_database`` transaction count of the benchmark database
  (every autocommit statement and every ping is one) over the window, divided by the ticks;
  MariaDB's global ``Com_*`` counters (shared with anyone else on the server); none for SQLite.

``--json PATH`` appends those figures to PATH as one JSON line (config, results, and CPU
per run: replica and database seconds over the window divided by the window's runs), plus, for
aligned ticks, the burst drain: the first run's start to the last one's, p50 over the bursts.

``--idle`` is one replica with 1,000 sweeps every minute: what a daemon costs while it mostly
waits; CPU and wakeups are also given for the stretches between bursts.

To look for causes: ``--profile DIR`` records replica 0 with py-spy (if it is on PATH) during
the window, only the thread holding the GIL unless ``--profile-wall``. Two experiments change
the system under test and say so in the report's title, never in ``sweepd/``:
``--db-threads N`` bounds the replicas' database threads at N (a ``sitecustomize`` in the
temporary folder), and ``--unsafe-async-commit`` sets ``synchronous_commit = off`` on the
benchmark database.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text

from sweepd.db import migrate
from sweepd.durations import format_duration, parse_duration

DIALECTS = ("sqlite", "postgresql", "mariadb")
SERVERS = {
    "postgresql": os.environ.get(
        "SWEEPD_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    "mariadb": os.environ.get("SWEEPD_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test"),
}
NAMESPACE = "bench"
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
MARIADB_COUNTERS = (
    "Com_select",
    "Com_insert",
    "Com_update",
    "Com_delete",
    "Com_admin_commands",
    "Com_rollback",
    "Questions",
)
SAMPLE_SECONDS = 0.5
# The counter --json divides by the ticks run for "SQL per tick".
SQL_COUNTER = {"postgresql": "xact_commit", "mariadb": "Questions"}
ACTIVITY_SECONDS = 0.05

# The sweep the replicas run. One write per line with O_APPEND, into a file per process,
# so lines never interleave and no replica waits on another's file.
SWEEP_MODULE = '''\
"""Written by benchmarks/replicas.py: one line per run, nothing else."""

import asyncio
import json
import os
import time

_MICRO = 1_000_000


def _line(ctx, out, at):
    tick_us = round(ctx.tick.timestamp() * _MICRO)
    record = {"sweep": ctx.name, "tick_us": tick_us, "at": at, "pid": os.getpid()}
    fd = os.open(
        os.path.join(out, f"runs-{os.getpid()}.jsonl"),
        os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        0o644,
    )
    try:
        os.write(fd, (json.dumps(record) + "\\n").encode())
    finally:
        os.close(fd)


def tick(ctx, out):
    _line(ctx, out, time.time())


async def tick_async(ctx, out):
    _line(ctx, out, time.time())
'''


# An experiment, never part of a measurement of sweepd as shipped: written as sitecustomize.py
# into the temporary folder, it gives the daemon's database threads (sweepd.offload, where
# every database call of the daemon runs) another bound than Python's min(32, cores + 4).
EXECUTOR_HOOK = '''\
"""Written by benchmarks/replicas.py --db-threads: another bound on sweepd's database threads."""

import sweepd.offload

sweepd.offload.DB_THREADS.size = {workers}
'''


# -- a database per run ---------------------------------------------------------------------


@contextmanager
def bench_database(dialect: str, folder: Path) -> Iterator[str]:
    """A fresh, migrated database; dropped (or left in ``folder``, deleted with it) after."""
    if dialect == "sqlite":
        url = f"sqlite:///{folder}/bench.db"
        migrate.upgrade(url)
        yield url
        return
    name = f"sweepd_bench_{secrets.token_hex(4)}"
    admin = create_engine(SERVERS[dialect], isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f"CREATE DATABASE {name}"))
        try:
            url = SERVERS[dialect].rsplit("/", 1)[0] + f"/{name}"
            migrate.upgrade(url)
            yield url
        finally:
            force = " WITH (FORCE)" if dialect == "postgresql" else ""
            with admin.connect() as connection:
                connection.execute(text(f"DROP DATABASE {name}{force}"))
    finally:
        admin.dispose()


class ServerCounters:
    """What the server says the benchmark database was sent, read from another database.

    PostgreSQL keeps per-database counters that only this benchmark's replicas move; a backend
    flushes them at most once a second while busy, so a reading lags by about that much at
    each edge of the window. MariaDB's are global: anyone else's traffic is counted too.
    """

    def __init__(self, dialect: str, url: str) -> None:
        self.dialect = dialect
        self.database = url.rsplit("/", 1)[1]
        self.reader: Engine | None = (
            create_engine(SERVERS[dialect], isolation_level="AUTOCOMMIT")
            if dialect in SERVERS
            else None
        )

    def read(self) -> Counter[str]:
        if self.reader is None:
            return Counter()
        with self.reader.connect() as connection:
            if self.dialect == "postgresql":
                connection.execute(text("SELECT pg_stat_clear_snapshot()"))
                row = connection.execute(
                    text(
                        "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, sessions"
                        " FROM pg_stat_database WHERE datname = :name"
                    ),
                    {"name": self.database},
                ).one()
                names = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "sessions")
                return Counter({key: int(value) for key, value in zip(names, row, strict=False)})
            wanted = ", ".join(f"'{name}'" for name in MARIADB_COUNTERS)
            rows = connection.execute(
                text(f"SHOW GLOBAL STATUS WHERE Variable_name IN ({wanted})")
            ).all()
            return Counter({str(row[0]): int(row[1]) for row in rows})

    def server_process(self) -> int | None:
        """The server's main process: PostgreSQL's postmaster (the parent of this reader's
        backend) or MariaDB's one process (its pid file)."""
        if self.reader is None:
            return None
        try:
            with self.reader.connect() as connection:
                if self.dialect == "mariadb":
                    pid_file = str(connection.execute(text("SELECT @@pid_file")).scalar_one())
                    return int(Path(pid_file).read_text())
                backend = int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())
            with open(f"/proc/{backend}/stat", encoding="ascii") as stat:
                return int(stat.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            return None  # a server in another namespace or on another host

    def activity(self, stop: threading.Event, every: float, into: Counter[str]) -> None:
        """Count what the benchmark database's backends are doing, every ``every`` seconds."""
        if self.reader is None or self.dialect != "postgresql":
            return
        query = text(
            "SELECT state, wait_event_type, wait_event FROM pg_stat_activity"
            " WHERE datname = :name AND backend_type = 'client backend'"
        )
        with self.reader.connect() as connection:
            while not stop.wait(every):
                # A fresh snapshot each time: pg_stat_activity is cached per transaction.
                connection.execute(text("SELECT pg_stat_clear_snapshot()"))
                for state, kind, event in connection.execute(query, {"name": self.database}):
                    if state != "active":
                        into[f"{state} ({kind}:{event})" if kind else str(state)] += 1
                    else:
                        into[
                            f"active, waiting on {kind}:{event}" if kind else "active, on CPU"
                        ] += 1
                into["(samples)"] += 1

    def close(self) -> None:
        if self.reader is not None:
            self.reader.dispose()


def process_cpu(pid: int) -> float | None:
    """User + sys seconds of one process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            # The command name may hold spaces and parentheses; the fields follow the last ')'.
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK  # utime, stime (fields 14, 15)


def server_cpu(postmaster: int | None) -> float:
    """User + sys seconds of the whole database server: the main process (all its threads,
    MariaDB's whole server), its live children, and (through its children times) every
    PostgreSQL backend that has exited."""
    if postmaster is None:
        return math.nan
    with open(f"/proc/{postmaster}/stat", encoding="ascii") as stat:
        fields = stat.read().rpartition(")")[2].split()
    total = sum(int(value) for value in fields[11:15]) / CLOCK_TICK  # utime stime cutime cstime
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICK
    return total


def machine_busy() -> tuple[float, float]:
    """Seconds of CPU the whole machine spent busy and idle since boot (``/proc/stat``)."""
    with open("/proc/stat", encoding="ascii") as stat:
        values = [int(value) for value in stat.readline().split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    # guest and guest_nice are already inside user and nice.
    return (sum(values[:8]) - idle) / CLOCK_TICK, idle / CLOCK_TICK


# -- the replicas ---------------------------------------------------------------------------


@dataclass
class Sample:
    """One look at a replica's process through /proc."""

    at: float  # time.time()
    cpu: float  # user + sys seconds since the process started
    hwm_kib: int
    rss_kib: int
    threads: int
    switches: dict[int, int]  # thread id -> voluntary context switches


def status_fields(path: str) -> dict[str, str]:
    with open(path, encoding="ascii") as status:
        return dict(line.split(":", 1) for line in status if ":" in line)


def sample(pid: int) -> Sample:
    at = time.time()
    cpu = process_cpu(pid)
    if cpu is None:
        raise RuntimeError(f"replica {pid} has exited")
    status = status_fields(f"/proc/{pid}/status")
    switches: dict[int, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            switches[int(task)] = int(
                status_fields(f"/proc/{pid}/task/{task}/status")["voluntary_ctxt_switches"]
            )
        except (OSError, KeyError):
            continue  # a thread that ended while we looked
    return Sample(
        at=at,
        cpu=cpu,
        hwm_kib=int(status["VmHWM"].split()[0]),
        rss_kib=int(status["VmRSS"].split()[0]),
        threads=int(status["Threads"]),
        switches=switches,
    )


def switches_between(first: Sample, last: Sample) -> int:
    """Wakeups of the threads alive at both samples (a thread that ended takes its count)."""
    return sum(
        last.switches[tid] - count for tid, count in first.switches.items() if tid in last.switches
    )


@dataclass
class Replica:
    index: int
    config: Path
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    samples: list[Sample] = field(default_factory=list)

    def start(self) -> Replica:
        with open(self.log_path, "wb") as log:
            # The child keeps its own copy of the descriptor; ours can close at once.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sweepd", "run", "--config", str(self.config)],
                cwd=self.config.parent,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out

    def started(self) -> bool:
        return any(event.get("event") == "daemon.started" for event in self.events())

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a drain), then SIGKILL if the drain takes longer than ``timeout``."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=10)

    def kill(self) -> None:
        if self.alive():
            assert self.process is not None
            self.process.kill()
            self.process.wait(timeout=10)


def replica_env(folder: Path) -> dict[str, str]:
    # The bench config is the whole story: no SWEEPD_* setting from this shell leaks in.
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWEEPD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    return env


def write_config(folder: Path, url: str, args: argparse.Namespace) -> Path:
    callable_ = "bench_sweeps:tick_async" if args.run_async else "bench_sweeps:tick"
    config: dict[str, Any] = {
        "database": {"url": url, "migrate": "never"},
        "namespace": NAMESPACE,
        # --health: each replica serves /metrics on a port of its own, as in production.
        "health": {"listen": "127.0.0.1:0" if args.health else ""},
        "logging": {"format": "json", "level": "info"},
        "drain_timeout": "10s",
        "sweeps": [
            {
                "name": f"bench-{i:04d}",
                "callable": callable_,
                "every": format_duration(args.interval),
                "args": {"out": str(folder / "runs")},
                **({"anchor": anchor(args, i).isoformat()} if args.spread else {}),
            }
            for i in range(args.sweeps)
        ],
    }
    if args.concurrency is not None:
        config["concurrency"] = args.concurrency
    path = folder / "sweepd.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return path


def offset_us(args: argparse.Namespace, i: int) -> int:
    """How far into each interval sweep i's ticks come: 0 for all, or evenly apart (--spread)."""
    return i * (args.interval // timedelta(microseconds=1)) // args.sweeps if args.spread else 0


def anchor(args: argparse.Namespace, i: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=offset_us(args, i))


def expected_ticks(args: argparse.Namespace, window: Window) -> set[tuple[str, int]]:
    """Every (sweep, tick) due in the window."""
    return {
        (f"bench-{i:04d}", tick)
        for i in range(args.sweeps)
        for tick in window.ticks(offset_us(args, i))
    }


# -- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    sweep: str
    tick_us: int
    at: float
    pid: int

    @property
    def lateness(self) -> float:
        return self.at - self.tick_us / 1e6


def read_runs(folder: Path) -> list[Run]:
    runs: list[Run] = []
    for path in sorted(folder.glob("runs-*.jsonl")):
        # Read while the replicas still write: a last line without its newline
        # is a write in progress, read again at the next settle.
        for line in path.read_text().split("\n")[:-1]:
            if line.strip():
                record = json.loads(line)
                runs.append(Run(record["sweep"], record["tick_us"], record["at"], record["pid"]))
    return runs


def tick_us_of(event: dict[str, Any]) -> int | None:
    value = event.get("tick")
    if not isinstance(value, str):
        return None
    return round(datetime.fromisoformat(value).timestamp() * 1_000_000)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(cell) for cell in cells])

    def text(self) -> str:
        widths = [
            max(len(row[i]) for row in [self.header, *self.rows]) for i in range(len(self.header))
        ]
        lines = [self.title]
        for row in [self.header, *self.rows]:
            lines.append(
                "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
            )
        return "\n".join([*lines, *self.notes])

    def markdown(self) -> str:
        lines = [f"**{self.title}**", ""]
        lines.append("| " + " | ".join(self.header) + " |")
        lines.append("|" + "|".join("---" for _ in self.header) + "|")
        lines.extend("| " + " | ".join(row) + " |" for row in self.rows)
        return "\n".join([*lines, *(f"\n{note}" for note in self.notes)])


@dataclass
class Window:
    start: float
    end: float
    interval_us: int

    def ticks(self, offset_us: int = 0) -> list[int]:
        """The ticks ``k * interval + offset_us`` in the window."""
        first = math.ceil((self.start * 1e6 - offset_us) / self.interval_us)
        last = math.ceil((self.end * 1e6 - offset_us) / self.interval_us)  # exclusive
        return [k * self.interval_us + offset_us for k in range(first, last)]


def plan_window(now: float, args: argparse.Namespace) -> Window:
    """Half an interval past the first tick after the warm-up: the edges fall between bursts,
    and every sweep has had its first claim ever (an INSERT, dearer) before the window."""
    interval = args.interval.total_seconds()
    start = (math.ceil((now + args.warmup) / interval) + 0.5) * interval
    return Window(start, start + args.seconds, args.interval // timedelta(microseconds=1))


def quiet_cpu(samples: list[Sample], busy: list[tuple[float, float]]) -> tuple[float, float, int]:
    """CPU seconds, wall seconds and wakeups over sample intervals that touch no busy span."""
    cpu = wall = 0.0
    wakeups = 0
    for first, last in itertools.pairwise(samples):
        if any(first.at < end and start < last.at for start, end in busy):
            continue
        cpu += last.cpu - first.cpu
        wall += last.at - first.at
        wakeups += switches_between(first, last)
    return cpu, wall, wakeups


# -- profiling ------------------------------------------------------------------------------


def start_profile(
    pid: int, seconds: float, folder: Path, gil: bool
) -> subprocess.Popen[bytes] | None:
    binary = shutil.which("py-spy")
    if binary is None:
        print("py-spy is not on PATH: no profile (pip install py-spy)", flush=True)
        return None
    folder.mkdir(parents=True, exist_ok=True)
    # --nonblocking: sample without stopping the replica, so its timing is what is measured.
    return subprocess.Popen(
        [
            binary,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, round(seconds))),
            "--nonblocking",
            "--threads",
            # --gil: only the thread holding the GIL, i.e. where the Python CPU goes.
            *(["--gil"] if gil else ["--idle"]),
            "--format",
            "raw",
            "--output",
            str(folder / "replica-0.collapsed"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def profile_summary(path: Path, top: int = 25) -> list[str]:
    """The frames with the most samples on the stack (inclusive), from collapsed stacks."""
    if not path.exists():
        return [f"no profile written at {path}"]
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
    lines = [f"py-spy samples: {total}", "inclusive:"]
    lines += [f"  {n / total:6.1%}  {frame}" for frame, n in inclusive.most_common(top)]
    lines += ["self:"]
    lines += [f"  {n / total:6.1%}  {frame}" for frame, n in own.most_common(top)]
    return lines


# -- one benchmark run ----------------------------------------------------------------------


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def server_version(url: str, dialect: str) -> str:
    if dialect == "sqlite":
        import sqlite3

        return f"SQLite {sqlite3.sqlite_version}"
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            value = str(connection.execute(text("SELECT version()")).scalar_one())
    finally:
        engine.dispose()
    return value.split(" on ", maxsplit=1)[0] if dialect == "postgresql" else f"MariaDB {value}"


def unsafe_async_commit(url: str) -> None:
    """``synchronous_commit = off`` for every new session of the benchmark database only.

    An experiment, never a fix: a commit then returns before its WAL is flushed, so a crash
    can lose a claim already reported won and a second replica could run the same tick. It
    shows how much of the time per tick is the flush.
    """
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            name = url.rsplit("/", 1)[1]
            connection.execute(text(f"ALTER DATABASE {name} SET synchronous_commit = off"))
    finally:
        engine.dispose()


def wait_until(instant: float) -> None:
    delay = instant - time.time()
    if delay > 0:
        time.sleep(delay)


def settle(folder: Path, window: Window, timeout: float) -> list[Run]:
    """The runs of the window's ticks, once no new one has appeared for two seconds."""
    deadline = time.monotonic() + timeout
    last_end = window.end * 1e6
    count, quiet_since = -1, time.monotonic()
    while True:
        runs = [run for run in read_runs(folder) if run.tick_us < last_end]
        if len(runs) != count:
            count, quiet_since = len(runs), time.monotonic()
        elif time.monotonic() - quiet_since >= 2.0 or time.monotonic() > deadline:
            return runs
        time.sleep(0.25)


def run_benchmark(args: argparse.Namespace) -> int:
    print(f"command: python benchmarks/replicas.py {' '.join(args.argv)}".rstrip())
    load_at_start = load()
    print(f"at start: {load_at_start}", flush=True)
    wall_started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sweepd-replicas-") as name:
        folder = Path(name)
        (folder / "runs").mkdir()
        (folder / "bench_sweeps.py").write_text(SWEEP_MODULE)
        if args.db_threads is not None:
            hook = EXECUTOR_HOOK.replace("{workers}", str(args.db_threads))
            (folder / "sitecustomize.py").write_text(hook)
        with bench_database(args.dialect, folder) as url:
            version = server_version(url, args.dialect)
            print(f"database: {version}", flush=True)
            if args.unsafe_async_commit:
                unsafe_async_commit(url)
            counters = ServerCounters(args.dialect, url)
            config = write_config(folder, url, args)
            replicas = [
                Replica(i, config, folder / f"replica-{i}.log", replica_env(folder))
                for i in range(args.replicas)
            ]
            try:
                result = measure(args, folder, replicas, counters)
            finally:
                for replica in replicas:
                    replica.kill()
                counters.close()
    result.load_at_start = load_at_start
    result.load_at_end = load()
    result.version = version
    result.took = time.perf_counter() - wall_started
    report(args, result)
    if args.json is not None:
        with args.json.open("a") as out:
            out.write(json.dumps(figures(args, result)) + "\n")
    return 0


@dataclass
class Result:
    window: Window
    runs: list[Run]
    claims: list[dict[str, Any]]
    phases: dict[tuple[str, int], dict[str, float]]  # (sweep, tick) -> event -> time
    skips: Counter[str]
    stats: list[dict[str, Any]]
    exit_codes: list[int | None]
    first: dict[int, Sample]
    last: dict[int, Sample]
    samples: dict[int, list[Sample]]
    pids: list[int]
    server: Counter[str]
    server_total: Counter[str]
    startup_seconds: float
    profile: list[str]
    errors: list[dict[str, Any]]
    machine_busy: float
    machine_idle: float
    server_cpu: float
    activity: Counter[str]
    load_at_start: str = ""
    load_at_end: str = ""
    version: str = ""
    took: float = 0.0


def measure(
    args: argparse.Namespace, folder: Path, replicas: list[Replica], counters: ServerCounters
) -> Result:
    launched = time.perf_counter()
    for replica in replicas:
        replica.start()
    deadline = time.monotonic() + 120
    while not all(replica.started() for replica in replicas):
        dead = [replica for replica in replicas if not replica.alive()]
        if dead or time.monotonic() > deadline:
            tail = dead[0].log_path.read_text()[-2000:] if dead else ""
            raise RuntimeError(f"a replica did not start: {tail}")
        time.sleep(0.1)
    startup = time.perf_counter() - launched
    window = plan_window(time.time(), args)
    print(
        f"{len(replicas)} replicas started in {startup:.1f} s; window"
        f" {datetime.fromtimestamp(window.start).time()} + {args.seconds:g} s ({load()})",
        flush=True,
    )
    wait_until(window.start)
    counts_before = counters.read()
    busy_before = machine_busy()
    postmaster = counters.server_process()
    server_before = server_cpu(postmaster)
    activity: Counter[str] = Counter()
    stop_activity = threading.Event()
    sampler = threading.Thread(
        target=counters.activity, args=(stop_activity, ACTIVITY_SECONDS, activity), daemon=True
    )
    sampler.start()
    first = {replica.index: sample(replica.pid) for replica in replicas}
    samples = {index: [value] for index, value in first.items()}
    profiler = (
        start_profile(replicas[0].pid, args.seconds, args.profile, args.profile_gil)
        if args.profile is not None
        else None
    )
    next_sample = window.start + SAMPLE_SECONDS
    while next_sample < window.end:
        wait_until(next_sample)
        for replica in replicas:
            samples[replica.index].append(sample(replica.pid))
        next_sample += SAMPLE_SECONDS
    wait_until(window.end)
    counts_after = counters.read()
    last = {replica.index: sample(replica.pid) for replica in replicas}
    busy_after = machine_busy()
    server_after = server_cpu(postmaster)
    stop_activity.set()
    sampler.join(timeout=10)
    for replica in replicas:
        samples[replica.index].append(last[replica.index])
    print(f"window over ({load()}); waiting for its last runs", flush=True)
    runs = settle(folder / "runs", window, timeout=max(30.0, args.interval.total_seconds() * 2))
    profile: list[str] = []
    if profiler is not None:
        try:
            profiler.wait(timeout=60)
        except subprocess.TimeoutExpired:
            profiler.kill()
            profiler.wait(timeout=10)
        assert args.profile is not None
        profile = profile_summary(args.profile / "replica-0.collapsed")
    exit_codes = [replica.stop() for replica in replicas]
    server_total = counters.read()  # every backend has exited and flushed its counters
    claims: list[dict[str, Any]] = []
    phases: dict[tuple[str, int], dict[str, float]] = {}
    skips: Counter[str] = Counter()
    stats: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    in_window = expected_ticks(args, window)
    for replica in replicas:
        for event in replica.events():
            name = event.get("event")
            if name == "daemon.stopped":
                stats.append(dict(event.get("stats", {})))
            if event.get("level") in ("error", "critical"):
                errors.append(event)
            if (event.get("sweep"), tick_us_of(event)) not in in_window:
                continue
            if name == "tick.claimed":
                claims.append(event)
            if name in ("tick.claimed", "run.finished"):
                phases.setdefault((str(event.get("sweep")), tick_us_of(event) or 0), {})[
                    str(name)
                ] = datetime.fromisoformat(str(event["timestamp"])).timestamp()
            elif name == "tick.skipped":
                skips[str(event.get("reason"))] += 1
    return Result(
        window=window,
        runs=runs,
        claims=claims,
        phases=phases,
        skips=skips,
        stats=stats,
        exit_codes=exit_codes,
        first=first,
        last=last,
        samples=samples,
        pids=[replica.pid for replica in replicas],
        server=Counter({key: counts_after[key] - counts_before[key] for key in counts_after}),
        server_total=server_total,
        startup_seconds=startup,
        profile=profile,
        errors=errors,
        machine_busy=busy_after[0] - busy_before[0],
        machine_idle=busy_after[1] - busy_before[1],
        server_cpu=server_after - server_before,
        activity=activity,
    )


# -- the report -----------------------------------------------------------------------------


def tally(
    args: argparse.Namespace, result: Result
) -> tuple[set[tuple[str, int]], list[Run], Counter[tuple[str, int]], int, int]:
    """The window's ticks: expected, their runs, runs per tick, duplicated, missed."""
    expected = expected_ticks(args, result.window)
    runs = [run for run in result.runs if (run.sweep, run.tick_us) in expected]
    count = Counter((run.sweep, run.tick_us) for run in runs)
    duplicated = sum(n - 1 for n in count.values() if n > 1)
    return expected, runs, count, duplicated, len(expected - count.keys())


def report(args: argparse.Namespace, result: Result) -> None:
    window = result.window
    ticks = window.ticks()
    expected, runs, count, duplicated, missed = tally(args, result)
    lateness = [run.lateness for run in runs]
    claimed = [
        float(event["lateness"]) for event in result.claims if event.get("lateness") is not None
    ]
    concurrency = args.concurrency if args.concurrency is not None else "4 (default)"
    mode = "idle" if args.idle else "replicas"
    title = (
        f"{mode}: {args.replicas} replica(s) x {args.sweeps} sweeps every"
        f" {format_duration(args.interval)}, {args.seconds:g} s window, {args.dialect},"
        f" concurrency {concurrency}, {'async' if args.run_async else 'sync'} sweep"
        + (", ticks spread over the interval" if args.spread else "")
        + (", synchronous_commit=off (unsafe)" if args.unsafe_async_commit else "")
        + (f", {args.db_threads} database threads (patched)" if args.db_threads is not None else "")
    )
    ticks_table = Table(
        f"Ticks ({title})",
        ["expected", "run", "duplicated", "missed", "skips logged in window"],
    )
    ticks_table.add(
        len(expected),
        len(count),
        duplicated,
        missed,
        ", ".join(f"{reason} {n}" for reason, n in sorted(result.skips.items())) or "none",
    )
    late_table = Table(
        "Tick lateness (ms)",
        ["measured at", "samples", "p50", "p90", "p99", "max"],
    )
    # A queue that keeps up looks the same at both ends of the window; one that grows does not.
    # By the time of the tick, so that spread ticks fall in the same thirds as aligned ones.
    third = len(ticks) // 3
    early_end = (window.start + third * args.interval.total_seconds()) * 1e6
    late_start = (window.end - third * args.interval.total_seconds()) * 1e6
    rows = [
        ("run start (sweep's own time.time() - tick)", lateness),
        ("tick.claimed event (its lateness field)", claimed),
    ]
    if third and len(ticks) >= 6:
        rows += [
            (
                "run start, ticks of the window's first third",
                [run.lateness for run in runs if run.tick_us < early_end],
            ),
            (
                "run start, ticks of the window's last third",
                [run.lateness for run in runs if run.tick_us >= late_start],
            ),
        ]
    for label, values in rows:
        late_table.add(
            label,
            len(values),
            ms(percentile(values, 0.5)),
            ms(percentile(values, 0.9)),
            ms(percentile(values, 0.99)),
            ms(max(values) if values else math.nan),
        )
    phase_table = phases_table(runs, result.phases)
    seconds = window.end - window.start
    busy = burst_spans(runs, sorted({tick for _, tick in expected}))
    process_table = Table(
        "Per replica (the window; CPU is user + sys)",
        [
            "replica",
            "runs",
            "CPU s",
            "% of a core",
            "CPU s between bursts",
            "% between bursts",
            "wakeups between bursts",
            "wakeups in window",
            "CPU s since start",
            "peak RSS MiB",
            "threads",
        ],
    )
    runs_by_pid = Counter(run.pid for run in runs)
    for index, pid in enumerate(result.pids):
        first, last = result.first[index], result.last[index]
        cpu = last.cpu - first.cpu
        quiet, quiet_wall, quiet_wakeups = quiet_cpu(result.samples[index], busy)
        process_table.add(
            index,
            runs_by_pid[pid],
            f"{cpu:.2f}",
            f"{cpu / seconds:.1%}",
            f"{quiet:.2f} of {quiet_wall:.0f} s" if quiet_wall else "-",
            f"{quiet / quiet_wall:.2%}" if quiet_wall else "-",
            f"{quiet_wakeups} ({quiet_wakeups / quiet_wall:.2f}/s)" if quiet_wall else "-",
            switches_between(first, last),
            f"{last.cpu:.2f}",
            f"{last.hwm_kib / 1024:.1f}",
            last.threads,
        )
    process_table.notes.append(
        "Bursts: from each tick to 0.5 s after the last run of it started; the sample intervals"
        f" ({SAMPLE_SECONDS:g} s) that touch none are 'between bursts'. Wakeups are voluntary"
        " context switches of the threads alive at both ends of an interval."
    )
    replicas_cpu = sum(result.last[i].cpu - result.first[i].cpu for i in range(len(result.pids)))
    mariadb = args.dialect == "mariadb"
    cpu_table = Table(
        "Where the machine's CPU went in the window (cores busy on average)",
        [
            "whole machine",
            "replicas",
            "MariaDB server" if mariadb else "PostgreSQL server",
            "everything else",
        ],
    )
    server = result.server_cpu
    cpu_table.add(
        f"{result.machine_busy / seconds:.2f} of {os.cpu_count()}",
        f"{replicas_cpu / seconds:.2f}",
        "-" if math.isnan(server) else f"{server / seconds:.2f}",
        f"{(result.machine_busy - replicas_cpu - (0 if math.isnan(server) else server)) / seconds:.2f}",
    )
    cpu_table.notes.append(
        (
            "MariaDB server: the mariadbd process, all its threads"
            if mariadb
            else "PostgreSQL server: the postmaster and all its processes, exited backends included"
        )
        + " (every database on the server, so other users' queries count too)."
    )
    tables = [ticks_table, late_table, phase_table, process_table, cpu_table]
    if result.activity:
        samples = result.activity.pop("(samples)", 0)
        activity_table = Table(
            f"What the benchmark database's backends were doing ({samples} samples of"
            f" pg_stat_activity, every {ACTIVITY_SECONDS * 1e3:g} ms)",
            ["state", "backends on average", "share"],
        )
        total = sum(result.activity.values())
        for state, n in result.activity.most_common():
            activity_table.add(state, f"{n / samples:.2f}", f"{n / total:.1%}")
        tables.append(activity_table)
    sql = sql_table(args, result, len(ticks), len(count))
    if sql is not None:
        tables.append(sql)
    stats: Counter[str] = Counter()
    for one in result.stats:
        stats.update({key: int(value) for key, value in one.items()})
    facts = [
        f"at start: {result.load_at_start}; at end: {result.load_at_end};"
        f" took {result.took:.0f} s; replicas up in {result.startup_seconds:.1f} s",
        f"exit codes: {result.exit_codes}",
        "daemon.stopped stats, summed (whole life): "
        + ", ".join(f"{key} {value}" for key, value in sorted(stats.items())),
        f"error events: {len(result.errors)}"
        + (f" (first: {json.dumps(result.errors[0])[:300]})" if result.errors else ""),
        *machine_facts(result.version),
    ]
    verdicts = [
        f"zero duplicates: {'yes' if duplicated == 0 else 'NO'} ({duplicated});"
        f" zero misses: {'yes' if missed == 0 else 'NO'} ({missed})",
        f"lateness p99 < 50 ms: {'yes' if percentile(lateness, 0.99) < 0.05 else 'NO'}"
        f" ({ms(percentile(lateness, 0.99))} ms)",
    ]
    if args.idle:
        index = 0
        cpu = result.last[index].cpu - result.first[index].cpu
        verdicts.append(
            f"CPU < 1 % of a core: {'yes' if cpu / seconds < 0.01 else 'NO'}"
            f" ({cpu / seconds:.2%} over the window)"
        )
    print()
    for table in tables:
        print(table.text(), end="\n\n")
    print("\n".join(facts), end="\n\n")
    print("\n".join(verdicts), end="\n\n")
    if result.profile:
        print("\n".join(result.profile), end="\n\n")
    print("-- markdown --\n")
    for table in tables:
        print(table.markdown(), end="\n\n")


def phases_table(runs: list[Run], phases: dict[tuple[str, int], dict[str, float]]) -> Table:
    """Where a won tick's time goes, from the log's timestamps and the sweep's own line."""
    # run.started is a debug line for a first attempt (tick.claimed says the run starts), so
    # the loop's share and the thread hand-off are one phase here.
    steps: dict[str, list[float]] = {
        "tick -> tick.claimed (slot wait + claim, stale check, run row)": [],
        "tick.claimed -> sweep's first line (the loop, thread hand-off)": [],
        "sweep's first line -> run.finished (sweep + finish and release)": [],
    }
    labels = list(steps)
    for run in runs:
        seen = phases.get((run.sweep, run.tick_us), {})
        claimed, finished = seen.get("tick.claimed"), seen.get("run.finished")
        if claimed is None or finished is None:
            continue
        steps[labels[0]].append(claimed - run.tick_us / 1e6)
        steps[labels[1]].append(run.at - claimed)
        steps[labels[2]].append(finished - run.at)
    table = Table(
        "Phases of a run (ms; log timestamps, taken on the replica's event loop)",
        ["phase", "runs", "p50", "p90", "p99", "mean"],
    )
    for label, values in steps.items():
        table.add(
            label,
            len(values),
            ms(percentile(values, 0.5)),
            ms(percentile(values, 0.9)),
            ms(percentile(values, 0.99)),
            ms(sum(values) / len(values) if values else math.nan),
        )
    return table


def burst_spans(runs: list[Run], ticks: list[int]) -> list[tuple[float, float]]:
    last_start: dict[int, float] = {}
    for run in runs:
        last_start[run.tick_us] = max(last_start.get(run.tick_us, 0.0), run.at)
    return [
        (tick / 1e6 - 0.05, max(last_start.get(tick, tick / 1e6), tick / 1e6) + 0.5)
        for tick in ticks
    ]


def _per_run_whole_life(result: Result, counter: str | None) -> float | None:
    """The SQL counter over every run of the replicas' lives (their stats at exit)."""
    runs = sum(int(one.get("ticks_claimed", 0)) for one in result.stats)
    return result.server_total[counter] / runs if counter and runs else None


def sql_table(args: argparse.Namespace, result: Result, ticks: int, run: int) -> Table | None:
    server = result.server
    if args.dialect == "postgresql":
        table = Table(
            "SQL per tick (PostgreSQL pg_stat_database of the benchmark database, over the window)",
            ["counter", "window", "per tick run", "whole life"],
        )
        for key in ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "sessions"):
            table.add(
                key,
                server[key],
                f"{server[key] / run:.2f}" if run else "-",
                result.server_total[key],
            )
        table.notes.append(
            "xact_commit counts every autocommit statement and every pool ping (each is its own"
            " transaction). The window's figures lag by a second or more at each edge (a busy"
            " backend may put off publishing them for up to a minute, so under load they"
            " undercount); 'whole life' is read after every replica exited (migration not"
            " included)."
        )
        return table
    if args.dialect == "mariadb":
        table = Table(
            "SQL per tick (MariaDB SHOW GLOBAL STATUS deltas over the window: server-wide)",
            ["counter", "window", "per tick run"],
        )
        for key in MARIADB_COUNTERS:
            table.add(key, server[key], f"{server[key] / run:.2f}" if run else "-")
        table.notes.append(
            "Global counters: other clients of the server are counted too, so this is an upper"
            " bound; prefer PostgreSQL for this figure."
        )
        return table
    return None


def burst_drains(runs: list[Run]) -> list[float]:
    """Per tick, its first run's start to its last one's: how long an aligned burst takes."""
    starts: dict[int, list[float]] = {}
    for run in runs:
        starts.setdefault(run.tick_us, []).append(run.at)
    return [max(at) - min(at) for at in starts.values()]


def finite(value: float) -> float | None:
    return None if math.isnan(value) else value


def figures(args: argparse.Namespace, result: Result) -> dict[str, Any]:
    """The report's main figures as one JSON object (--json); a figure not measured is null."""
    expected, runs, count, duplicated, missed = tally(args, result)
    lateness = [run.lateness for run in runs]
    cpu = [result.last[i].cpu - result.first[i].cpu for i in range(len(result.pids))]
    # SQLite has no server: its work is inside the replicas' CPU.
    db_cpu = 0.0 if args.dialect == "sqlite" else finite(result.server_cpu)
    sql = SQL_COUNTER.get(args.dialect)

    def per_run_ms(seconds: float | None) -> float | None:
        return seconds / len(runs) * 1e3 if runs and seconds is not None else None

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {
            "dialect": args.dialect,
            "replicas": args.replicas,
            "sweeps": args.sweeps,
            "interval_s": args.interval.total_seconds(),
            "spread": args.spread,
            "concurrency": args.concurrency,  # null: sweepd's own default
            "seconds": args.seconds,
            "cores": os.cpu_count(),
        },
        "results": {
            "expected": len(expected),
            "run": len(count),
            "duplicated": duplicated,
            "missed": missed,
            **{
                f"lateness_p{q}_ms": finite(percentile(lateness, q / 100) * 1e3)
                for q in (50, 90, 99)
            },
            "cpu_s": cpu,
            "cpu_s_total": sum(cpu),
            "db_cpu_s": db_cpu,
            "machine_busy_s": result.machine_busy,
            "peak_rss_mib": [result.last[i].hwm_kib / 1024 for i in range(len(result.pids))],
            "sql_counter": sql,
            "sql_per_tick": result.server[sql] / len(count) if sql and count else None,
            # The window's counter undercounts under load: a busy PostgreSQL backend
            # may put off publishing its statistics for up to a minute. Read after
            # every replica exited, the whole life's count is complete.
            "sql_per_run_whole_life": _per_run_whole_life(result, sql),
            "burst_drain_p50_ms": None
            if args.spread
            else finite(percentile(burst_drains(runs), 0.5) * 1e3),
            "errors": len(result.errors),
            "took_s": result.took,
        },
        "derived": {
            "cpu_per_run_ms": {
                "replica": per_run_ms(sum(cpu)),
                "db": per_run_ms(db_cpu),
                "total": per_run_ms(None if db_cpu is None else sum(cpu) + db_cpu),
            },
        },
    }


def machine_facts(version: str) -> list[str]:
    model = "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            model = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in cpuinfo
                    if line.startswith("model name")
                ),
                "?",
            )
    except OSError:
        pass
    packages = ", ".join(
        f"{name} {metadata.version(name)}"
        for name in ("sweepd", "SQLAlchemy", "psycopg", "PyMySQL", "structlog")
    )
    return [
        f"CPU: {model}, {os.cpu_count()} cores (nproc: {len(os.sched_getaffinity(0))})",
        f"OS: {platform.platform()}",
        f"Python {platform.python_version()} ({platform.python_implementation()}); {packages}",
        f"database: {version}",
    ]


# -- main -----------------------------------------------------------------------------------


def duration(value: str) -> timedelta:
    try:
        parsed = parse_duration(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if parsed <= timedelta(0):
        raise argparse.ArgumentTypeError("the interval must be above zero")
    return parsed


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dialect", choices=DIALECTS, default="postgresql")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--sweeps", type=int, default=200)
    parser.add_argument("--interval", type=duration, default=timedelta(seconds=1))
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument(
        "--warmup", type=float, default=3.0, help="seconds after every replica started"
    )
    parser.add_argument(
        "--concurrency", type=int, help="the config's concurrency (default: sweepd's own)"
    )
    parser.add_argument("--async", dest="run_async", action="store_true", help="an async sweep")
    parser.add_argument(
        "--spread",
        action="store_true",
        help="sweep i anchored i/sweeps of an interval in: ticks evenly apart, not one burst",
    )
    parser.add_argument(
        "--health",
        action="store_true",
        help="the replicas serve /healthz, /readyz and /metrics (default: off)",
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="one replica, 1,000 sweeps every minute (overrides --replicas/--sweeps/--interval)",
    )
    parser.add_argument(
        "--db-threads",
        type=int,
        help="experiment: the bound on the replicas' database threads (patched in)",
    )
    parser.add_argument(
        "--json", type=Path, help="append this run's figures to this file, one JSON line"
    )
    parser.add_argument("--profile", type=Path, help="py-spy record replica 0 into this folder")
    parser.add_argument(
        "--profile-wall",
        dest="profile_gil",
        action="store_false",
        help="profile every thread, idle ones too (default: only the thread holding the GIL)",
    )
    parser.add_argument(
        "--unsafe-async-commit",
        action="store_true",
        help="PostgreSQL experiment: synchronous_commit=off on the benchmark database",
    )
    args = parser.parse_args(argv)
    if args.idle:
        args.replicas, args.sweeps, args.interval = 1, 1000, timedelta(minutes=1)
    if args.unsafe_async_commit and args.dialect != "postgresql":
        parser.error("--unsafe-async-commit is for PostgreSQL only")
    args.argv = argv
    return args


def main(argv: list[str]) -> int:
    return run_benchmark(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
