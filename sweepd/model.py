"""The resolved configuration: what the daemon and the commands act on.

Plain frozen values with no knowledge of YAML, environment or database, so
they can be built in tests without any of those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from sweepd.errors import Problem
from sweepd.schedule import Schedule

Coalesce = Literal["latest", "earliest"]
CatchUp = Literal["none", "latest"]
Migrate = Literal["auto", "never"]
LogFormat = Literal["auto", "console", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class Retries:
    max: int = 0  # retries after the first attempt, all within the same tick
    backoff: timedelta = timedelta(0)


@dataclass(frozen=True)
class SweepDef:
    name: str
    func: Callable[..., Any]
    target: str  # "module:attribute", for humans and logs
    schedule: Schedule
    ttl: timedelta
    timeout: timedelta | None  # None: no time limit
    misfire_grace: timedelta
    jitter: timedelta = timedelta(0)
    retries: Retries = Retries()
    args: Mapping[str, Any] = field(default_factory=dict)
    enabled: bool = True
    coalesce: Coalesce = "latest"
    catch_up: CatchUp = "none"
    takes_context: bool = False
    source: str = ""  # where it was declared: "config.yaml:12" or "myapp/jobs.py:30"


@dataclass(frozen=True)
class Database:
    url: str
    explicit: bool  # False when sweepd fell back to its embedded default
    migrate: Migrate = "auto"


@dataclass(frozen=True)
class Settings:
    path: str
    database: Database
    namespace: str = "default"
    entrypoints: tuple[str, ...] = ()
    concurrency: int = 4
    drain_timeout: timedelta = timedelta(seconds=30)
    health_listen: str = "127.0.0.1:9464"
    log_format: LogFormat = "auto"
    log_level: LogLevel = "info"
    history_keep: timedelta = timedelta(days=14)
    sweeps: tuple[SweepDef, ...] = ()
    warnings: tuple[Problem, ...] = ()

    def sweep(self, name: str) -> SweepDef | None:
        return next((s for s in self.sweeps if s.name == name), None)
