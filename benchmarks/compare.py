"""Side by side: one periodic workload through sweepd and through what a team
would use instead, on one PostgreSQL, in one sitting.

R replicas of each system run S sweeps every I seconds for D seconds; every
run's body (``compare/record.py``) writes a row as it starts, sleeps for its
body time and marks the row finished, so what ran, where and when is read
back from one table, the same way for every system. The systems, each a
runner script in ``compare/``:

- ``sweepd``: ``sweepd run`` with a generated config and its defaults.
- ``uncoordinated``: every replica runs every schedule (a crontab line or a
  timer on every host).
- ``apscheduler3``: APScheduler 3.x with a shared SQLAlchemy job store.
- ``apscheduler4``: APScheduler 4 (a pre-release) with its PostgreSQL data store.
- ``procrastinate``: procrastinate's periodic tasks.

Each alternative is installed in a virtualenv of its own under
``~/.cache/sweepd-compare`` (made on first use, pinned versions below). Three
scenarios: ``basic`` (runs far shorter than the interval), ``long`` (sweep-0
runs for 1.5 intervals) and ``kill`` (SIGKILL of the replica with the most runs,
half way through; runs of half an interval, so it dies with runs in flight).

Usage:
    python benchmarks/compare.py --replicas 3 --sweeps 20 --interval 1s --seconds 30
        [--scenario basic|long|kill|all] [--systems sweepd,uncoordinated,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import replicas  # the sibling benchmark: /proc readings, percentiles, tables

from sweepd.durations import parse_duration

HERE = Path(__file__).resolve().parent
RUNNERS = HERE / "compare"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sweepd-compare"
SERVER = os.environ.get("SWEEPD_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
PSYCOPG = "psycopg[binary]==3.3.9"
# Each alternative's virtualenv: what pip installs into it. sweepd and the
# baseline run in this process's own environment.
SYSTEMS: dict[str, tuple[str, list[str] | None]] = {
    "sweepd": ("sweepd_runner.py", None),
    "uncoordinated": ("uncoordinated.py", None),
    "apscheduler3": ("apscheduler3.py", ["apscheduler==3.11.3", "sqlalchemy==2.1.9", PSYCOPG]),
    # 4.0.0a6 imports sniffio without declaring it.
    "apscheduler4": (
        "apscheduler4.py",
        [
            "apscheduler[sqlalchemy]==4.0.0a6",
            "sqlalchemy[asyncio]==2.0.59",
            "sniffio==1.3.1",
            PSYCOPG,
        ],
    ),
    "procrastinate": ("procrastinate_runner.py", ["procrastinate==3.10.0", PSYCOPG]),
}
SCENARIOS = ("basic", "long", "kill")
READY_SECONDS = 90.0
WARMUP_SECONDS = 3.0
STOP_SECONDS = 15.0


@dataclass
class Scenario:
    name: str
    body: float  # seconds, every sweep's run
    long: float | None  # seconds, sweep-0's run, when it is longer than the interval
    kill: bool


def scenario(name: str, interval: float) -> Scenario:
    if name == "long":
        return Scenario(name, 0.05, 1.5 * interval, kill=False)
    if name == "kill":
        return Scenario(name, 0.5 * interval, None, kill=True)
    return Scenario(name, 0.05, None, kill=False)


# -- environments and databases ---------------------------------------------------------


def python_for(system: str) -> str:
    """The interpreter of the system's own virtualenv, made (once) if missing."""
    requirements = SYSTEMS[system][1]
    if requirements is None:
        return sys.executable
    venv = CACHE / system
    marker = venv / "requirements.txt"
    wanted = "\n".join(requirements) + "\n"
    if not marker.exists() or marker.read_text() != wanted:
        print(f"installing {system} into {venv} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, *requirements], check=True)
        marker.write_text(wanted)
    return str(venv / "bin" / "python")


@contextmanager
def fresh_database() -> Iterator[str]:
    name = f"sweepd_compare_{secrets.token_hex(4)}"
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    url = SERVER.rsplit("/", 1)[0] + f"/{name}"
    try:
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute(_record_table())
        yield url
    finally:
        with psycopg.connect(SERVER, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def _record_table() -> str:
    sys.path.insert(0, str(RUNNERS))
    import record  # the runners' own module; psycopg is all it needs

    return str(record.TABLE)


def commits(url: str) -> int:
    """Transactions committed in the database so far: every autocommit statement
    and every explicit transaction (pg_stat_database; pg_stat_statements is not
    loaded on a default server)."""
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute("SELECT pg_stat_clear_snapshot()")
        row = connection.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


# -- the replicas -----------------------------------------------------------------------


@dataclass
class Replica:
    index: int
    process: subprocess.Popen[bytes]
    log: Path

    def ready(self) -> bool:
        text = self.log.read_text(errors="replace")
        return "ready" in text.splitlines() or '"daemon.started"' in text


def start(system: str, python: str, url: str, args: argparse.Namespace, plan: Scenario,
          folder: Path, index: int | None) -> Replica | None:  # fmt: skip
    """One replica, or (``index`` None) the system's set-up, run to its end."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWEEPD_")}
    env.update(
        COMPARE_URL=url,
        COMPARE_SYSTEM=system,
        COMPARE_REPLICA=str(index or 0),
        COMPARE_SWEEPS=str(args.sweeps),
        COMPARE_INTERVAL=f"{args.interval:g}",
        COMPARE_BODY=f"{plan.body:g}",
    )
    if plan.long is not None:
        env["COMPARE_LONG"] = f"{plan.long:g}"
    script = [python, str(RUNNERS / SYSTEMS[system][0])]
    if index is None:
        subprocess.run([*script, "--setup"], env=env, check=True, timeout=120)
        return None
    log = folder / f"{system}-{index}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(script, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Replica(index, process, log)


def run_system(system: str, args: argparse.Namespace, plan: Scenario, folder: Path) -> Result:
    python = python_for(system)
    with fresh_database() as url:
        start(system, python, url, args, plan, folder, None)
        fleet = [start(system, python, url, args, plan, folder, i) for i in range(args.replicas)]
        replicas_ = [r for r in fleet if r is not None]
        try:
            return _measure(system, url, args, plan, replicas_)
        finally:
            for replica in replicas_:
                if replica.process.poll() is None:
                    replica.process.kill()
                    replica.process.wait()


def _measure(system: str, url: str, args: argparse.Namespace, plan: Scenario,
             fleet: list[Replica]) -> Result:  # fmt: skip
    deadline = time.monotonic() + READY_SECONDS
    while not all(replica.ready() for replica in fleet):
        if time.monotonic() > deadline or any(r.process.poll() is not None for r in fleet):
            raise SystemExit(f"{system}: a replica did not start; see {fleet[0].log.parent}")
        time.sleep(0.1)
    # The window starts on a tick, a warm-up after every replica is up.
    begin = math.ceil((time.time() + WARMUP_SECONDS) / args.interval) * args.interval
    end = begin + args.seconds
    replicas.wait_until(begin)
    cpu0 = {r.index: replicas.process_cpu(r.process.pid) or 0.0 for r in fleet}
    commits0 = commits(url)
    killed: tuple[int, float] | None = None
    if plan.kill:
        # A quarter interval after a tick: the victim dies with runs in flight.
        half = math.floor(args.seconds / 2 / args.interval)
        replicas.wait_until(begin + (half + 0.25) * args.interval)
        killed = _kill_busiest(url, system, fleet, begin)
    replicas.wait_until(end)
    commits1 = commits(url)
    cpu = {
        r.index: (replicas.process_cpu(r.process.pid) or math.nan) - cpu0[r.index] for r in fleet
    }
    hwm = {r.index: _peak_rss_mib(r.process.pid) for r in fleet}
    _stop(fleet)
    rows = _rows(url, system)
    with (args.out / f"runs-{system}-{plan.name}.jsonl").open("w") as out:
        out.writelines(json.dumps(asdict(run)) + "\n" for run in rows)
    return analyse(system, args, plan, rows, begin, end, killed, cpu, hwm, commits1 - commits0)


def _kill_busiest(url: str, system: str, fleet: list[Replica], since: float) -> tuple[int, float]:
    """SIGKILL the replica with the most runs in flight (then the most runs), now."""
    with psycopg.connect(url, autocommit=True) as connection:
        found = connection.execute(
            "SELECT replica FROM compare_runs WHERE system = %s AND started >= %s"
            " GROUP BY replica ORDER BY count(*) FILTER (WHERE finished IS NULL) DESC,"
            " count(*) DESC, replica LIMIT 1",
            (system, datetime.fromtimestamp(since, UTC)),
        ).fetchone()
    index = int(found[0]) if found else 0
    victim = next(r for r in fleet if r.index == index)
    at = time.time()
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    return index, at


def _peak_rss_mib(pid: int) -> float:
    try:
        return int(replicas.status_fields(f"/proc/{pid}/status")["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError):
        return math.nan  # killed


def _stop(fleet: list[Replica]) -> None:
    for replica in fleet:
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    for replica in fleet:
        try:
            replica.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()


@dataclass(frozen=True)
class Run:
    replica: int
    sweep: str
    tick: float  # seconds since the epoch
    started: float
    finished: float  # nan: never returned (killed in flight, or cut off at the stop)


def _rows(url: str, system: str) -> list[Run]:
    with psycopg.connect(url, autocommit=True) as connection:
        found = connection.execute(
            "SELECT replica, sweep, tick, started, finished FROM compare_runs WHERE system = %s",
            (system,),
        ).fetchall()

    def seconds(instant: datetime | None) -> float:
        return math.nan if instant is None else instant.timestamp()

    return [
        Run(replica, sweep, seconds(tick), s.timestamp(), seconds(f))
        for replica, sweep, tick, s, f in found
    ]


# -- what the rows say ------------------------------------------------------------------


@dataclass
class Result:
    system: str
    scenario: str
    replicas: int
    sweeps: int
    interval: float
    seconds: float
    expected: int  # ticks in the window: sweeps x ticks
    runs: int
    duplicates: int  # runs of a tick beyond its first
    cut: int  # runs that started and never returned (killed in flight, or running at the stop)
    coalesced: int  # ticks nobody ran while an earlier tick of the sweep was not run to its end
    # kill: ticks nobody ran between the kill and the sweep's first run after it,
    # while the survivors could not yet tell the victim's runs were gone
    missed_in_takeover: int
    missed: int  # ticks nobody ran otherwise
    overlaps: int  # pairs of runs of one sweep that ran at the same time
    lateness_p50_ms: float
    lateness_p99_ms: float
    cpu_s_per_replica: float  # over the window, user + sys, mean of the replicas
    peak_rss_mib: float  # the largest replica's
    commits_per_run: float  # database transactions per run, the recorder's own taken out
    takeover_s: float | None  # kill: until every sweep had started a run again


def tick_of(run: Run, interval: float) -> float:
    """The run's tick: the one its system gave, else the grid instant at or before its start."""
    if not math.isnan(run.tick):
        return run.tick
    return math.floor(run.started / interval + 1e-6) * interval


def analyse(system: str, args: argparse.Namespace, plan: Scenario, rows: list[Run],
            begin: float, end: float, killed: tuple[int, float] | None,
            cpu: dict[int, float], hwm: dict[int, float], commits: int) -> Result:  # fmt: skip
    interval = args.interval
    ticks = [begin + k * interval for k in range(round((end - begin) / interval))]
    names = [f"sweep-{i}" for i in range(args.sweeps)]
    inside = [r for r in rows if begin - 1e-6 <= tick_of(r, interval) < end - 1e-6]
    cut = sum(math.isnan(r.finished) for r in inside)
    recorder_commits = 2 * len(inside) - cut  # its row at the start, and at the end
    # A run that never returned was in progress until its replica died, or until the stop.
    rows = [replace(r, finished=_cut_at(r, killed, end)) if math.isnan(r.finished) else r
            for r in rows]  # fmt: skip
    inside = [r for r in rows if begin - 1e-6 <= tick_of(r, interval) < end - 1e-6]
    by_tick = Counter((r.sweep, round(tick_of(r, interval) / interval)) for r in inside)
    runs_of: dict[str, list[Run]] = defaultdict(list)
    for run in rows:
        runs_of[run.sweep].append(run)
    back = {} if killed is None else _back_after(runs_of, names, killed[1])
    coalesced = missed = in_takeover = 0
    for name in names:
        for tick in ticks:
            if by_tick[(name, round(tick / interval))]:
                continue
            # Busy from a run's tick, not its start: a tick that comes while the
            # previous one waits for its run (queued behind the one before) is
            # folded by single-flight as much as one that comes mid-run.
            if any(tick_of(r, interval) <= tick < r.finished for r in runs_of[name]):
                coalesced += 1
            elif killed is not None and killed[1] <= tick < back[name]:
                in_takeover += 1
            else:
                missed += 1
    lateness = [r.started - tick_of(r, interval) for r in inside]
    live = [v for v in cpu.values() if not math.isnan(v)]
    return Result(
        system=system,
        scenario=plan.name,
        replicas=args.replicas,
        sweeps=args.sweeps,
        interval=interval,
        seconds=args.seconds,
        expected=len(ticks) * len(names),
        runs=len(inside),
        cut=cut,
        duplicates=sum(count - 1 for count in by_tick.values()),
        coalesced=coalesced,
        missed_in_takeover=in_takeover,
        missed=missed,
        overlaps=_overlaps(inside),
        lateness_p50_ms=replicas.percentile(lateness, 0.5) * 1e3,
        lateness_p99_ms=replicas.percentile(lateness, 0.99) * 1e3,
        cpu_s_per_replica=sum(live) / len(live) if live else math.nan,
        peak_rss_mib=max((v for v in hwm.values() if not math.isnan(v)), default=math.nan),
        commits_per_run=(commits - recorder_commits) / len(inside) if inside else math.nan,
        takeover_s=None if killed is None else max(back.values(), default=0.0) - killed[1],
    )


def _cut_at(run: Run, killed: tuple[int, float] | None, end: float) -> float:
    """When a run that never returned stopped: its replica's death, else the window's end."""
    return killed[1] if killed is not None and run.replica == killed[0] else end


def _back_after(runs_of: dict[str, list[Run]], names: list[str], at: float) -> dict[str, float]:
    """Per sweep, when its first run after the kill started (inf: none did). The
    sweeps whose run died with the replica are the last: until their leases,
    locks or jobs time out, nobody can tell a dead holder from a slow one."""
    return {
        name: min((r.started for r in runs_of[name] if r.started >= at), default=math.inf)
        for name in names
    }


def _overlaps(runs: list[Run]) -> int:
    """Runs of a sweep that started before its previous run (by start) had finished."""
    by_sweep: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_sweep[run.sweep].append(run)
    return sum(
        b.started < a.finished - 1e-3
        for sweep_runs in by_sweep.values()
        for a, b in itertools.pairwise(sorted(sweep_runs, key=lambda r: r.started))
    )


# -- output -----------------------------------------------------------------------------


def table(results: list[Result]) -> replicas.Table:
    out = replicas.Table(
        "compare",
        ["scenario", "system", "runs / expected", "cut", "duplicates", "coalesced",
         "missed in takeover", "missed", "self-overlaps", "lateness p50 / p99 (ms)",
         "CPU s / replica", "peak RSS MiB", "commits / run", "takeover s"],
    )  # fmt: skip
    for r in results:
        out.add(
            r.scenario, r.system, f"{r.runs} / {r.expected}", r.cut, r.duplicates, r.coalesced,
            r.missed_in_takeover, r.missed, r.overlaps,
            f"{r.lateness_p50_ms:.1f} / {r.lateness_p99_ms:.1f}",
            f"{r.cpu_s_per_replica:.2f}", f"{r.peak_rss_mib:.0f}", f"{r.commits_per_run:.2f}",
            "-" if r.takeover_s is None else f"{r.takeover_s:.1f}",
        )  # fmt: skip
    return out


def plot(results: list[Result], folder: Path) -> None:
    """PNG charts of the results, drawn by matplotlib in a virtualenv of its own."""
    venv = CACHE / "plots"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "matplotlib==3.10.8"]
        subprocess.run(pip, check=True)
    data = folder / "results.json"
    data.write_text(json.dumps([asdict(r) for r in results]))
    subprocess.run([str(venv / "bin" / "python"), str(RUNNERS / "plots.py"), str(data)], check=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--sweeps", type=int, default=20)
    parser.add_argument("--interval", type=lambda v: parse_duration(v).total_seconds(), default=1.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="basic")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", type=Path, default=Path("compare-results"))
    args = parser.parse_args(argv)
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    results: list[Result] = []
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for name in names:
        for system in args.systems:
            print(f"{name}: {system} ...", file=sys.stderr, flush=True)
            result = run_system(system, args, scenario(name, args.interval), args.out)
            results.append(result)
            with (args.out / "results.jsonl").open("a") as lines:
                lines.write(json.dumps({"date": stamp, **asdict(result)}) + "\n")
    report = table(results)
    print(f"`python benchmarks/compare.py {' '.join(argv)}` ({stamp}, {replicas.load()})\n")
    print(report.markdown())
    plot(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
