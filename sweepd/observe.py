"""Logs: structlog, one event per line, JSON unless a person is watching.

Event names are stable (``lease.claimed``, ``tick.skipped``, ...) and carry
their context as fields, so operators filter on fields, never on prose.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
import traceback
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

from sweepd.model import LogFormat, LogLevel

_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(format: LogFormat, level: LogLevel, stream: TextIO | None = None) -> bool:
    """Set structlog up once per process; ``auto`` is console on a terminal, else JSON.

    Returns whether the lines are JSON: then whatever else goes to that stream
    must be an event too, or the line breaks the reader that parses them.
    """
    out = stream or sys.stderr
    _LINES.point_at(out)
    console = format == "console" or (format == "auto" and out.isatty())
    renderer: Any = structlog.dev.ConsoleRenderer(colors=out.isatty()) if console else _render_json
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _Stamp(),
            _JSON_TRACEBACKS if not console else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=_LINES.factory,
        cache_logger_on_first_use=False,
    )
    return not console


# A traceback as JSON frames, without each frame's local variables (structlog's
# default shows them): a local may hold a database URL with its password.
_JSON_TRACEBACKS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)

# json.dumps with any option set builds a new encoder for every line; this
# one is built once. Anything JSON cannot hold is written as its repr.
_JSON = json.JSONEncoder(default=repr)


def _render_json(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> str:
    return _JSON.encode(event)


class _Stamp:
    """``timestamp``: UTC to the microsecond, as ``2026-12-04T06:34:57.638250Z``.

    What structlog's ISO ``TimeStamper`` writes, at a third of its cost: the
    part up to the second is formatted once a second, not once a line.
    """

    def __init__(self) -> None:
        # One tuple, swapped whole: a thread never pairs one second's text with
        # another's fraction, whichever thread reformats first.
        self._second: tuple[int, str] = (-1, "")

    def __call__(
        self, _logger: Any, _name: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        # In microseconds first: a float's fraction of a second is off by a few
        # hundred nanoseconds at today's epoch, which truncation would show.
        whole, micros = divmod(round(time.time() * 1_000_000), 1_000_000)
        second = self._second
        if second[0] != whole:
            second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
            self._second = second
        event["timestamp"] = f"{second[1]}.{micros:06d}Z"
        return event


# How long a line logged on the loop may wait to be written with the others.
FLUSH_SECONDS = 0.05


class _Lines:
    """Writes rendered lines to the stream; those logged on the loop, a few at a time.

    A write is a system call, and CPython lets go of the GIL for it. Made per
    line on the loop, each of a run's log lines handed the interpreter to a
    waiting database or sweep thread, and the loop then queued to get it back:
    a quarter of a run's CPU in a burst (its commit has the figures). So a line
    logged on the loop's thread waits up to ``FLUSH_SECONDS`` and leaves in
    one write with the others of that time. A line from any other thread (a
    sync sweep's own logger) has no loop to wait on: it is written at once,
    after whatever was waiting, so the order holds. A ``kill -9`` loses at
    most the last ``FLUSH_SECONDS`` of the loop's lines; a drain, an error
    and the second signal's exit write them out first.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._waiting: list[str] = []
        self._flush_on: asyncio.AbstractEventLoop | None = None

    def point_at(self, stream: TextIO) -> None:
        """Write to ``stream`` from now on; what is waiting goes to the old one first."""
        self.flush()
        self._stream = stream

    def factory(self, *_args: Any) -> _Lines:
        return self

    def msg(self, message: str) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._waiting.append(message + "\n")
            if loop is None:
                self._write()
            elif self._flush_on is not loop:
                # Once per loop, not per flag: a loop that closed with a flush
                # still due must not leave every later loop's lines unwritten.
                self._flush_on = loop
                loop.call_later(FLUSH_SECONDS, self.flush)

    debug = info = warning = error = critical = exception = msg

    def flush(self) -> None:
        with self._lock:
            self._flush_on = None
            self._write()

    def _write(self) -> None:
        if self._waiting:
            text, self._waiting = "".join(self._waiting), []
            self._stream.write(text)
            self._stream.flush()


_LINES = _Lines(sys.stderr)


def flush_logs() -> None:
    """Write out the lines logged on the loop that are still waiting."""
    _LINES.flush()


def get_logger(**context: Any) -> Any:
    return structlog.get_logger("sweepd").bind(**context)


# A failed run's traceback in its run.finished line: the frames nearest the
# error, which are the sweep's own, and no more text than a screen holds.
TRACEBACK_FRAMES = 30
TRACEBACK_CHARS = 8000


def format_traceback(error: BaseException) -> str:
    """A failed run's traceback: its last frames, and at most ``TRACEBACK_CHARS``
    of text, cut at the front so that the error itself stays."""
    text = "".join(traceback.format_exception(error, limit=-TRACEBACK_FRAMES)).rstrip()
    if len(text) > TRACEBACK_CHARS:
        text = "…" + text[-(TRACEBACK_CHARS - 1) :]
    return text
