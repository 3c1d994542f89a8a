"""The command line: the only module that prints or exits.

``main(argv) -> int`` runs one command and maps every sweepd exception to
its exit code in one place; ``entry()`` is the console script.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import click

from sweepd import __version__
from sweepd.config import Overrides, load_settings
from sweepd.environment import Environment, read_environment
from sweepd.errors import ConfigError, ExitCode, SweepdError, UsageError
from sweepd.model import Settings
from sweepd.plan import describe, render_text


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sweepd", message="%(prog)s %(version)s")
def cli() -> None:
    """sweepd runs periodic sweeps, each tick exactly once across replicas."""


@cli.command("check-config")
@config_option
@database_option
@click.option(
    "--format", "output", type=click.Choice(["text", "json"]), default="text", show_default=True
)
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
    note = (
        "not checked (--no-db)"
        if no_db
        else "not checked: database checks are not built yet, as --no-db"
    )
    report = describe(
        settings, instant, database={"url": _masked(settings), "checked": False, "summary": note}
    )
    if output == "json":
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_text(report))
        for warning in settings.warnings:
            click.echo(f"warning: {warning}", err=True)
    return ExitCode.OK


def _masked(settings: Settings) -> str:
    from sweepd.redact import mask_url

    return mask_url(settings.database.url)


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
        click.echo(f"{where}: {exc.format_message()}", err=True)
        return ExitCode.USAGE
    except click.Abort:
        return 130
    except ConfigError as exc:
        for problem in exc.problems:
            click.echo(str(problem), err=True)
        return exc.exit_code
    except SweepdError as exc:
        click.echo(f"sweepd: {exc}", err=True)
        return exc.exit_code
    return int(result or 0)


def entry() -> None:
    sys.exit(main())
