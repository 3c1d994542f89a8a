"""Tick identity: when a sweep's ticks are, the same on every replica.

A tick is named by (sweep, scheduled time), so the scheduled times must not
depend on when a replica started or what its clock says. Every function here
is pure: it takes the instant to reason from as an argument and never reads a
clock. This is the only module that imports APScheduler.

``every`` schedules are computed here in whole microseconds, not by
APScheduler's IntervalTrigger: that trigger counts in float seconds from its
own start time, and tick identity cannot afford a rounding that makes two
replicas disagree on a boundary. ``cron`` schedules are APScheduler's
CronTrigger, so time zones and DST gaps and repeats resolve exactly as it
resolves them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from itertools import islice
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger

from sweepd.durations import format_duration

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)
# How far back previous_tick looks for a cron tick before it gives up: a
# "29 February on a Monday" schedule fires once in 28 years.
_CRON_LOOKBACK = timedelta(days=366 * 30)


@dataclass(frozen=True)
class Every:
    """Ticks at ``anchor + k * interval`` for every integer k."""

    interval: timedelta
    anchor: datetime = EPOCH

    def describe(self) -> str:
        text = f"every {format_duration(self.interval)}"
        return text if self.anchor == EPOCH else f"{text} from {self.anchor.isoformat()}"


@dataclass(frozen=True)
class Cron:
    """Ticks where a five-field crontab expression (or an ``@daily`` alias) matches, in ``timezone``."""

    expression: str
    timezone: str = "UTC"
    _trigger: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once, eagerly, so a bad expression fails where the config is read.
        object.__setattr__(self, "_trigger", _cron_trigger(self.expression, self.timezone))

    @cached_property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def describe(self) -> str:
        return f"cron {self.expression!r} {self.timezone}"


Schedule = Every | Cron

# crontab counts weekdays from Sunday = 0 (and 7), APScheduler 3 from Monday = 0.
# Numbers are translated to names so "0 3 * * 1" means Monday, as in crontab.
_WEEKDAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_WEEKDAY_TOKEN = re.compile(r"(\*|\d+)(?:-(\d+))?(?:/(\d+))?")


def _translate_weekdays(spelled: str) -> str:
    out: list[str] = []
    for token in spelled.split(","):
        match = _WEEKDAY_TOKEN.fullmatch(token)
        if match is None:
            out.append(token)  # names, or something APScheduler will reject for us
            continue
        first, last, step = match.groups()
        if first == "*" and last is None:
            if step is None:
                out.append("*")
                continue
            low, high = 0, 6
        elif first == "*":
            raise ValueError(f"invalid day-of-week {token!r}")
        else:
            low = int(first)
            high = int(last) if last is not None else (6 if step is not None else low)
        if not (0 <= low <= 7 and 0 <= high <= 7 and low <= high):
            raise ValueError(f"day-of-week {token!r} is out of range 0-7")
        days = range(low, high + 1, int(step) if step else 1)
        out.extend(_WEEKDAY_NAMES[day % 7] for day in days)
    return ",".join(dict.fromkeys(out))


# crontab's @-names, with crontab's meaning; each reads in the sweep's time zone.
_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


def _unalias(expression: str) -> str:
    """The five fields an ``@alias`` stands for; any other expression as it is."""
    spelled = expression.strip()
    if not spelled.startswith("@"):
        return expression
    if spelled in _ALIASES:
        return _ALIASES[spelled]
    accepted = f"(accepted: {', '.join(_ALIASES)})"
    if spelled == "@reboot":
        raise ValueError(
            f"cron alias '@reboot' is not supported: sweepd fires on times, not on start {accepted}"
        )
    raise ValueError(f"unknown cron alias {spelled!r} {accepted}")


def _cron_trigger(expression: str, timezone: str) -> CronTrigger:
    try:
        zone = ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"unknown time zone {timezone!r}") from exc
    fields = _unalias(expression).split()
    if len(fields) != 5:
        raise ValueError(
            f"cron expression {expression!r} has {len(fields)} fields, expected 5 "
            "(minute hour day-of-month month day-of-week)"
        )
    minute, hour, day, month, weekday = fields
    try:
        trigger = CronTrigger(
            minute=minute,
            hour=hour,
            day=day,
            month=month,
            day_of_week=_translate_weekdays(weekday),
            timezone=zone,
        )
    except ValueError as exc:
        raise ValueError(f"invalid cron expression {expression!r}: {exc}") from exc
    # "0 0 31 2 *" is valid field by field and never matches: a sweep that
    # silently never runs is the failure sweepd exists to prevent.
    if trigger.get_next_fire_time(None, EPOCH) is None:
        raise ValueError(f"cron expression {expression!r} never fires")
    return trigger


def _utc(instant: datetime) -> datetime:
    if instant.tzinfo is None:
        raise ValueError("tick arithmetic needs an aware datetime")
    return instant.astimezone(UTC)


def _micros(delta: timedelta) -> int:
    return delta // _MICRO


def ticks_from(schedule: Schedule, start: datetime) -> Iterator[datetime]:
    """Every tick at or after ``start``, in order, as aware UTC datetimes."""
    start = _utc(start)
    if isinstance(schedule, Every):
        step = _micros(schedule.interval)
        offset = _micros(start - schedule.anchor)
        k = -(-offset // step)  # ceiling division, exact for negative offsets too
        while True:
            yield schedule.anchor + timedelta(microseconds=k * step)
            k += 1
    cursor = start
    while True:
        found = schedule._trigger.get_next_fire_time(None, cursor)
        if found is None:
            return
        # Step in UTC: local-time arithmetic loses the fold of a repeated hour
        # and would loop in it.
        tick = _utc(found)
        if tick < cursor:  # never move backwards, whatever the trigger says
            cursor += timedelta(seconds=1)
            continue
        yield tick
        cursor = tick + _MICRO


def next_tick(schedule: Schedule, after: datetime) -> datetime | None:
    """The first tick strictly after ``after``."""
    return next(ticks_from(schedule, _utc(after) + _MICRO), None)


def ticks_between(schedule: Schedule, start: datetime, end: datetime) -> list[datetime]:
    """The ticks in the half-open window ``[start, end)``."""
    end = _utc(end)
    ticks: list[datetime] = []
    for tick in ticks_from(schedule, start):
        if tick >= end:
            break
        ticks.append(tick)
    return ticks


def previous_tick(schedule: Schedule, at: datetime) -> datetime | None:
    """The latest tick at or before ``at``: the slot an instant falls in."""
    at = _utc(at)
    if isinstance(schedule, Every):
        step = _micros(schedule.interval)
        k = _micros(at - schedule.anchor) // step
        return schedule.anchor + timedelta(microseconds=k * step)
    span = timedelta(minutes=2)
    while span <= _CRON_LOOKBACK:
        found = ticks_between(schedule, at - span, at + _MICRO)
        if found:
            return found[-1]
        span *= 4
    return None


def jitter_delay(jitter: timedelta, rng: random.Random) -> timedelta:
    """How long to wait past a tick before firing it; never part of its identity."""
    if jitter <= timedelta(0):
        return timedelta(0)
    return timedelta(microseconds=rng.randrange(_micros(jitter) + 1))


def interval_at(schedule: Schedule, at: datetime) -> timedelta:
    """How far apart the schedule's ticks are at ``at``: a cron's last two ticks' gap."""
    if isinstance(schedule, Every):
        return schedule.interval
    last = previous_tick(schedule, at)
    before = None if last is None else previous_tick(schedule, last - _MICRO)
    if last is None or before is None:
        # Fewer than two ticks within previous_tick's reach: the gap of the next two.
        following = list(islice(ticks_from(schedule, at), 2))
        return following[1] - following[0]
    return last - before


def stale_after(schedule: Schedule, ttl: timedelta, at: datetime) -> timedelta:
    """How long without a success makes a sweep STALE: two intervals and the ttl
    (a crashed holder's lease blocks the sweep that long)."""
    return 2 * interval_at(schedule, at) + ttl
