"""What ``check-config`` reports: each sweep, where it came from, and its next ticks.

The JSON form is a stable shape (docs/check-config.md): ``version`` changes
only when a field is removed or changes meaning; new fields may appear.
"""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import islice
from typing import Any

from sweepd.durations import format_duration
from sweepd.model import Settings, SweepDef
from sweepd.redact import mask_url
from sweepd.schedule import EPOCH, Cron, Every, ticks_from

REPORT_VERSION = 1


def _iso(instant: datetime) -> str:
    return instant.astimezone(UTC).isoformat().replace("+00:00", "Z")


def schedule_data(sweep: SweepDef) -> dict[str, Any]:
    """A sweep's schedule as check-config's JSON shows it (``status`` shows it the same way)."""
    schedule = sweep.schedule
    if isinstance(schedule, Every):
        return {
            "kind": "every",
            "every": format_duration(schedule.interval),
            "anchor": None if schedule.anchor == EPOCH else _iso(schedule.anchor),
            "timezone": "UTC",
        }
    return {"kind": "cron", "cron": schedule.expression, "timezone": schedule.timezone}


def schedule_text(schedule: dict[str, Any]) -> str:
    """``schedule_data`` in one phrase: ``every 30s`` or ``cron '30 2 * * *' Europe/Berlin``."""
    if schedule["kind"] == "every":
        anchor = f" from {schedule['anchor']}" if schedule["anchor"] else ""
        return f"every {schedule['every']}{anchor}"
    return f"cron '{schedule['cron']}' {schedule['timezone']}"


def _next_ticks(sweep: SweepDef, start: datetime, count: int) -> list[dict[str, str]]:
    if not sweep.enabled:
        return []
    schedule = sweep.schedule
    zone = schedule.zone if isinstance(schedule, Cron) else UTC
    return [
        {"utc": _iso(tick), "local": tick.astimezone(zone).isoformat()}
        for tick in islice(ticks_from(schedule, start), count)
    ]


def describe(
    settings: Settings, start: datetime, count: int = 3, database: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The report as plain data, ticks counted from ``start`` (inclusive)."""
    return {
        "version": REPORT_VERSION,
        "config": settings.path,
        "from": _iso(start),
        "namespace": settings.namespace,
        "database": database or {"url": mask_url(settings.database.url), "checked": False},
        "sweeps": [
            {
                "name": sweep.name,
                "source": sweep.source,
                "callable": sweep.target,
                "enabled": sweep.enabled,
                "schedule": schedule_data(sweep),
                "ttl": format_duration(sweep.ttl),
                "timeout": None if sweep.timeout is None else format_duration(sweep.timeout),
                "misfire_grace": format_duration(sweep.misfire_grace),
                "jitter": format_duration(sweep.jitter),
                "retries": {
                    "max": sweep.retries.max,
                    "backoff": format_duration(sweep.retries.backoff),
                },
                "coalesce": sweep.coalesce,
                "catch_up": sweep.catch_up,
                "next_ticks": _next_ticks(sweep, start, count),
            }
            for sweep in sorted(settings.sweeps, key=lambda s: s.name)
        ],
        "warnings": [
            {"location": w.location, "path": w.path, "message": w.message}
            for w in settings.warnings
        ],
    }


def render_text(report: dict[str, Any]) -> str:
    db = report["database"]
    lines = [
        f"config     {report['config']}: {len(report['sweeps'])} sweeps, {len(report['warnings'])} warnings",
        f"namespace  {report['namespace']}",
        f"database   {db['url']} ({db.get('summary') or 'not checked'})",
        f"from       {report['from']}",
    ]
    for sweep in report["sweeps"]:
        schedule = sweep["schedule"]
        when = schedule_text(schedule)
        state = "" if sweep["enabled"] else "  DISABLED"
        lines += [
            "",
            f"{sweep['name']}  {when}{state}",
            f"  callable {sweep['callable']}   source {sweep['source']}",
            f"  ttl {sweep['ttl']}   timeout {sweep['timeout'] or 'none'}   "
            f"misfire_grace {sweep['misfire_grace']}   retries {sweep['retries']['max']}",
        ]
        for tick in sweep["next_ticks"]:
            local = (
                ""
                if schedule["timezone"] == "UTC"
                else f"   {tick['local']} {schedule['timezone']}"
            )
            lines.append(f"  next {tick['utc']}{local}")
    return "\n".join(lines)
