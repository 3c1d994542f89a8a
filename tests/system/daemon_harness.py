"""Real ``sweepd run`` processes for the system tests, and what they left behind.

A ``Replica`` is one daemon process with its own log file; ``read_runs``
parses the side-effect file the sweeps in ``daemon_sweeps`` write, and
``read_rows`` the ``sweep_runs`` table. Nothing here mocks the database or
the process: the point is to watch the product do the real thing.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from sweepd.db.engine import make_engine
from sweepd.db.schema import sweep_runs

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TERMINAL = {"success", "failed", "timeout", "cancelled", "lost"}  # every end a row can say
Event = dict[str, Any]  # one line of a daemon's JSON log
T = TypeVar("T")


def write_config(path: Path, database_url: str, sweeps: list[dict[str, Any]], **top: Any) -> Path:
    """A config whose sweeps default to ``daemon_sweeps`` callables, health off."""
    config: dict[str, Any] = {
        "database": {"url": database_url},
        "namespace": "system",
        "health": {"listen": ""},
        "logging": {"format": "json", "level": "debug"},
        "drain_timeout": "10s",
        "defaults": {"misfire_grace": "1s"},
        "sweeps": sweeps,
        **top,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def sweep(
    name: str,
    out: Path,
    *,
    every: str = "1s",
    callable: str = "daemon_sweeps:record",
    **settings: Any,
) -> dict[str, Any]:
    args = {"out": str(out), **settings.pop("args", {})}
    return {"name": name, "callable": callable, "every": every, "args": args, **settings}


@dataclass
class Replica:
    config: Path
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPD_")}
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(HERE), environment.get("PYTHONPATH")])
        )
        environment.update(self.env)
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in wait())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sweepd", "run", "--config", str(self.config)],
            cwd=self.config.parent,
            env=environment,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        if hasattr(self, "_log"):
            self._log.close()

    def events(self) -> list[dict[str, Any]]:
        """The daemon's log, one JSON event per line (non-JSON lines kept as ``raw``)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"event": "raw", "line": line})
        return out

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 20.0
    ) -> dict[str, Any]:
        """The first log event matching ``predicate``, waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events():
                if predicate(event):
                    return event
            if self.process is not None and self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(
            f"no matching event within {timeout}s; log tail: {self.events()[-15:]}"
        )


def start_replicas(
    config: Path, count: int, tmp: Path, env: Iterable[dict[str, str]] | None = None
) -> list[Replica]:
    envs = list(env) if env is not None else [{} for _ in range(count)]
    replicas = [Replica(config, tmp / f"replica-{i}.log", envs[i]).start() for i in range(count)]
    for replica in replicas:
        replica.wait_for(lambda e: e.get("event") == "daemon.started")
    return replicas


def read_runs(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def read_rows(database_url: str) -> list[dict[str, Any]]:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            return [
                dict(row._mapping)
                for row in connection.execute(select(sweep_runs).order_by(sweep_runs.c.id))
            ]
    finally:
        engine.dispose()


def overlaps(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of runs of the same sweep whose [start, end] intervals intersect."""
    spans: dict[str, list[tuple[float, float, dict[str, Any]]]] = {}
    starts = {(r["sweep"], r["tick"], r["attempt"]): r for r in runs if r["event"] == "start"}
    for r in runs:
        if r["event"] in ("end", "stopped", "cancelled", "fail"):
            begin = starts.get((r["sweep"], r["tick"], r["attempt"]))
            if begin is not None:
                spans.setdefault(r["sweep"], []).append((begin["at"], r["at"], r))
    found = []
    for items in spans.values():
        items.sort(key=lambda item: item[0])
        found += [(a[2], b[2]) for a, b in itertools.pairwise(items) if b[0] < a[1]]
    return found


def row_time(value: datetime) -> float:
    """A row's datetime in Unix seconds, whatever the driver returned (naive is UTC)."""
    return seconds(value if value.tzinfo is not None else value.replace(tzinfo=UTC))


def seconds(value: str | datetime) -> float:
    """Unix seconds of an ISO text (``Z`` or ``+00:00``) or an aware datetime."""
    instant = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    assert instant.tzinfo is not None, value
    return instant.astimezone(UTC).timestamp()


def stamp(event: dict[str, Any]) -> float:
    """Unix seconds of a log event's ``timestamp``."""
    return seconds(str(event["timestamp"]))


def wait_until(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """``check()``'s first value other than None, polling for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found is not None:
            return found
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout}s")


def sleep_until(instant: float) -> None:
    """Sleep until Unix time ``instant`` (a moment of the scenario, never more than seconds)."""
    time.sleep(max(0.0, instant - time.time()))


def of(events: list[dict[str, Any]], name: str, **fields: Any) -> list[dict[str, Any]]:
    """The events named ``name`` whose fields include ``fields``."""
    return [
        e
        for e in events
        if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())
    ]


def stop_all(
    replicas: Iterable[Replica], signum: int = signal.SIGTERM, timeout: float = 30.0
) -> list[int]:
    replicas = list(replicas)
    for replica in replicas:
        if replica.process is not None and replica.process.poll() is None:
            replica.signal(signum)
    return [replica.wait(timeout) for replica in replicas]


def assert_each_tick_once_and_every_run_recorded(
    runs: list[dict[str, Any]], rows: list[dict[str, Any]]
) -> None:
    """No tick started twice, by any replica; every run that started has its row, and every row
    says how its run ended."""
    started = Counter((r["sweep"], seconds(r["tick"])) for r in runs if r["event"] == "start")
    twice = {key: n for key, n in started.items() if n > 1}
    assert not twice, f"ticks started more than once: {twice}"
    recorded = {(r["name"], row_time(r["tick"]), r["fencing_token"]) for r in rows}
    unrecorded = [
        r
        for r in runs
        if r["event"] == "start" and (r["sweep"], seconds(r["tick"]), r["token"]) not in recorded
    ]
    assert not unrecorded, f"runs without a row: {unrecorded[:5]}"
    open_rows = [
        (r["name"], str(r["tick"]), r["status"]) for r in rows if r["status"] not in TERMINAL
    ]
    assert not open_rows, f"rows that do not say how their run ended: {open_rows[:5]}"


class Cluster:
    """Replicas started for one test on one database; close() ends every one, none outlives it."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url = url
        self.tmp = tmp
        self.replicas: list[Replica] = []

    def start(
        self,
        config: Path,
        count: int = 1,
        env: list[dict[str, str]] | None = None,
        timeout: float = 30.0,
    ) -> list[Replica]:
        """Like ``start_replicas``, but every process is kept for close() even if one fails."""
        envs = env if env is not None else [{} for _ in range(count)]
        started = []
        for i in range(count):
            replica = Replica(config, self.tmp / f"replica-{len(self.replicas)}.log", envs[i])
            self.replicas.append(replica)
            started.append(replica.start())
        for replica in started:
            replica.wait_for(lambda e: e.get("event") == "daemon.started", timeout=timeout)
        return started

    def stop(self, timeout: float = 30.0) -> tuple[float, list[int], float]:
        """SIGTERM every replica; (time of the first signal, exit statuses, seconds taken)."""
        signalled = time.time()
        began = time.monotonic()
        codes = stop_all(self.replicas, signal.SIGTERM, timeout=timeout)
        return signalled, codes, time.monotonic() - began

    def events(self) -> list[list[dict[str, Any]]]:
        return [replica.events() for replica in self.replicas]

    def close(self) -> None:
        for replica in self.replicas:
            replica.kill()
        if make_url(self.url).get_backend_name() == "postgresql":
            wait_for_backends_gone(self.url)


def wait_for_backends_gone(url: str, timeout: float = 10.0) -> None:
    """An exited replica's PostgreSQL backends end a moment after its sockets close;
    wait for that so the fixture's leak check sees only real leaks."""
    engine = make_engine(url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with engine.connect() as connection:
                others = connection.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalar_one()
            if others == 0:
                return
            time.sleep(0.1)
    finally:
        engine.dispose()
