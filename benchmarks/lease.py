"""How fast the lease store claims and releases, and what each step sends, as shipped.

    python benchmarks/lease.py [--dialect all|sqlite|postgresql|mariadb] [--seconds 5] [--batches-only]

Each dialect gets a fresh database (a SQLite file in a temporary folder, or
``sweepd_bench_<random>`` on the server), brought to head by
``sweepd.db.migrate.upgrade`` and dropped at the end. Claimers are spawned OS
processes, each with its own ``make_engine(url)`` and ``LeaseStore``, so the GIL
does not serialise them. Prints markdown tables on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import secrets
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib import metadata
from multiprocessing import get_context
from typing import Any

from sqlalchemy import Engine, create_engine, event, text

from sweepd.db import migrate
from sweepd.db.engine import PING_IDLE_SECONDS, make_engine
from sweepd.history import History
from sweepd.lease import LeaseStore, Lost, StoreError, Won, make_holder
from sweepd.model import SweepDef
from sweepd.schedule import Every
from sweepd.store import Ask, Hand, Opened, tick_store

DIALECTS = ("sqlite", "postgresql", "mariadb")
SERVERS = {
    "postgresql": os.environ.get(
        "SWEEPD_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    "mariadb": os.environ.get("SWEEPD_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test"),
}
NAMESPACE = "bench"
TTL = timedelta(minutes=5)
BASE_TICK = datetime(2020, 1, 1, tzinfo=UTC)
TICK = timedelta(seconds=1)  # whole seconds: exact in every dialect's column type
WARMUP = 1.0  # seconds per run before measuring: connections made, statements prepared
CLAIMERS = (1, 8)
IDLE_GAP = PING_IDLE_SECONDS + 0.2  # long enough for the idle ping to fire
STEP_RUNS = (("back-to-back", 0.0, 20), (f"after {IDLE_GAP:g} s idle", IDLE_GAP, 2))


def tick_of(k: int) -> datetime:
    return BASE_TICK + k * TICK


# -- one claimer, in its own process ---------------------------------------------------------


@dataclass(frozen=True)
class Job:
    url: str
    name: str  # a name of its own (own mode) or the same for all (contended)
    start_at: float  # time.time(): warm up until then, measure until end_at
    end_at: float


@dataclass
class Sample:
    claim_ns: list[int] = field(default_factory=list)  # every claim attempt
    release_ns: list[int] = field(default_factory=list)
    pair_ns: list[int] = field(default_factory=list)  # a won claim plus its release
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # distinct StoreError messages
    won_ticks: list[int] = field(default_factory=list)  # warm-up included, for the twice check
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0


def claimer(job: Job) -> Sample:
    """Claim the next tick, release at once on a win; on a loss move past the row's tick."""
    engine = make_engine(job.url)
    store = LeaseStore(engine, NAMESPACE)
    holder = make_holder()
    k = 1

    def attempt(sample: Sample) -> None:
        nonlocal k
        t0 = time.perf_counter_ns()
        try:
            outcome = store.claim(job.name, holder, TTL, tick_of(k))
        except StoreError as error:
            # Counted and reported, not fatal: a fault under load is a finding.
            sample.outcomes["store error"] += 1
            if str(error) not in sample.errors:
                sample.errors.append(str(error))
            return
        t1 = time.perf_counter_ns()
        sample.claim_ns.append(t1 - t0)
        if isinstance(outcome, Won):
            store.release(job.name, holder, outcome.token)
            t2 = time.perf_counter_ns()
            sample.release_ns.append(t2 - t1)
            sample.pair_ns.append(t2 - t0)
            sample.outcomes["won"] += 1
            sample.won_ticks.append(k)
            k += 1
        else:
            sample.outcomes[f"lost {outcome.reason}"] += 1
            # As a replica that lost would: its next try is a newer tick than the row's.
            seen = (outcome.tick - BASE_TICK) // TICK if outcome.tick else k
            k = max(k, seen + 1)

    try:
        warmup = Sample()  # connections made, statements prepared; then dropped
        while time.time() < job.start_at:
            attempt(warmup)
        sample = Sample(errors=warmup.errors, won_ticks=warmup.won_ticks)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while time.time() < job.end_at:
            attempt(sample)
        sample.cpu_seconds = time.process_time() - cpu0
        sample.wall_seconds = time.perf_counter() - wall0
        return sample
    finally:
        engine.dispose()


def run(
    pool: ProcessPoolExecutor, url: str, claimers: int, contended: bool, seconds: float
) -> Sample:
    start_at = time.time() + WARMUP
    tag = secrets.token_hex(3)
    jobs = [
        Job(url, tag if contended else f"{tag}-{i}", start_at, start_at + seconds)
        for i in range(claimers)
    ]
    parts = [
        f.result(timeout=seconds + WARMUP + 60) for f in [pool.submit(claimer, j) for j in jobs]
    ]
    total = Sample(wall_seconds=sum(p.wall_seconds for p in parts) / len(parts))
    for part in parts:
        for name in ("claim_ns", "release_ns", "pair_ns", "errors", "won_ticks"):
            getattr(total, name).extend(getattr(part, name))
        total.outcomes.update(part.outcomes)
        total.cpu_seconds += part.cpu_seconds
    return total


def pct(values: list[int], q: float) -> str:
    """Nearest-rank percentile, in milliseconds."""
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1e6:.3f}"


# -- what one step sends ---------------------------------------------------------------------


def counting(engine: Engine, counts: Counter[str]) -> None:
    """Count statements, pings, and rollbacks that reach the driver, on this engine only.

    ``do_ping`` and ``do_rollback`` are shadowed on this engine's dialect object,
    which the idle-ping listener and the pool's reset on return call. A rollback
    is counted only when ``skip_autocommit_rollback`` lets it through to the DBAPI.
    """
    dialect = engine.dialect
    ping, rollback = dialect.do_ping, dialect.do_rollback

    def counted_ping(dbapi_connection: Any) -> bool:
        counts["pings"] += 1
        return ping(dbapi_connection)

    def counted_rollback(dbapi_connection: Any) -> None:
        autocommit = dialect.detect_autocommit_setting(dbapi_connection)
        counts["rollbacks"] += not (dialect.skip_autocommit_rollback and autocommit)
        rollback(dbapi_connection)

    event.listen(engine, "before_cursor_execute", lambda *_: counts.update(["SQL"]))
    setattr(dialect, "do_ping", counted_ping)  # noqa: B010
    setattr(dialect, "do_rollback", counted_rollback)  # noqa: B010


def count_steps(url: str, gap: float, reps: int) -> dict[str, Counter[str]]:
    """SQL statements, pings and rollbacks of each step, summed over ``reps``.

    Each step follows ``gap`` seconds of idle pool, so the idle ping can show.
    """
    engine = make_engine(url)
    counts: Counter[str] = Counter()
    counting(engine, counts)
    store = LeaseStore(engine, NAMESPACE)
    a, b = make_holder(), make_holder()
    totals: dict[str, Counter[str]] = {}

    def step(label: str, expected: str, call: Callable[..., Any], *args: Any) -> Any:
        time.sleep(gap)
        before = Counter(counts)
        outcome = call(*args)
        totals.setdefault(label, Counter()).update(counts - before)
        kind = outcome.reason if isinstance(outcome, Lost) else type(outcome).__name__
        if kind != expected:
            raise RuntimeError(f"{label}: expected {expected}, got {outcome!r}")
        return outcome

    try:
        store.now()  # the pool's connection exists before any step is counted
        for rep in range(reps):
            name = f"steps-{secrets.token_hex(3)}-{rep}"
            first = step("claim, first ever (INSERT)", "Won", store.claim, name, a, TTL, tick_of(1))
            store.release(name, a, first.token)
            held = step("claim, won (row exists)", "Won", store.claim, name, a, TTL, tick_of(2))
            step("claim, lost (lease_held)", "lease_held", store.claim, name, b, TTL, tick_of(3))
            step("release", "bool", store.release, name, a, held.token)
            step("claim, lost (already_run)", "already_run", store.claim, name, b, TTL, tick_of(2))
    finally:
        engine.dispose()
    return totals


# -- batches: what the daemon claims and releases a burst with -------------------------------

BATCH_SIZES = (16, 200)
BATCH_RUNS = 30
STEADY_FROM = 6  # psycopg prepares a statement at its fifth run: from the sixth, its choice shows


def time_batches(url: str) -> list[tuple[int, list[int], list[int]]]:
    """Per size: ns of each tick store ``open`` of that many ticks with a third of them
    to win (one replica of three), and of the ``close`` of those won: the daemon's two
    calls for a burst, each the dialect's own batch."""
    engine = make_engine(url)
    store = tick_store(LeaseStore(engine, NAMESPACE), History(engine, NAMESPACE), make_holder())
    timed = []
    try:
        for size in BATCH_SIZES:
            sweeps = [bench_sweep(f"batch-{size}-{i}") for i in range(size)]
            for sweep in sweeps:  # the first claims: each batch then finds its rows
                [first] = store.open([Ask(sweep, tick_of(0), "schedule")], 1)
                store.close([_hand_of(sweep, first)])
            limit = -(-size // 3)
            claims, closes = [], []
            for k in range(1, BATCH_RUNS + 1):
                t0 = time.perf_counter_ns()
                found = store.open([Ask(sweep, tick_of(k), "schedule") for sweep in sweeps], limit)
                t1 = time.perf_counter_ns()
                won = [_hand_of(s, o) for s, o in zip(sweeps, found, strict=True) if _won(o)]
                if len(won) != limit or not all(closed.released for closed in store.close(won)):
                    raise RuntimeError(f"batch of {size}, run {k}: {found!r}")
                t2 = time.perf_counter_ns()
                if k >= STEADY_FROM:
                    claims.append(t1 - t0)
                    closes.append(t2 - t1)
            timed.append((size, claims, closes))
    finally:
        engine.dispose()
    return timed


def bench_sweep(name: str) -> SweepDef:
    return SweepDef(
        name=name,
        func=lambda: None,
        target="benchmarks:nothing",
        schedule=Every(TICK),
        ttl=TTL,
        timeout=None,
        misfire_grace=TTL,
    )


def _won(opened: object) -> bool:
    return isinstance(opened, Opened) and isinstance(opened.claim, Won)


def _hand_of(sweep: SweepDef, opened: object) -> Hand:
    """The close of a won tick, its row ending in success."""
    assert isinstance(opened, Opened) and isinstance(opened.claim, Won), opened
    assert isinstance(opened.started, int), opened
    return Hand(sweep.name, opened.claim.token, (opened.started, sweep.name, "success", None))


# -- a database per dialect, and the machine -------------------------------------------------


@contextmanager
def bench_database(dialect: str) -> Iterator[tuple[str, str]]:
    """A fresh, migrated database of ``dialect`` and the server's version; dropped afterwards."""
    if dialect == "sqlite":
        with tempfile.TemporaryDirectory(prefix="sweepd-bench-") as folder:
            url = f"sqlite:///{folder}/bench.db"
            migrate.upgrade(url)
            yield url, f"SQLite {sqlite3.sqlite_version}"
        return
    admin_url = SERVERS[dialect]
    name = f"sweepd_bench_{secrets.token_hex(4)}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f"CREATE DATABASE {name}"))
            version = str(connection.execute(text("SELECT version()")).scalar_one())
        version = version.partition(" on ")[0] if dialect == "postgresql" else f"MariaDB {version}"
        try:
            url = admin_url.rsplit("/", 1)[0] + f"/{name}"
            migrate.upgrade(url)
            yield url, version
        finally:
            force = " WITH (FORCE)" if dialect == "postgresql" else ""
            with admin.connect() as connection:
                connection.execute(text(f"DROP DATABASE {name}{force}"))
    finally:
        admin.dispose()


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def machine() -> list[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        models = [line.split(":")[1].strip() for line in cpuinfo if line.startswith("model name")]
    packages = ", ".join(f"{p} {metadata.version(p)}" for p in ("SQLAlchemy", "psycopg", "PyMySQL"))
    return [
        f"CPU: {models[0] if models else '?'}, nproc {len(os.sched_getaffinity(0))}",
        f"OS: {platform.platform()}",
        f"Python {platform.python_version()}; {packages}",
    ]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


# -- main ------------------------------------------------------------------------------------

OWN = "dialect|claimers|pairs/s|pair p50|pair p99|claim p50|claim p99|release p50|release p99|client CPU/pair|lost|store errors"
BATCHES = "dialect|ticks asked|won|open p50|open p90|close p50|close p90"
CONTENDED = "dialect|claimers|attempts/s|won|lost lease_held|lost already_run|lost other|ticks won twice|attempt p50|attempt p99|store errors"
AIM_STEPS = ("claim, won (row exists)", "release")


@dataclass
class Report:
    own: list[list[str]] = field(default_factory=list)
    batches: list[list[str]] = field(default_factory=list)
    contended: list[list[str]] = field(default_factory=list)
    # (step, when) -> dialect -> mean SQL statements, pings, rollbacks
    steps: dict[tuple[str, str], dict[str, tuple[float, ...]]] = field(default_factory=dict)
    versions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pg_p50: float | None = None


def bench(
    pool: ProcessPoolExecutor, dialect: str, seconds: float, report: Report, batches_only: bool
) -> None:
    with bench_database(dialect) as (url, version):
        report.versions.append(version)
        print(f"{dialect}: {report.versions[-1]} ({load()})", file=sys.stderr, flush=True)
        for size, claims, releases in time_batches(url):
            report.batches.append(
                [dialect, str(size), str(-(-size // 3))]
                + [pct(v, q) for v in (claims, releases) for q in (0.5, 0.9)]
            )
            print(report.batches[-1], file=sys.stderr, flush=True)
        if batches_only:
            return
        for when, gap, reps in STEP_RUNS:
            for label, total in count_steps(url, gap, reps).items():
                means = tuple(total[key] / reps for key in ("SQL", "pings", "rollbacks"))
                report.steps.setdefault((label, when), {})[dialect] = means
        for claimers in CLAIMERS:
            s = run(pool, url, claimers, contended=False, seconds=seconds)
            pairs, cpu = len(s.pair_ns), s.cpu_seconds * 1e3 / max(1, len(s.pair_ns))
            lost = s.outcomes.total() - s.outcomes["won"] - s.outcomes["store error"]
            report.own.append(
                [dialect, str(claimers), f"{pairs / s.wall_seconds:,.0f}"]
                + [pct(v, q) for v in (s.pair_ns, s.claim_ns, s.release_ns) for q in (0.5, 0.99)]
                + [f"{cpu:.3f}", str(lost), str(s.outcomes["store error"])]
            )
            report.notes += [f"{dialect}, {claimers} claimer(s): StoreError: {m}" for m in s.errors]
            if dialect == "postgresql" and claimers == 1 and s.pair_ns:
                report.pg_p50 = float(pct(s.pair_ns, 0.5))
            print(report.own[-1], file=sys.stderr, flush=True)
        s = run(pool, url, max(CLAIMERS), contended=True, seconds=seconds)
        outcomes = [s.outcomes[key] for key in ("won", "lost lease_held", "lost already_run")]
        other = s.outcomes.total() - sum(outcomes) - s.outcomes["store error"]  # clock_skew
        report.contended.append(
            [dialect, str(max(CLAIMERS)), f"{len(s.claim_ns) / s.wall_seconds:,.0f}"]
            + [str(n) for n in (*outcomes, other, len(s.won_ticks) - len(set(s.won_ticks)))]
            + [pct(s.claim_ns, 0.5), pct(s.claim_ns, 0.99), str(s.outcomes["store error"])]
        )
        report.notes += [f"{dialect}, contended: StoreError: {m}" for m in s.errors]
        print(report.contended[-1], file=sys.stderr, flush=True)


def step_cell(means: tuple[float, ...]) -> str:
    sql, pings, rollbacks = means
    extra = f" + {rollbacks:g} rollback" if rollbacks else ""
    return f"{sql:g} SQL + {pings:g} ping{extra} = **{sum(means):g}**"


def aims(report: Report) -> list[str]:
    """The issue's two aims, checked against what was measured."""
    lines = []
    for label in AIM_STEPS:
        counts = report.steps.get((label, STEP_RUNS[0][0]), {})
        ones = all(means[0] == 1 and sum(means) == 1 for means in counts.values())
        verdict = "holds" if counts and ones else "does NOT hold"
        lines.append(f"{label}: one statement, one round trip, back to back: {verdict}")
    if report.pg_p50 is not None:
        verdict = "holds" if report.pg_p50 < 1.0 else "does NOT hold"
        lines.append(
            f"p50 claim+release < 1 ms on PostgreSQL, 1 claimer: {verdict} ({report.pg_p50:.3f} ms)"
        )
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dialect", choices=["all", *DIALECTS], default="all")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument(
        "--batches-only", action="store_true", help="only the tick store open and close"
    )
    args = parser.parse_args(argv)
    dialects = list(DIALECTS) if args.dialect == "all" else [args.dialect]
    began, load_at_start, report = time.perf_counter(), load(), Report()
    with ProcessPoolExecutor(max(CLAIMERS), mp_context=get_context("spawn")) as pool:
        # Every worker process started, and its imports done, before anything is timed.
        list(pool.map(time.sleep, [0.5] * max(CLAIMERS), timeout=120))
        for dialect in dialects:
            bench(pool, dialect, args.seconds, report, args.batches_only)
    print(f"`{' '.join(['python', 'benchmarks/lease.py', *argv])}`", end="\n\n")
    print(f"{load_at_start} at start, {load()} at end; took {time.perf_counter() - began:.0f} s\n")
    print("\n".join(f"- {fact}" for fact in [*machine(), *report.versions]), end="\n\n")
    print(
        f"Batches, one replica: the tick store's open of N ticks, a third to win, then the"
        f" close of those won (runs {STEADY_FROM}-{BATCH_RUNS} of {BATCH_RUNS}; ms)\n"
    )
    print(markdown(BATCHES.split("|"), report.batches), end="\n\n")
    if args.batches_only:
        return 0
    print(f"Claim+release, each claimer on a lease name of its own ({args.seconds:g} s; ms)\n")
    print(markdown(OWN.split("|"), report.own), end="\n\n")
    print(f"Contended: all claimers on one name and the same next tick ({args.seconds:g} s; ms)\n")
    print(markdown(CONTENDED.split("|"), report.contended), end="\n\n")
    print("One step: SQL + pings (+ rollbacks reaching the driver) = round trips (SQLite: calls)\n")
    rows = [
        [label, when, *(step_cell(cells[d]) if d in cells else "-" for d in dialects)]
        for (label, when), cells in report.steps.items()
    ]
    print(markdown(["step", "when", *dialects], rows), end="\n\n")
    print("\n".join(f"- {line}" for line in [*aims(report), *report.notes]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
