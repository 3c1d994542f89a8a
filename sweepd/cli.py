"""The command line: the only module that prints or exits.

``main(argv) -> int`` runs one command and maps every sweepd exception to
its exit code in one place; ``entry()`` is the console script.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast, get_args

import click
from sqlalchemy.exc import SQLAlchemyError

from sweepd import __version__
from sweepd.config import Overrides, load_database, load_settings
from sweepd.durations import parse_duration
from sweepd.environment import Environment, read_environment
from sweepd.errors import ConfigError, ExitCode, SweepdError, UsageError
from sweepd.history import Status
from sweepd.model import LogFormat, LogLevel, Settings
from sweepd.plan import describe, render_text
from sweepd.redact import mask_text, mask_url

if TYPE_CHECKING:  # imported where used, so a command loads only what it needs
    from sqlalchemy import Engine

    from sweepd.lifecycle import EarlySignals
    from sweepd.model import SweepDef


def _settings(environment: Environment, config: str | None, database: str | None) -> Settings:
    path = config or environment.config
    if not path:
        raise UsageError("no config given: pass --config PATH or set SWEEPD_CONFIG")
    return load_settings(path, environment, Overrides(database_url=database))


def _instant(text: str, option: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"{option}: invalid datetime {text!r} (expected ISO 8601, e.g. 2026-03-29T00:30:00Z)"
        ) from None
    if value.tzinfo is None:
        raise UsageError(f"{option}: {text!r} needs a UTC offset, e.g. {text}Z")
    return value.astimezone(UTC)


config_option = click.option(
    "--config", "config", metavar="PATH", help="Config file (default: $SWEEPD_CONFIG)."
)
database_option = click.option(
    "--database",
    metavar="URL",
    help="Database URL (default: $SWEEPD_DATABASE_URL, then the config).",
)
format_option = click.option(
    "--format", "output", type=click.Choice(["text", "json"]), default="text", show_default=True
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sweepd", message="%(prog)s %(version)s")
def cli() -> None:
    """sweepd runs periodic sweeps, each tick exactly once across replicas."""


@cli.command("check-config")
@config_option
@database_option
@format_option
@click.option("--no-db", is_flag=True, help="Do not connect to the database.")
@click.option(
    "--from",
    "start",
    metavar="DATETIME",
    help="Show the next ticks from this instant instead of now.",
)
@click.pass_obj
def check_config(
    environment: Environment,
    config: str | None,
    database: str | None,
    output: str,
    no_db: bool,
    start: str | None,
) -> int:
    """Validate the config, import the sweeps and show their next ticks."""
    instant = _instant(start, "--from") if start else datetime.now(UTC)
    settings = _settings(environment, config, database)
    status: int = ExitCode.OK
    problems: list[str] = []
    db: dict[str, Any] = {
        "url": mask_url(settings.database.url),
        "checked": False,
        "summary": "not checked (--no-db)",
    }
    if not no_db:
        from sweepd.db.health import check_database

        report = check_database(settings.database.url)
        db.update(
            checked=True,
            reachable=report.reachable,
            revision=report.revision,
            head=report.head,
            current=report.current,
            skew_seconds=report.skew_seconds,
        )
        if not report.reachable:
            problems.append(f"database unreachable: {report.error}")
        elif not report.current:
            state = "missing" if report.revision is None else f"at {report.revision}"
            fix = (
                "`sweepd run` creates it (migrate: auto)"
                if settings.database.migrate == "auto"
                else "run `sweepd db upgrade`"
            )
            problems.append(f"database schema is {state}, sweepd needs {report.head}: {fix}")
        if report.skewed:
            problems.append(
                f"this host's clock is {-(report.skew_seconds or 0):+.3f}s off the database's (leases use the database's clock)"
            )
        db["summary"] = (
            "; ".join(problems)
            or f"ok: schema {report.revision}, clock skew {report.skew_seconds:+.3f}s"
        )
        # Unreachable is a failed check; a schema that `run` would create is not.
        if not report.reachable or (not report.current and settings.database.migrate == "never"):
            status = ExitCode.FAILED
    report_data = describe(settings, instant, database=db)
    if output == "json":
        click.echo(json.dumps(report_data, indent=2))
    else:
        click.echo(render_text(report_data))
    for warning in settings.warnings:
        click.echo(f"warning: {warning}", err=True)
    for problem in problems:
        click.echo(f"{'warning' if status == ExitCode.OK else 'error'}: {problem}", err=True)
    return status


@cli.command("run")
@config_option
@database_option
@click.option(
    "--dry-run",
    is_flag=True,
    help="Load everything and log the ticks it would fire; claim and run nothing.",
)
@click.pass_obj
def run(environment: Environment, config: str | None, database: str | None, dry_run: bool) -> int:
    """Run the daemon: fire every sweep on its schedule, each tick once across replicas."""
    import faulthandler

    from sweepd.db.engine import make_engine
    from sweepd.lifecycle import EarlySignals
    from sweepd.observe import configure_logging, flush_logs, get_logger

    early = EarlySignals()
    # A crash of the interpreter itself (a driver's C code, a teardown under a
    # live thread) is otherwise a bare exit status: this leaves every thread's
    # stack on stderr.
    faulthandler.enable()
    settings = _settings(environment, config, database)
    # Made before logging starts (it does not connect): a URL this install
    # cannot use, its driver missing or its SQLite folder, is bad input and
    # says so in one line, as a bad config does.
    engine = make_engine(settings.database.url)
    try:
        json_lines = configure_logging(settings.log_format, settings.log_level)
        log = get_logger()
        try:
            return _serve(environment, settings, engine, log, early, database, dry_run=dry_run)
        except (SweepdError, SQLAlchemyError) as error:
            if not json_lines:
                raise
            # A JSON log is read by a program: its last line, why the daemon
            # stopped, must parse like the others.
            message, status = _failure(error)
            log.error("daemon.failed", message=message, exit_code=status)
            raise click.exceptions.Exit(status) from None
    finally:
        flush_logs()  # before anything this process prints after the loop
        engine.dispose()


def _serve(
    environment: Environment,
    settings: Settings,
    engine: Engine,
    log: Any,
    early: EarlySignals,
    database: str | None,
    *,
    dry_run: bool,
) -> int:
    """The daemon's start once logging is set up: the schema, then the loop until it drains."""
    import asyncio

    from sweepd.daemon import Daemon
    from sweepd.db import migrate
    from sweepd.lifecycle import serve

    for warning in settings.warnings:
        log.warning(
            "config.warning", location=warning.location, path=warning.path, message=warning.message
        )
    log.info(
        "daemon.starting",
        config=settings.path,
        database=mask_url(settings.database.url),
        namespace=settings.namespace,
    )
    if settings.database.migrate == "auto" and not dry_run:
        before, after = migrate.upgrade(settings.database.url)
        if before != after:
            log.info("schema.upgraded", before=before, after=after)
    migrate.require_current(engine)

    def reload() -> Settings:
        # The environment as read at start: a reload re-reads the file only.
        return load_settings(settings.path, environment, Overrides(database_url=database))

    daemon = Daemon(settings, engine, dry_run=dry_run, reload=reload)
    status = asyncio.run(serve(daemon, log, early, environment.systemd))
    left = _threads_left()
    if left:
        log.warning("daemon.threads_left", threads=left, action="exit without waiting for them")
    return status


def _threads_left() -> list[str]:
    """Threads a sweep started and left running (not daemon threads): the
    interpreter's exit would wait for them, forever if they never end."""
    main = threading.main_thread()
    return [t.name for t in threading.enumerate() if t is not main and not t.daemon]


def _database_url(
    environment: Environment, config: str | None, database: str | None
) -> tuple[str, str, str]:
    """(url, namespace, migrate) by the usual order: --database, $SWEEPD_DATABASE_URL, the config."""
    path = config or environment.config
    if path:
        found, namespace = load_database(path, environment, Overrides(database_url=database))
        return found.url, namespace, found.migrate
    url = database or environment.database_url
    if not url:
        # No quiet fallback to a local SQLite file here: the same command on
        # three hosts would then "coordinate" through three different files.
        raise UsageError(
            "no database given: pass --database URL, set SWEEPD_DATABASE_URL, or name a config with --config"
        )
    return url, environment.namespace or "default", "auto"


@cli.group()
def db() -> None:
    """Manage sweepd's tables: upgrade, check, or print their DDL."""


@db.command("upgrade")
@config_option
@database_option
@click.pass_obj
def db_upgrade(environment: Environment, config: str | None, database: str | None) -> int:
    """Create or upgrade sweepd's tables (safe to run from several replicas at once)."""
    from sweepd.db import migrate

    url, _namespace, _migrate = _database_url(environment, config, database)
    before, after = migrate.upgrade(url)
    click.echo(
        f"schema already at {after}"
        if before == after
        else f"schema upgraded: {before or 'none'} -> {after}"
    )
    return ExitCode.OK


@db.command("check")
@config_option
@database_option
@click.pass_obj
def db_check(environment: Environment, config: str | None, database: str | None) -> int:
    """Exit 1 unless the schema is current."""
    from sweepd.db.health import check_database

    url, _namespace, _migrate = _database_url(environment, config, database)
    report = check_database(url)
    if not report.reachable:
        raise SweepdError(f"database unreachable: {report.error}")
    if not report.current:
        click.echo(
            f"schema is {report.revision or 'missing'}, sweepd needs {report.head}: run `sweepd db upgrade`",
            err=True,
        )
        return ExitCode.FAILED
    click.echo(f"schema current ({report.revision})")
    return ExitCode.OK


@db.command("sql")
@click.option(
    "--dialect",
    type=click.Choice(["postgresql", "mysql", "sqlite"]),
    help="The DDL for this dialect (default: the database's).",
)
@config_option
@database_option
@click.pass_obj
def db_sql(
    environment: Environment, dialect: str | None, config: str | None, database: str | None
) -> int:
    """Print the DDL that `db upgrade` runs on an empty database, for a DBA to apply.

    The dialect is --dialect's, else the database's (found as `db upgrade` finds
    it), read from its URL: nothing connects, and no driver is needed.
    """
    from sweepd.db import migrate
    from sweepd.db.url import normalize_url

    if dialect is None:
        if not (database or environment.database_url or config or environment.config):
            raise UsageError(
                "no dialect given: pass --dialect postgresql|mysql|sqlite, or the database"
                " (--database URL, SWEEPD_DATABASE_URL or --config PATH)"
            )
        url, _namespace, _migrate = _database_url(environment, config, database)
        dialect = normalize_url(url).get_backend_name()
    click.echo(migrate.sql(dialect), nl=False)
    return ExitCode.OK


@cli.command("lock")
@click.argument("name")
@click.argument("command", nargs=-1, required=True, metavar="-- COMMAND...")
@click.option(
    "--ttl",
    required=True,
    metavar="DURATION",
    help="Lease time to live; heartbeats keep a live holder's.",
)
@click.option(
    "--every", metavar="DURATION", help="The tick is the current epoch-aligned slot of this length."
)
@click.option("--tick", "tick_text", metavar="DATETIME", help="The tick, as an ISO 8601 instant.")
@click.option(
    "--skip-exit",
    default=0,
    show_default=True,
    type=click.IntRange(0, 255),
    help="Exit status when another holder has the lease.",
)
@click.option(
    "--namespace",
    metavar="NAME",
    help="Lease namespace (default: $SWEEPD_NAMESPACE, the config, then 'default').",
)
@config_option
@database_option
@click.pass_obj
def lock(
    environment: Environment,
    name: str,
    command: tuple[str, ...],
    ttl: str,
    every: str | None,
    tick_text: str | None,
    skip_exit: int,
    namespace: str | None,
    config: str | None,
    database: str | None,
) -> int:
    """Run COMMAND only if this process wins the lease NAME.

    The same line in the crontab of three hosts runs COMMAND once per tick.
    A loser says on stderr who holds the lease and exits with --skip-exit.
    """
    from sweepd.config import NAME_PATTERN
    from sweepd.db import migrate
    from sweepd.db.engine import make_engine
    from sweepd.guard import run_locked
    from sweepd.lease import LeaseStore, make_holder
    from sweepd.observe import configure_logging, get_logger
    from sweepd.schedule import Every, previous_tick

    if not NAME_PATTERN.fullmatch(name):
        raise UsageError(
            f"lock: invalid name {name!r}: use lowercase letters, digits, '.', '_' and '-'"
        )
    lease_ttl = _duration(ttl, "--ttl")
    if every is not None and tick_text is not None:
        raise UsageError("lock: give --every or --tick, not both")
    tick = None
    if every is not None:
        tick = previous_tick(Every(_duration(every, "--every")), datetime.now(UTC))
    elif tick_text is not None:
        tick = _instant(tick_text, "--tick")
    url, config_namespace, migrate_mode = _database_url(environment, config, database)
    configure_logging(
        _log_format(environment.log_format), _log_level(environment.log_level, "warning")
    )
    if migrate_mode == "auto":
        migrate.upgrade(url)
    engine = make_engine(url)
    try:
        if migrate_mode == "never":
            migrate.require_current(engine)
        store = LeaseStore(engine, namespace or environment.namespace or config_namespace)
        holder = make_holder()
        log = get_logger(sweep=name, tick=tick.isoformat() if tick else None, holder=holder)

        def on_event(event: str, fields: dict[str, Any]) -> None:
            if event in ("lease.claimed", "lease.released"):
                log.debug(event, **fields)
            elif event == "lease.renew_failed":
                log.warning(event, **fields)
            else:
                log.error(event, **fields)

        outcome = run_locked(
            store, name, command, ttl=lease_ttl, tick=tick, holder=holder, on_event=on_event
        )
    finally:
        engine.dispose()
    if isinstance(outcome, int):
        return outcome
    if outcome.reason == "already_run":
        click.echo(
            f"sweepd lock: {name}: tick {_iso(outcome.tick)} already claimed by {outcome.holder}; not running",
            err=True,
        )
    else:
        click.echo(
            f"sweepd lock: {name}: held by {outcome.holder} until {_iso(outcome.expires_at)}; not running",
            err=True,
        )
    return skip_exit


@cli.command("status")
@config_option
@database_option
@format_option
@click.option(
    "--check",
    is_flag=True,
    help="Print only the problems, one a line, and exit 1 if any sweep is stale or has gaps.",
)
@click.option(
    "--window",
    metavar="DURATION",
    help="Look for gaps this far back only (default: history.keep).",
)
@click.pass_obj
def status(
    environment: Environment,
    config: str | None,
    database: str | None,
    output: str,
    check: bool,
    window: str | None,
) -> int:
    """Each sweep's lease, last run, last success and next tick; STALE and gaps."""
    from sweepd.db import migrate
    from sweepd.db.engine import make_engine
    from sweepd.status import as_json, read
    from sweepd.status import render_text as render_status

    span = _duration(window, "--window") if window is not None else None
    settings = _settings(environment, config, database)
    engine = make_engine(settings.database.url)
    try:
        migrate.require_current(engine)
        report = read(engine, settings, span)
    finally:
        engine.dispose()
    problems = report.problems()
    if output == "json":
        click.echo(json.dumps(as_json(report, settings.database.url), indent=2))
    elif not check:
        click.echo(render_status(report, settings.database.url))
    elif problems:
        for problem in problems:
            click.echo(problem)
    else:
        click.echo(f"ok: {len(report.sweeps)} sweeps, none stale, no gaps")
    return ExitCode.FAILED if check and problems else ExitCode.OK


@cli.command("history")
@click.argument("name", required=False)
@click.option(
    "--limit", default=20, show_default=True, type=click.IntRange(min=1), help="Rows shown at most."
)
@click.option(
    "--status", "status_", type=click.Choice(get_args(Status)), help="Only runs in this status."
)
@click.option("--since", metavar="DURATION", help="Only runs started within this long ago.")
@config_option
@database_option
@format_option
@click.pass_obj
def history(
    environment: Environment,
    name: str | None,
    limit: int,
    status_: Status | None,
    since: str | None,
    config: str | None,
    database: str | None,
    output: str,
) -> int:
    """The recorded runs, newest first: of sweep NAME, or of all."""
    from sweepd.db import migrate
    from sweepd.db.engine import make_engine
    from sweepd.history import History
    from sweepd.status import render_runs, runs_json

    within = _duration(since, "--since") if since is not None else None
    url, namespace, _migrate = _database_url(environment, config, database)
    engine = make_engine(url)
    try:
        migrate.require_current(engine)
        rows = History(engine, namespace).runs(name, limit, status=status_, since=within)
    finally:
        engine.dispose()
    if output == "json":
        click.echo(json.dumps(runs_json(namespace, rows), indent=2))
    else:
        click.echo(render_runs(rows) if rows else "no runs found")
    return ExitCode.OK


@cli.command("trigger")
@click.argument("name")
@config_option
@database_option
@format_option
@click.pass_obj
def trigger(
    environment: Environment, name: str, config: str | None, database: str | None, output: str
) -> int:
    """Run sweep NAME once, now, in this process, under its lease.

    The run is recorded trigger=manual and records no tick in the lease, so the
    next scheduled tick is neither blocked nor moved. Exit 0 on success; 1 if
    the run failed or timed out, or another holder has the lease. SIGINT or
    SIGTERM asks the run to stop (recorded cancelled); a second one ends it.
    """
    from sweepd.db.engine import make_engine
    from sweepd.observe import configure_logging, flush_logs

    settings = _settings(environment, config, database)
    sweep = settings.sweep(name)
    if sweep is None:
        known = ", ".join(sorted(s.name for s in settings.sweeps)) or "none"
        raise UsageError(f"trigger: unknown sweep {name!r} (known: {known})")
    engine = make_engine(settings.database.url)
    try:
        configure_logging(settings.log_format, settings.log_level)
        outcome, held = _run_once(settings, engine, sweep)
    finally:
        flush_logs()  # the run's lines before the outcome's
        engine.dispose()
    result: dict[str, Any] = {"sweep": name, "outcome": outcome}
    if held is not None:
        result.update(held_by=held[0], expires_at=_iso(held[1]))
        click.echo(
            f"sweepd trigger: {name}: held by {held[0]} until {_iso(held[1])}; not running",
            err=True,
        )
    elif outcome != "success":
        click.echo(f"sweepd trigger: {name}: {outcome}", err=True)
    if output == "json":
        click.echo(json.dumps(result))
    elif outcome == "success":
        click.echo(f"{name}: success")
    return ExitCode.OK if outcome == "success" else ExitCode.FAILED


def _run_once(
    settings: Settings, engine: Engine, sweep: SweepDef
) -> tuple[str, tuple[str, datetime] | None]:
    """The outcome of one manual run by the daemon's own Runner, and who held the
    lease (holder, expiry) when it was held."""
    import asyncio
    import signal
    from collections import Counter

    from sweepd.clock import SystemClock
    from sweepd.db import migrate
    from sweepd.history import History
    from sweepd.lease import LeaseStore, make_holder
    from sweepd.observe import get_logger
    from sweepd.runner import Runner

    if settings.database.migrate == "auto":
        migrate.upgrade(settings.database.url)
    migrate.require_current(engine)
    store = LeaseStore(engine, settings.namespace)
    holder = make_holder()
    log = get_logger(holder=holder, namespace=settings.namespace)
    runner = Runner(
        store,
        History(engine, settings.namespace),
        holder,
        SystemClock(),
        log,
        Counter(),
        concurrency=1,
    )

    async def once() -> str:
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            # The first signal stops the run as a drain's deadline does: recorded
            # cancelled, its lease released. A second one is not caught.
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            runner.drain()
            runner.stop(sweep.name, "cancelled")

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, interrupt)
        outcome = await runner.execute(sweep, None, trigger="manual")
        if runner.unfinished or runner.unreleased:
            await runner.settle()  # a row or a release the database refused at the end
        return outcome

    outcome = asyncio.run(once())
    if outcome != "lease_held":
        return outcome, None
    # Read after the fact: the holder may have let go since, but it held the lease then.
    row = store.read(sweep.name)
    return outcome, None if row is None else (row.holder, row.expires_at)


def _log_format(value: str | None) -> LogFormat:
    if value in (None, "auto", "console", "json"):
        return cast(LogFormat, value or "auto")
    raise UsageError(f"$SWEEPD_LOG_FORMAT: expected auto, console or json, got {value!r}")


def _log_level(value: str | None, default: LogLevel) -> LogLevel:
    if value in (None, "debug", "info", "warning", "error"):
        return cast(LogLevel, value or default)
    raise UsageError(f"$SWEEPD_LOG_LEVEL: expected debug, info, warning or error, got {value!r}")


def _iso(instant: datetime | None) -> str:
    return "?" if instant is None else instant.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _duration(text: str, option: str) -> timedelta:
    try:
        value = parse_duration(text)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None
    if value <= timedelta(0):
        raise UsageError(f"{option}: must be longer than zero")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    environment = read_environment(os.environ)  # the one moment the environment is read
    try:
        result: Any = cli.main(
            args=list(argv) if argv is not None else None,
            prog_name="sweepd",
            standalone_mode=False,
            obj=environment,
        )
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        context = getattr(exc, "ctx", None)
        where = context.command_path if context is not None else "sweepd"
        _say(f"{where}: {exc.format_message()}")
        return ExitCode.USAGE
    except click.Abort:
        return 130
    except ConfigError as exc:
        for problem in exc.problems:
            _say(str(problem))
        return exc.exit_code
    except (SweepdError, SQLAlchemyError) as exc:
        message, status = _failure(exc)
        _say(f"sweepd: {message}")
        return status
    return int(result or 0)


def _say(line: str) -> None:
    """One line on stderr: a control character from the input (a line break, an
    escape) is written as its escape, so it cannot split or garble the line."""
    click.echo("".join(c if c.isprintable() else repr(c)[1:-1] for c in line), err=True)


def _failure(error: SweepdError | SQLAlchemyError) -> tuple[str, int]:
    """What went wrong, in one line, and the exit status it maps to."""
    if isinstance(error, SweepdError):
        return str(error), error.exit_code
    # A database fault that no layer below named: still one line, no password.
    orig = getattr(error, "orig", None) or error
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"database error: {mask_text(f'{type(orig).__name__}: {first}')}", ExitCode.FAILED


def entry() -> None:
    status = main()
    runner = sys.modules.get("sweepd.runner")  # loaded only by `sweepd run`
    if runner is not None and (runner.sweep_threads_busy() or _threads_left()):
        # A sync sweep that ignored its cancel is still running on its thread,
        # or a sweep left a thread of its own. Every run is recorded and every
        # lease released; what is left is the interpreter's teardown, which
        # would wait for those threads, or free the modules under their feet
        # (CPython 3.11 can crash there: a drain exited with SIGSEGV, once, in
        # this project's CI). Nothing here needs it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
