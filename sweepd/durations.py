"""Durations as operators write them: ``500ms``, ``30s``, ``1h30m``, ``1d``."""

from __future__ import annotations

import re
from datetime import timedelta

_UNITS: dict[str, timedelta] = {
    "d": timedelta(days=1),
    "h": timedelta(hours=1),
    "m": timedelta(minutes=1),
    "s": timedelta(seconds=1),
    "ms": timedelta(milliseconds=1),
}
_PART = re.compile(r"(\d+)(ms|d|h|m|s)")
_WHOLE = re.compile(r"(?:\d+(?:ms|d|h|m|s))+")


def parse_duration(text: str) -> timedelta:
    """Read a duration; raise ``ValueError`` with a message fit for a config error.

    A bare number is refused rather than guessed at: ``ttl: 30`` could mean
    seconds or minutes, and a wrong guess is a lease thirty times too short.
    """
    spelled = text.strip()
    if not _WHOLE.fullmatch(spelled):
        if spelled.isdigit():
            raise ValueError(f"duration {text!r} needs a unit, e.g. '{spelled}s'")
        raise ValueError(f"invalid duration {text!r} (expected e.g. 500ms, 30s, 5m, 1h30m, 1d)")
    units = [unit for _, unit in _PART.findall(spelled)]
    if len(set(units)) != len(units):
        raise ValueError(f"invalid duration {text!r}: a unit appears twice")
    return sum(
        (int(count) * _UNITS[unit] for count, unit in _PART.findall(spelled)),
        timedelta(),
    )


def format_duration(value: timedelta) -> str:
    """The shortest spelling ``parse_duration`` reads back to the same value."""
    micros = value // timedelta(microseconds=1)
    if micros == 0:
        return "0s"
    sign = "-" if micros < 0 else ""
    micros = abs(micros)
    parts: list[str] = []
    for unit in ("d", "h", "m", "s", "ms"):
        size = _UNITS[unit] // timedelta(microseconds=1)
        count, micros = divmod(micros, size)
        if count:
            parts.append(f"{count}{unit}")
    if micros:
        parts.append(f"{micros}us")  # below what a config can say; shown, never parsed
    return sign + "".join(parts)
