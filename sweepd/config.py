"""YAML + environment + Python declarations -> ``Settings``, with every problem located.

Loading happens in three passes, and one run reports the problems of all
three, so an operator fixes a file in one round instead of one error per run:

1. the file is parsed with positions kept (``yamlfile``) and the environment
   overrides are laid over it, remembered as coming from ``$NAME``;
2. the shape is validated by pydantic models that forbid unknown keys; a key
   whose value is wrong is reported and left out, and the rest goes on;
3. entrypoint modules are imported, each YAML sweep is merged field by field
   over the ``@sweep`` of the same name, and every callable, schedule and
   argument list is resolved against real code, except where a key they
   depend on was already reported (a bad ``every`` is not also "no schedule").
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path as FsPath
from typing import Annotated, Any, Literal, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails

from sweepd import registry, yamlfile
from sweepd.durations import format_duration, parse_duration
from sweepd.environment import Environment
from sweepd.errors import ConfigError, Problem
from sweepd.model import Database, Retries, Settings, SweepDef
from sweepd.schedule import EPOCH, Cron, Every, Schedule

DEFAULT_DATABASE_URL = "sqlite:///sweepd.db"
RESERVED_PREFIX = "sweepd."  # sweepd.prune-history and any internal sweep to come
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_MODULE_PATTERN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_TARGET_PATTERN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_URL_SCHEME = re.compile(r"(sqlite|postgresql|postgres|mysql|mariadb)(\+\w+)?://", re.IGNORECASE)
_LISTEN = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]*):(?P<port>\d{1,5})")


# -- value types shared by the file and the decorator -------------------------


def _duration(value: Any) -> Any:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected a duration such as 30s, got {_kind(value)}")
    return parse_duration(str(value))


def _positive(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise ValueError("must be longer than zero")
    return value


def _not_negative(value: timedelta) -> timedelta:
    if value < timedelta(0):
        raise ValueError("must not be negative")
    return value


def _name(value: str) -> str:
    if not NAME_PATTERN.fullmatch(value):
        raise ValueError(
            f"invalid name {value!r}: use lowercase letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 128 characters"
        )
    return value


def _module(value: str) -> str:
    if not _MODULE_PATTERN.fullmatch(value):
        raise ValueError(f"invalid module name {value!r} (expected e.g. myapp.sweeps)")
    return value


def _target(value: str) -> str:
    if not _TARGET_PATTERN.fullmatch(value):
        raise ValueError(
            f"invalid callable {value!r} (expected module:attribute, e.g. myapp.jobs:purge)"
        )
    return value


def _zone(value: str) -> str:
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown time zone {value!r} (expected an IANA name such as Europe/Berlin)"
        ) from None
    return value


def _anchor(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(
                f"invalid datetime {value!r} (expected ISO 8601, e.g. 2026-01-01T00:00:00Z)"
            ) from None
    if isinstance(value, datetime) and value.tzinfo is None:
        raise ValueError("anchor needs a UTC offset, e.g. 2026-01-01T00:00:00Z")
    return value


def _listen(value: str) -> str:
    if value == "":
        return value
    match = _LISTEN.fullmatch(value)
    if match is None or int(match["port"]) > 65535:
        raise ValueError(
            f'invalid listen address {value!r} (expected HOST:PORT, e.g. 127.0.0.1:9464, or "" to disable)'
        )
    return value


def _url(value: str) -> str:
    if not _URL_SCHEME.match(value):
        raise ValueError(
            "unsupported database URL (expected sqlite:///PATH, postgresql+psycopg://... "
            "or mysql+pymysql://...)"
        )
    return value


Duration = Annotated[timedelta, BeforeValidator(_duration)]
PositiveDuration = Annotated[timedelta, BeforeValidator(_duration), AfterValidator(_positive)]
NonNegativeDuration = Annotated[
    timedelta, BeforeValidator(_duration), AfterValidator(_not_negative)
]
Name = Annotated[str, AfterValidator(_name)]
Module = Annotated[str, AfterValidator(_module)]
Target = Annotated[str, AfterValidator(_target)]
Zone = Annotated[str, AfterValidator(_zone)]
Anchor = Annotated[datetime, BeforeValidator(_anchor)]
Listen = Annotated[str, AfterValidator(_listen)]
Url = Annotated[str, AfterValidator(_url)]


@dataclass(frozen=True)
class Shown:
    """A default as docs/configuration.md shows it, where the model's own cannot say it.

    A None default in a sweep means "resolved later" (from ``defaults``, the
    ``@sweep``, or the resolver), so the page needs the words; ``{default}``
    stands for the model's own default, kept in one place.
    """

    default: str


class _Strict(BaseModel):
    # strict: YAML already typed the values, so "4" is not silently a 4 and
    # "yes" is not silently True; extra="forbid": a misspelt key is an error.
    # The attribute docstrings are the key reference (sweepd.reference).
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True
    )


# -- the file's shape: each key's docstring is its line in docs/configuration.md --


class RetriesFile(_Strict):
    max: int = Field(default=0, ge=0, le=1000)
    """how many times a `failed` or `timeout` attempt is run again"""
    backoff: NonNegativeDuration = timedelta(0)
    """the wait before each retry"""


_ONE_SCHEDULE = Shown("exactly one of `every`, `cron`")


class SweepFile(_Strict):
    """One ``sweeps:`` item, or one ``@sweep(...)``: every field optional but name."""

    name: Name
    """`[a-z0-9][a-z0-9._-]{0,127}`, unique; names starting `sweepd.` are reserved"""
    callable: Annotated[Target | None, Shown("the `@sweep` of this name")] = None
    """`module:attribute` (the attribute may be dotted), sync or async"""
    every: Annotated[PositiveDuration | None, _ONE_SCHEDULE] = None
    """an interval, its ticks aligned to the Unix epoch (or `anchor`)"""
    cron: Annotated[str | None, _ONE_SCHEDULE] = None
    """a five-field crontab expression, or one of crontab's aliases (below)"""
    anchor: Annotated[Anchor | None, Shown("the Unix epoch")] = None
    """`every` only: an aware ISO datetime the interval counts from"""
    timezone: Annotated[Zone | None, Shown("from `defaults.timezone`")] = None
    """`cron` only: an IANA zone"""
    jitter: Annotated[NonNegativeDuration | None, Shown("`0s`")] = None
    """a random delay before firing; never changes the tick's identity"""
    ttl: Annotated[PositiveDuration | None, Shown("from `defaults.ttl`")] = None
    """as `defaults.ttl`, for this sweep"""
    timeout: Annotated[PositiveDuration | None, Shown("from `defaults.timeout`")] = None
    """as `defaults.timeout`, for this sweep; `null` is no limit, whatever `defaults` says"""
    misfire_grace: Annotated[
        NonNegativeDuration | None,
        Shown("from `defaults.misfire_grace`"),
    ] = None
    """as `defaults.misfire_grace`, for this sweep; kept as written, even when longer than the
    interval (that is warned about)"""
    retries: RetriesFile | None = None
    """retries within the same tick, under the same lease"""
    args: Annotated[dict[str, Any] | None, Shown("`{}`")] = None
    """keyword arguments for the callable"""
    enabled: Annotated[bool | None, Shown("`true`")] = None
    """`false` keeps the sweep defined but never fires it"""
    coalesce: Annotated[Literal["latest", "earliest"] | None, Shown("`latest`")] = None
    """which tick a queued tick keeps when later ones fold into it"""
    catch_up: Annotated[Literal["none", "latest"] | None, Shown("`none`")] = None
    """`latest` runs the most recent missed tick at start if no replica ran it"""

    @field_validator("*", mode="before")
    @classmethod
    def _no_null(cls, value: Any, info: ValidationInfo) -> Any:
        # None above means "not written, take the default", and a written null
        # would reach the daemon as None. Only timeout gives null a meaning (no
        # time limit, beating a default); a null name is pydantic's to refuse.
        if value is None and info.field_name not in ("name", "timeout"):
            raise ValueError("null is not a value here: leave the key out to take the default")
        return value


class DatabaseFile(_Strict):
    url: Annotated[Url | None, Shown(f"`{DEFAULT_DATABASE_URL}`")] = None
    """SQLAlchemy URL: `sqlite:///PATH`, `postgresql+psycopg://…`, `mysql+pymysql://…`. A
    relative SQLite path is relative to the working directory."""
    url_file: str | None = None
    """a file holding the URL (a mounted secret); give this or `url`, not both"""
    migrate: Literal["auto", "never"] = "auto"
    """`auto` upgrades the schema at start; `never` refuses to start when it is not current"""


class DefaultsFile(_Strict):
    ttl: PositiveDuration = timedelta(seconds=3)
    """lease time to live for sweeps that set none: how long a crashed replica can block its
    sweeps, and how long the database may be unreachable before a run is told `lease_lost`"""
    timeout: PositiveDuration | None = None
    """run time limit for sweeps that set none; `null` is no limit"""
    timezone: Zone = "UTC"
    """time zone of `cron` schedules that set none"""
    misfire_grace: Annotated[
        NonNegativeDuration, Shown("{default}, or the interval when shorter")
    ] = timedelta(seconds=30)
    """a tick fired later than this after its time is recorded missed; left out here and in the
    sweep, an `every` sweep gets the smaller of this default and its interval"""


class HealthFile(_Strict):
    listen: Listen = "127.0.0.1:9464"
    """`HOST:PORT` of `/healthz`, `/readyz`, `/metrics`; `""` disables, port 0 picks one (logged
    as `health.listening`); replicas on one host each need a port of their own. See
    docs/operations.md"""


class LoggingFile(_Strict):
    format: Literal["auto", "console", "json"] = "auto"
    """`auto` is console on a terminal, else JSON"""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """the least severe level logged"""


class HistoryFile(_Strict):
    keep: PositiveDuration = timedelta(days=14)
    """how long run rows are kept"""


class ConfigFile(_Strict):
    database: DatabaseFile = DatabaseFile()
    """the database every replica shares"""
    namespace: Name = "default"
    """leases and runs are scoped by it, so several deployments can share a database"""
    entrypoints: list[Module] = []
    """modules imported at start; their `@sweep` functions register"""
    concurrency: int = Field(default=4, ge=1, le=10_000)
    """distinct sweeps one replica runs at once"""
    drain_timeout: NonNegativeDuration = timedelta(seconds=30)
    """how long in-flight runs may finish after SIGTERM/SIGINT"""
    defaults: DefaultsFile = DefaultsFile()
    """settings for the sweeps that set none of their own"""
    health: HealthFile = HealthFile()
    """the HTTP server for probes and metrics"""
    logging: LoggingFile = LoggingFile()
    """the log lines on stderr"""
    history: HistoryFile = HistoryFile()
    """the run rows in the database"""
    sweeps: list[SweepFile] | None = None
    """the list below; may be absent when every sweep is declared in Python"""


# -- loading ---------------------------------------------------------------------


@dataclass(frozen=True)
class Overrides:
    """What the command line says, above the environment and the file."""

    database_url: str | None = None


def load_settings(
    path: str,
    environment: Environment,
    overrides: Overrides = Overrides(),
    sweeps: registry.Registry | None = None,
) -> Settings:
    """Read, validate and resolve the config at ``path``; raise ``ConfigError`` listing all problems."""
    return settings_from_text(_read(path), path, environment, overrides, sweeps)


def settings_from_text(
    text: str,
    source: str,
    environment: Environment,
    overrides: Overrides = Overrides(),
    sweeps: registry.Registry | None = None,
) -> Settings:
    checked = _validate(text, source, environment, overrides)
    # What the shape errors left is still resolved against code, so one run
    # lists the bad duration and the missing module alike.
    return _Resolver(checked, environment, sweeps or registry.REGISTRY).resolve()


def load_database(
    path: str, environment: Environment, overrides: Overrides = Overrides()
) -> tuple[Database, str]:
    """Only the database and namespace, for commands that need no sweep code (``db``, ``lock``)."""
    checked = _validate(_read(path), path, environment, overrides)
    resolver = _Resolver(checked, environment, registry.Registry())
    database = resolver.database()
    if resolver.problems or database is None:
        raise ConfigError(resolver.problems)
    return database, checked.parsed.namespace


def _read(path: str) -> str:
    try:
        return FsPath(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            [Problem(path, "", f"cannot read config: {exc.strerror or exc}")]
        ) from None
    except UnicodeDecodeError:
        raise ConfigError([Problem(path, "", "cannot read config: not UTF-8 text")]) from None


M = TypeVar("M", bound=BaseModel)


def _salvage(model: type[M], data: Any) -> tuple[M | None, list[ErrorDetails], frozenset[str]]:
    """Validate ``data``; on errors, validate it again without the keys they are in.

    Returns the model of what is left (None when a required key is among the
    broken ones, or ``data`` is no mapping), the errors, and the broken keys.
    A misspelt key breaks the key it is close to, when that one is absent:
    "evrey: 1m" is the missing ``every``, not a second problem.
    """
    try:
        return model.model_validate(data), [], frozenset()
    except ValidationError as exc:
        errors = exc.errors()
    if not isinstance(data, dict):
        return None, errors, frozenset()
    broken = {str(error["loc"][0]) for error in errors if error["loc"]}
    for error in errors:
        if error["type"] == "extra_forbidden" and len(error["loc"]) == 1:
            meant = _close_key(str(error["loc"][0]), list(model.model_fields))
            if meant is not None and meant not in data:
                broken.add(meant)
    try:
        rest = model.model_validate({k: v for k, v in data.items() if str(k) not in broken})
    except ValidationError:
        return None, errors, frozenset(broken)
    return rest, errors, frozenset(broken)


@dataclass(frozen=True)
class _Item:
    """A ``sweeps:`` item whose shape lets it be checked against code."""

    index: int
    entry: SweepFile
    broken: frozenset[str]  # keys already reported, left out of ``entry``


@dataclass(frozen=True)
class _Checked:
    """What pass 2 hands to pass 3: the parts whose shape is fine, and the problems so far."""

    located: yamlfile.Located
    parsed: ConfigFile  # a top-level key already reported is at its default
    broken: frozenset[str]  # those top-level keys
    entrypoints: list[tuple[int, str]]  # (index in the file, module) of the valid names
    items: list[_Item]
    problems: list[Problem]


def _validate(text: str, source: str, environment: Environment, overrides: Overrides) -> _Checked:
    """Passes 1 and 2: the file's shape, each sweep item checked on its own."""
    try:
        located = yamlfile.load(text, source)
    except yamlfile.YamlSyntaxError as exc:
        raise ConfigError([Problem(exc.location, "", exc.message)]) from None
    if located.data is None:
        located.data = {}
    if not isinstance(located.data, dict):
        message = f"the config must be a mapping of keys, not {_kind(located.data)}"
        raise ConfigError([Problem(located.where(()), "", message)])
    problems = [
        Problem(
            located.where(path, key=True), yamlfile.spell_path(path), f"duplicate key {path[-1]!r}"
        )
        for path in located.duplicates
    ]
    _lay_environment(located, environment, overrides)
    data = dict(located.data)
    raw_items = data.get("sweeps")
    items: list[_Item] = []
    if isinstance(raw_items, list):
        data["sweeps"] = None
        for index, item in enumerate(raw_items):
            entry, errors, broken_keys = _salvage(SweepFile, item)
            for error in errors:
                error["loc"] = ("sweeps", index, *error["loc"])
                problems.append(_problem(located, error))
            if entry is not None:
                items.append(_Item(index, entry, broken_keys))
    parsed, errors, broken = _salvage(ConfigFile, data)
    assert parsed is not None  # every top-level key has a default
    problems[:0] = [_problem(located, error) for error in errors]
    entrypoints = list(enumerate(parsed.entrypoints))
    raw_modules = data.get("entrypoints")
    if "entrypoints" in broken and isinstance(raw_modules, list):
        # One bad name does not keep the others from registering their sweeps.
        bad = {loc[1] for loc in (e["loc"] for e in errors) if loc[0] == "entrypoints" and loc[1:]}
        entrypoints = [(i, m) for i, m in enumerate(raw_modules) if i not in bad]
    return _Checked(located, parsed, broken, entrypoints, items, problems)


def _lay_environment(
    located: yamlfile.Located, environment: Environment, overrides: Overrides
) -> None:
    """Put the environment's values where the file's would be, remembering whence they came."""
    data = located.data
    sets: list[tuple[yamlfile.Path, str | None, str]] = [
        (("database", "url"), overrides.database_url, "--database"),
        (
            ("database", "url"),
            None if overrides.database_url else environment.database_url,
            "$SWEEPD_DATABASE_URL",
        ),
        (("namespace",), environment.namespace, "$SWEEPD_NAMESPACE"),
        (("health", "listen"), environment.health_listen, "$SWEEPD_HEALTH_LISTEN"),
        (("logging", "format"), environment.log_format, "$SWEEPD_LOG_FORMAT"),
        (("logging", "level"), environment.log_level, "$SWEEPD_LOG_LEVEL"),
    ]
    for path, value, origin in sets:
        if value is None:
            continue
        parent = data
        for part in path[:-1]:
            child = parent.setdefault(part, {})
            if not isinstance(child, dict):
                break  # the file's own mistake there is reported, not papered over
            parent = child
        else:
            parent[path[-1]] = value
            located.overrides[path] = origin
            if path == ("database", "url"):
                # A URL from outside the file wins over the file's url_file too.
                parent.pop("url_file", None)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


_EXPECTED = {
    "int_type": "expected a whole number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "dict_type": "expected a mapping",
    "list_type": "expected a list",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "datetime_type": "expected a datetime",
    "float_type": "expected a number",
    "timedelta_type": "expected a duration such as 30s",
}


def _problem(located: yamlfile.Located, error: ErrorDetails) -> Problem:
    """Turn one pydantic error into a located line an operator can act on."""
    path: yamlfile.Path = tuple(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        return Problem(located.where(path, key=True), yamlfile.spell_path(path), _unknown_key(path))
    if kind == "missing":
        return Problem(
            located.where(path[:-1]),
            yamlfile.spell_path(path[:-1]),
            f"missing required key {path[-1]!r}",
        )
    where = located.where(path)
    spelled = yamlfile.spell_path(path)
    if kind == "value_error":
        message = str(error["ctx"]["error"]) if "ctx" in error else error["msg"]
    elif kind in _EXPECTED:
        message = f"{_EXPECTED[kind]}, got {_kind(error['input'])}"
    elif kind == "literal_error":
        message = f"expected one of {error['ctx']['expected']}, got {_kind(error['input'])}"
    elif kind in ("greater_than_equal", "less_than_equal"):
        message = f"{error['msg'].lower()}, got {error['input']}"
    else:
        message = error["msg"]
    return Problem(where, spelled, message)


def _unknown_key(path: yamlfile.Path) -> str:
    key = str(path[-1])
    allowed = _allowed_keys(path[:-1])
    close = _close_key(key, allowed)
    hint = f" (did you mean {close!r}?)" if close else f" (allowed: {', '.join(allowed)})"
    return f"unknown key {key!r}{hint}"


def _close_key(key: str, allowed: list[str]) -> str | None:
    """The allowed key that ``key`` is most likely a misspelling of."""
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    return close[0] if close else None


def _allowed_keys(parent: yamlfile.Path) -> list[str]:
    model: type[BaseModel] = ConfigFile
    for part in parent:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        inner = _model_of(field.annotation) if field else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


# -- resolution: merge with @sweep, import, check against code --------------------


@dataclass
class _Field:
    """A merged sweep setting and where it was written."""

    value: Any
    location: str
    path: str


class _Resolver:
    def __init__(
        self, checked: _Checked, environment: Environment, sweeps: registry.Registry
    ) -> None:
        self.checked = checked
        self.located = checked.located
        self.parsed = checked.parsed
        self.environment = environment
        self.registry = sweeps
        self.problems: list[Problem] = list(checked.problems)
        self.warnings: list[Problem] = []

    def resolve(self) -> Settings:
        database = self.database()
        self._import_modules()
        sweeps = self._sweeps()
        if self.problems:
            raise ConfigError(self.problems)
        if not sweeps:
            self.warnings.append(
                Problem(
                    self.located.where(()),
                    "sweeps",
                    "no sweeps are defined: the daemon would do nothing",
                )
            )
        parsed = self.parsed
        assert database is not None
        return Settings(
            path=self.located.source,
            database=database,
            namespace=parsed.namespace,
            entrypoints=tuple(parsed.entrypoints),
            concurrency=parsed.concurrency,
            drain_timeout=parsed.drain_timeout,
            health_listen=parsed.health.listen,
            log_format=parsed.logging.format,
            log_level=parsed.logging.level,
            history_keep=parsed.history.keep,
            sweeps=tuple(sweeps),
            warnings=tuple(self.warnings),
        )

    def _where(self, *path: str | int, key: bool = False) -> str:
        return self.located.where(tuple(path), key=key)

    # database ----------------------------------------------------------------

    def database(self) -> Database | None:
        if "database" in self.checked.broken:
            return None  # its defaults would raise problems the file does not have
        db = self.parsed.database
        if db.url is not None and db.url_file is not None:
            self.problems.append(
                Problem(
                    self._where("database", "url_file", key=True),
                    "database.url_file",
                    "give database.url or database.url_file, not both",
                )
            )
            return None
        url, explicit, where, path = (
            db.url,
            db.url is not None,
            self._where("database", "url"),
            "database.url",
        )
        if db.url_file is not None:
            where, path = self._where("database", "url_file"), "database.url_file"
            try:
                url = FsPath(db.url_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                self.problems.append(
                    Problem(where, path, f"cannot read {db.url_file}: {exc.strerror or exc}")
                )
                return None
            try:
                _url(url)
            except ValueError as exc:
                self.problems.append(Problem(where, path, f"the file holds an {exc}"))
                return None
            explicit = True
        if url is None:
            url = DEFAULT_DATABASE_URL
        if self.environment.production:
            if not explicit:
                self.problems.append(
                    Problem(
                        self._where("database", key=True),
                        "database.url",
                        "SWEEPD_ENV=production needs an explicit database URL (database.url, database.url_file, SWEEPD_DATABASE_URL or --database)",
                    )
                )
            elif is_memory_sqlite(url):
                self.problems.append(
                    Problem(
                        where,
                        path,
                        "SWEEPD_ENV=production refuses an in-memory SQLite database: nothing would outlive the process or reach another replica",
                    )
                )
            elif url.lower().startswith("sqlite"):
                self.warnings.append(
                    Problem(
                        where,
                        path,
                        "a SQLite file coordinates only processes on one host; replicas on other hosts need PostgreSQL or MySQL",
                    )
                )
        return Database(url=url, explicit=explicit, migrate=db.migrate)

    # modules -----------------------------------------------------------------

    def _import_modules(self) -> None:
        for index, module in self.checked.entrypoints:
            try:
                registry.import_module(module)
            except registry.ResolveError as exc:
                self.problems.append(
                    Problem(self._where("entrypoints", index), f"entrypoints[{index}]", str(exc))
                )
        for name, module in registry.entry_point_modules():
            try:
                registry.import_module(module)
            except registry.ResolveError as exc:
                self.problems.append(
                    Problem(f"entry point {registry.ENTRY_POINT_GROUP}:{name}", "", str(exc))
                )
        for first, again in self.registry.conflicts:
            self.problems.append(
                Problem(
                    again.source,
                    f"@sweep({again.name})",
                    f"sweep name {again.name!r} is already declared at {first.source}",
                )
            )

    # sweeps ------------------------------------------------------------------

    def _sweeps(self) -> list[SweepDef]:
        merged: dict[str, dict[str, _Field]] = {}
        broken: dict[str, set[str]] = {}  # keys already reported, per sweep
        origin: dict[str, tuple[str, str, str]] = {}  # where, spelled path, source shown
        first_line: dict[str, str] = {}
        rejected: set[str] = set()  # decorators already reported as invalid
        for declared in self.registry.all():
            found = self._declared_fields(declared)
            if found is None:
                rejected.add(declared.name)
            else:
                merged[declared.name], broken[declared.name] = found
                origin[declared.name] = (
                    declared.source,
                    f"@sweep({declared.name})",
                    declared.source,
                )
        for item in self.checked.items:
            index, entry = item.index, item.entry
            where = self._where("sweeps", index)
            if entry.name in first_line:
                self.problems.append(
                    Problem(
                        self._where("sweeps", index, "name"),
                        f"sweeps[{index}].name",
                        f"duplicate sweep name {entry.name!r} (first at {first_line[entry.name]})",
                    )
                )
                continue
            first_line[entry.name] = where
            if entry.name in rejected:
                continue
            shown = where.rsplit(":", 1)[0]
            if entry.name in origin:
                shown += f" over {origin[entry.name][2]}"
            fields = merged.setdefault(entry.name, {})
            unknown = broken.setdefault(entry.name, set())
            if (entry.model_fields_set | item.broken) & {"every", "cron"}:
                # A schedule in the file replaces the decorator's whole schedule:
                # "cron:" over "@sweep(every=...)" means cron, not both.
                for key in ("every", "cron", "anchor", "timezone"):
                    fields.pop(key, None)
                    unknown.discard(key)
            for key in entry.model_fields_set - {"name"}:
                fields[key] = _Field(
                    getattr(entry, key), self._where("sweeps", index, key), f"sweeps[{index}].{key}"
                )
                unknown.discard(key)
            for key in item.broken:
                # The file's value replaces the decorator's even when it is bad.
                fields.pop(key, None)
                unknown.add(key)
            origin[entry.name] = (where, f"sweeps[{index}]", shown)
        out = []
        for name, fields in merged.items():
            built = self._build(name, fields, broken[name], *origin[name])
            if built is not None:
                out.append(built)
        return out

    def _declared_fields(
        self, declared: registry.Declared
    ) -> tuple[dict[str, _Field], set[str]] | None:
        """Validate a decorator's settings with the file's rules; also return the bad keys."""
        spelled = f"@sweep({declared.name})"
        entry, errors, broken = _salvage(SweepFile, {"name": declared.name, **declared.settings})
        for error in errors:
            loc = ".".join(str(part) for part in error["loc"])
            message = _problem(yamlfile.Located(None, declared.source), error).message
            self.problems.append(Problem(declared.source, f"{spelled}.{loc}", message))
        if entry is None:
            return None
        fields = {
            key: _Field(getattr(entry, key), declared.source, f"{spelled}.{key}")
            for key in entry.model_fields_set - {"name"}
        }
        if "callable" not in broken:
            fields.setdefault("callable", _Field(declared.func, declared.source, spelled))
        return fields, set(broken)

    def _build(
        self,
        name: str,
        fields: dict[str, _Field],
        broken: set[str],
        where: str,
        spelled: str,
        source: str,
    ) -> SweepDef | None:
        """Check a merged sweep against code and build it; ``broken`` keys are not checked again."""
        defaults = self.parsed.defaults
        before = len(self.problems)

        def get(key: str, default: Any = None) -> Any:
            return fields[key].value if key in fields else default

        def fail(key: str | None, message: str) -> None:
            if key is not None and key in fields:
                self.problems.append(Problem(fields[key].location, fields[key].path, message))
            else:
                self.problems.append(Problem(where, spelled, message))

        if name.startswith(RESERVED_PREFIX):
            fail(
                None,
                f"sweep names starting with {RESERVED_PREFIX!r} are reserved for sweepd's own sweeps",
            )
        schedule = None
        if not broken & {"every", "cron"}:
            schedule = self._schedule(name, fields, get, fail, defaults.timezone)
        func, target = None, ""
        if "callable" not in broken:
            func, target = self._callable(fields, fail)
        args = dict(get("args") or {})
        wants_ctx = False
        if func is not None and "args" not in broken:
            try:
                wants_ctx = registry.check_arguments(func, args)
            except registry.ResolveError as exc:
                fail("args" if "args" in fields else "callable", str(exc))
        if broken or len(self.problems) > before or schedule is None or func is None:
            return None
        misfire_grace = get("misfire_grace", defaults.misfire_grace)
        if (
            isinstance(schedule, Every)
            and "misfire_grace" not in fields
            and "misfire_grace" not in defaults.model_fields_set
        ):
            # The default fits any interval, so a plain "every: 1s" is not
            # warned about a grace nobody wrote. A cron's ticks are a minute
            # apart at least, so the 30s default always fits them.
            misfire_grace = min(misfire_grace, schedule.interval)
        retries = get("retries") or RetriesFile()
        sweep = SweepDef(
            name=name,
            func=func,
            target=target,
            schedule=schedule,
            ttl=get("ttl", defaults.ttl),
            timeout=get("timeout", defaults.timeout),
            misfire_grace=misfire_grace,
            jitter=get("jitter", timedelta(0)),
            retries=Retries(max=retries.max, backoff=retries.backoff),
            args=args,
            enabled=get("enabled", True),
            coalesce=get("coalesce", "latest"),
            catch_up=get("catch_up", "none"),
            takes_context=wants_ctx,
            source=source,
        )
        self._warn(sweep, fields, where, spelled)
        return sweep

    def _schedule(
        self,
        name: str,
        fields: dict[str, _Field],
        get: Callable[..., Any],
        fail: Callable[[str | None, str], None],
        default_zone: str,
    ) -> Schedule | None:
        every, cron = get("every"), get("cron")
        if (every is None) == (cron is None):
            both = "not both" if every is not None else "none is given"
            fail(
                "cron" if every is not None else None,
                f"sweep {name!r} needs exactly one of 'every' or 'cron' ({both})",
            )
            return None
        if every is not None:
            if "timezone" in fields:
                fail(
                    "timezone",
                    "timezone applies to cron schedules only; 'every' ticks are aligned to UTC",
                )
            anchor = get("anchor")
            return Every(interval=every, anchor=anchor.astimezone(UTC) if anchor else EPOCH)
        if "anchor" in fields:
            fail("anchor", "anchor applies to 'every' schedules only")
        try:
            return Cron(expression=cron, timezone=get("timezone", default_zone))
        except ValueError as exc:
            fail("cron", str(exc))
            return None

    def _callable(
        self, fields: dict[str, _Field], fail: Callable[[str | None, str], None]
    ) -> tuple[Callable[..., Any] | None, str]:
        value = fields["callable"].value if "callable" in fields else None
        if value is None:
            if "entrypoints" in self.checked.broken:
                return None, ""  # its @sweep may be in a module that could not be named
            fail(
                None,
                "missing required key 'callable' (module:attribute), and no @sweep of this name was imported",
            )
            return None, ""
        if callable(value):
            return value, f"{value.__module__}:{value.__qualname__}"
        try:
            return registry.resolve_callable(value), value
        except registry.ResolveError as exc:
            fail("callable", str(exc))
            return None, value

    def _warn(self, sweep: SweepDef, fields: dict[str, _Field], where: str, spelled: str) -> None:
        def warn(key: str | None, message: str) -> None:
            if key is not None and key in fields:
                self.warnings.append(Problem(fields[key].location, fields[key].path, message))
            else:
                self.warnings.append(Problem(where, spelled, message))

        if isinstance(sweep.schedule, Every):
            interval = sweep.schedule.interval
            if interval < timedelta(seconds=1):
                warn(
                    "every",
                    f"an interval of {format_duration(interval)} is under a second: every tick is a database round trip on every replica",
                )
            if sweep.misfire_grace > interval:
                grace = format_duration(sweep.misfire_grace)
                if "misfire_grace" not in fields:
                    grace += " (from defaults.misfire_grace)"
                warn(
                    "misfire_grace",
                    f"misfire_grace {grace} is longer than the interval {format_duration(interval)}: a late tick may still run after the next one is due",
                )
            if sweep.jitter >= interval:
                warn(
                    "jitter",
                    f"jitter {format_duration(sweep.jitter)} is not shorter than the interval {format_duration(interval)}: ticks will queue behind each other",
                )
        if sweep.ttl < timedelta(seconds=3):
            warn(
                "ttl",
                f"ttl {format_duration(sweep.ttl)} is under 3s: heartbeats every ttl/3 leave little room for a slow database",
            )


def is_memory_sqlite(url: str) -> bool:
    lowered = url.lower()
    if not lowered.startswith("sqlite"):
        return False
    rest = lowered.split("://", 1)[1] if "://" in lowered else ""
    return rest in ("", "/") or ":memory:" in rest or "mode=memory" in rest
