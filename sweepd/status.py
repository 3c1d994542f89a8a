"""The state of the sweeps as the database records it: what ``sweepd status`` shows.

Every judgement uses the database's clock (``LeaseStore.now()``), read once per
report, so two hosts asking at one instant get one answer whatever their own
clocks say. The rules (docs/operations.md explains them to operators):

- **STALE**: no success within ``stale_after`` = 2 intervals + ttl, counted from
  the end of the last successful run, manual or scheduled. A cron schedule's
  interval is the gap between its last two ticks before now. A sweep that never
  succeeded is counted from its oldest row, so a new sweep is not stale before
  it had the chance; one with no row at all is not stale (nothing tells a sweep
  added a minute ago from one never deployed). A disabled sweep is never stale.
- **Gaps**: the ticks that no replica ran, i.e. no ``sweep_runs`` row has that
  tick (coalesced and missed ticks among them). Looked for from the sweep's
  first recorded scheduled tick, but not further back than ``history.keep`` (or
  the window asked for), up to ``misfire_grace + jitter + ttl`` ago: a younger
  tick may still be waiting to fire or to be claimed. A recorded tick that is
  not one of the current schedule's was fired under an earlier schedule: the
  ticks before it are not counted, since they were not due then.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import chain
from typing import Any

from sqlalchemy import Connection, Engine, Select, select
from sqlalchemy.exc import SQLAlchemyError

from sweepd.db.engine import store_fault
from sweepd.db.schema import sweep_runs
from sweepd.durations import format_duration
from sweepd.history import RunRow
from sweepd.lease import LeaseRow, LeaseStore
from sweepd.model import Settings, SweepDef
from sweepd.plan import schedule_data, schedule_text
from sweepd.redact import mask_url
from sweepd.schedule import Schedule, next_tick, stale_after, ticks_from

REPORT_VERSION = 1  # changes only when a field of the JSON is removed or changes meaning
# Gap ticks listed per sweep; the count says how many there are in all. A screenful
# of ticks says no more than the first few and the last.
GAPS_SHOWN = 5
_MICRO = timedelta(microseconds=1)


@dataclass(frozen=True)
class Gaps:
    """The ticks of the window [since, until) that no replica ran."""

    count: int = 0
    ticks: tuple[datetime, ...] = ()  # the first GAPS_SHOWN, oldest first
    last: datetime | None = None
    since: datetime | None = None  # None: no scheduled tick recorded, no window
    until: datetime | None = None


@dataclass(frozen=True)
class SweepStatus:
    sweep: SweepDef
    lease: LeaseRow | None
    lease_expired: bool | None  # by the database's clock; None without a lease row
    last_run: RunRow | None
    last_success: RunRow | None
    first_run: datetime | None  # the oldest row's start, what a never-successful sweep counts from
    next_tick: datetime | None
    stale_after: timedelta | None  # None for a disabled sweep
    stale: bool
    gaps: Gaps


@dataclass(frozen=True)
class Report:
    namespace: str
    now: datetime  # the database's clock
    sweeps: tuple[SweepStatus, ...]

    def problems(self) -> list[str]:
        """One line per stale sweep and per sweep with gaps."""
        lines = []
        for state in self.sweeps:
            if state.stale:
                lines.append(_stale_line(state, self.now))
            if state.gaps.count:
                lines.append(_gaps_line(state))
        return lines


def read(engine: Engine, settings: Settings, window: timedelta | None = None) -> Report:
    """The report on the config's sweeps; gaps are looked for within ``window``
    (default ``history.keep``)."""
    store = LeaseStore(engine, settings.namespace)
    now = store.now()
    earliest = now - (window or settings.history_keep)
    sweeps = tuple(
        _sweep_status(engine, store, sweep, now, earliest)
        for sweep in sorted(settings.sweeps, key=lambda s: s.name)
    )
    return Report(settings.namespace, now, sweeps)


def _sweep_status(
    engine: Engine, store: LeaseStore, sweep: SweepDef, now: datetime, earliest: datetime
) -> SweepStatus:
    lease = store.read(sweep.name)
    c = sweep_runs.c
    rows = select(sweep_runs).where(c.namespace == store.namespace, c.name == sweep.name)
    try:
        with engine.connect() as connection:
            last_run = _first(connection, rows.order_by(c.started_at.desc(), c.id.desc()))
            last_success = _first(
                connection,
                rows.where(c.status == "success").order_by(c.started_at.desc(), c.id.desc()),
            )
            oldest = _first(connection, rows.order_by(c.started_at, c.id))
            gaps = Gaps()
            if sweep.enabled:
                recorded = connection.execute(
                    select(c.tick)
                    .where(c.namespace == store.namespace, c.name == sweep.name)
                    .where(c.tick.is_not(None))
                    .order_by(c.tick)
                ).scalars()
                young = sweep.misfire_grace + sweep.jitter + sweep.ttl
                gaps = find_gaps(sweep.schedule, recorded, earliest, now - young)
    except SQLAlchemyError as error:
        raise store_fault("status read", sweep.name, engine, error) from error

    limit = stale_after(sweep.schedule, sweep.ttl, now) if sweep.enabled else None
    since: datetime | None = None
    if last_success is not None:
        since = last_success.finished_at or last_success.started_at
    elif oldest is not None:
        since = oldest.started_at
    return SweepStatus(
        sweep=sweep,
        lease=lease,
        lease_expired=None if lease is None else lease.expires_at <= now,
        last_run=last_run,
        last_success=last_success,
        first_run=None if oldest is None else oldest.started_at,
        next_tick=next_tick(sweep.schedule, now) if sweep.enabled else None,
        stale_after=limit,
        stale=limit is not None and since is not None and now - since > limit,
        gaps=gaps,
    )


def _first(connection: Connection, query: Select[Any]) -> RunRow | None:
    row = connection.execute(query.limit(1)).first()
    return None if row is None else RunRow(**row._mapping)


# -- the rules ------------------------------------------------------------------------------------


@dataclass
class _Tally:
    since: datetime
    count: int = 0
    first: list[datetime] = field(default_factory=list)
    last: datetime | None = None

    def add(self, tick: datetime) -> None:
        self.count += 1
        self.last = tick
        if len(self.first) < GAPS_SHOWN:
            self.first.append(tick)


def find_gaps(
    schedule: Schedule, recorded: Iterable[datetime], earliest: datetime, until: datetime
) -> Gaps:
    """The ticks of ``schedule`` before ``until`` that ``recorded`` (ascending, repeats
    allowed) lacks, from its first tick on but not before ``earliest``.

    One pass over both, so a long history costs no set of every tick in memory.
    """
    ticks = iter(recorded)
    first = next(ticks, None)
    if first is None:
        return Gaps()
    tally = _Tally(max(earliest, first))
    expected = ticks_from(schedule, tally.since)
    due = next(expected, None)
    previous = None
    for tick in chain([first], ticks):
        if tick < tally.since or tick == previous:
            continue
        previous = tick
        while due is not None and due < tick:
            if due < until:
                tally.add(due)
            due = next(expected, None)
        if due == tick:
            due = next(expected, None)
        else:
            # Not one of this schedule's ticks: fired under an earlier schedule,
            # so this one's ticks before it were never due.
            tally = _Tally(tick + _MICRO)
    while due is not None and due < until:
        tally.add(due)
        due = next(expected, None)
    return Gaps(tally.count, tuple(tally.first), tally.last, tally.since, until)


# -- the report's two forms -------------------------------------------------------------------------


def _iso(instant: datetime | None) -> str | None:
    return None if instant is None else instant.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _short(delta: timedelta) -> str:
    """A duration to the second, in its two largest units: ``3m12s``, ``2d4h``."""
    seconds = timedelta(seconds=round(abs(delta.total_seconds())))
    return "".join(re.findall(r"\d+[a-z]+", format_duration(seconds))[:2])


def _stale_line(state: SweepStatus, now: datetime) -> str:
    assert state.stale_after is not None
    limit = f"stale after {format_duration(state.stale_after)} (2 intervals + ttl)"
    success = state.last_success
    if success is None:
        assert state.first_run is not None
        return (
            f"{state.sweep.name}: STALE: never succeeded; first run {_iso(state.first_run)},"
            f" {_short(now - state.first_run)} ago; {limit}"
        )
    ended = success.finished_at or success.started_at
    return (
        f"{state.sweep.name}: STALE: last success {_iso(ended)}, {_short(now - ended)} ago; {limit}"
    )


def _gaps_line(state: SweepStatus) -> str:
    gaps = state.gaps
    shown = ", ".join(str(_iso(tick)) for tick in gaps.ticks)
    if gaps.count > len(gaps.ticks):
        shown += f" ... {_iso(gaps.last)}"
    noun = "tick" if gaps.count == 1 else "ticks"
    return f"{state.sweep.name}: {gaps.count} {noun} no replica ran: {shown}"


def _run(row: RunRow | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {
        "id": row.id,
        "tick": _iso(row.tick),
        "trigger": row.trigger,
        "attempt": row.attempt,
        "status": row.status,
        "started_at": _iso(row.started_at),
        "finished_at": _iso(row.finished_at),
        "holder": row.holder,
        "error": row.error,
    }


def _lease(state: SweepStatus) -> dict[str, Any] | None:
    lease = state.lease
    if lease is None:
        return None
    return {
        "holder": lease.holder,
        "acquired_at": _iso(lease.acquired_at),
        "expires_at": _iso(lease.expires_at),
        "expired": state.lease_expired,
        "tick": _iso(lease.tick),
        "fencing_token": lease.fencing_token,
    }


def as_json(report: Report, database_url: str) -> dict[str, Any]:
    """The report as plain data, in the stable shape docs/operations.md describes."""
    problems = report.problems()
    return {
        "version": REPORT_VERSION,
        "namespace": report.namespace,
        "database": mask_url(database_url),
        "now": _iso(report.now),
        "ok": not problems,
        "problems": problems,
        "sweeps": [
            {
                "name": state.sweep.name,
                "enabled": state.sweep.enabled,
                "schedule": schedule_data(state.sweep),
                "ttl": format_duration(state.sweep.ttl),
                "lease": _lease(state),
                "last_run": _run(state.last_run),
                "last_success": _run(state.last_success),
                "first_run": _iso(state.first_run),
                "next_tick": _iso(state.next_tick),
                "stale": state.stale,
                "stale_after": None
                if state.stale_after is None
                else format_duration(state.stale_after),
                "gaps": {
                    "count": state.gaps.count,
                    "ticks": [_iso(tick) for tick in state.gaps.ticks],
                    "last": _iso(state.gaps.last),
                    "since": _iso(state.gaps.since),
                    "until": _iso(state.gaps.until),
                },
            }
            for state in report.sweeps
        ],
    }


def _row(state: SweepStatus, now: datetime) -> list[str]:
    lease = state.lease
    if lease is None:
        held = "-"
    elif state.lease_expired:
        held = f"{lease.holder} (expired {_short(now - lease.expires_at)} ago)"
    else:
        held = f"{lease.holder} (expires in {_short(lease.expires_at - now)})"
    run = state.last_run
    last = "never"
    if run is not None:
        manual = ", manual" if run.trigger == "manual" else ""
        last = f"{run.status} {_short(now - run.started_at)} ago{manual}"
    success = state.last_success
    succeeded = "never"
    if success is not None:
        succeeded = f"{_short(now - (success.finished_at or success.started_at))} ago"
    if not state.sweep.enabled:
        verdict = "disabled"
    else:
        verdict = "STALE" if state.stale else "ok"
        if state.gaps.count:
            verdict += f", {state.gaps.count} {'gap' if state.gaps.count == 1 else 'gaps'}"
    upcoming = "-" if state.next_tick is None else f"in {_short(state.next_tick - now)}"
    return [
        state.sweep.name,
        schedule_text(schedule_data(state.sweep)),
        held,
        last,
        succeeded,
        upcoming,
        verdict,
    ]


def render_text(report: Report, database_url: str) -> str:
    """A table, one sweep a line, then the problems ``--check`` would print."""
    header = ["SWEEP", "SCHEDULE", "LEASE", "LAST RUN", "LAST SUCCESS", "NEXT TICK", "STATE"]
    lines = [
        f"namespace {report.namespace}   database {mask_url(database_url)}"
        f"   now {_iso(report.now)} (the database's clock)",
        "",
        *_table([header, *(_row(state, report.now) for state in report.sweeps)]),
    ]
    problems = report.problems()
    if problems:
        lines += ["", *problems]
    return "\n".join(lines)


# -- history ------------------------------------------------------------------------------------

RUNS_VERSION = 1  # of ``sweepd history --format json``, on the same terms as REPORT_VERSION
ERROR_SHOWN = 60  # characters of a run's error in the text table; the JSON has all of it


def _duration(row: RunRow) -> float | None:
    if row.finished_at is None:
        return None
    return round((row.finished_at - row.started_at).total_seconds(), 6)


def runs_json(namespace: str, rows: list[RunRow]) -> dict[str, Any]:
    return {
        "version": RUNS_VERSION,
        "namespace": namespace,
        "runs": [
            {"sweep": row.name, **(_run(row) or {}), "duration": _duration(row)} for row in rows
        ],
    }


def _seconds(instant: datetime | None) -> str:
    if instant is None:
        return "-"
    return instant.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def render_runs(rows: list[RunRow]) -> str:
    """The rows as a table, newest first as given; an error in one line, cut short."""
    header = ["ID", "SWEEP", "TICK", "TRIGGER", "ATTEMPT", "STATUS", "STARTED", "FINISHED"]
    header += ["DURATION", "HOLDER", "ERROR"]
    table = [header]
    for row in rows:
        error = " ".join((row.error or "").split())
        if len(error) > ERROR_SHOWN:
            error = error[: ERROR_SHOWN - 3] + "..."
        duration = _duration(row)
        table.append(
            [
                str(row.id),
                row.name,
                _iso(row.tick) or "-",
                row.trigger,
                str(row.attempt),
                row.status,
                _seconds(row.started_at),
                _seconds(row.finished_at),
                "-" if duration is None else f"{duration:.3f}s",
                row.holder,
                error or "-",
            ]
        )
    return "\n".join(_table(table))


def _table(rows: list[list[str]]) -> list[str]:
    """Rows of cells in columns as wide as their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
