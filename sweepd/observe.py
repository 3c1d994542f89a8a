"""Logs: structlog, one event per line, JSON unless a person is watching.

Event names are stable (``lease.claimed``, ``tick.skipped``, ...) and carry
their context as fields, so operators filter on fields, never on prose.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

from sweepd.model import LogFormat, LogLevel

_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(format: LogFormat, level: LogLevel, stream: TextIO | None = None) -> None:
    """Set structlog up once per process; ``auto`` is console on a terminal, else JSON."""
    out = stream or sys.stderr
    console = format == "console" or (format == "auto" and out.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=out.isatty())
        if console
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if not console else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


def get_logger(**context: Any) -> Any:
    return structlog.get_logger("sweepd").bind(**context)
