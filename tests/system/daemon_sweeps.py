"""Sweeps for the system tests: each run leaves a line that the test can count.

Every line is one JSON object appended with O_APPEND (one write per line, so
lines from several processes never interleave): ``start`` when the run
begins, ``end`` when it returns. The test reads the file to see what really
ran, where, for which tick, and whether any two runs of a sweep overlapped.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from sweepd import SweepContext


def _write(out: str, **fields: Any) -> None:
    line = json.dumps(fields) + "\n"
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _fields(ctx: SweepContext) -> dict[str, Any]:
    return {
        "sweep": ctx.name,
        "tick": ctx.tick.isoformat(),
        "token": ctx.fencing_token,
        "attempt": ctx.attempt,
        "holder": ctx.holder,
        "pid": os.getpid(),
    }


def record(ctx: SweepContext, out: str, duration: float = 0.0, fail_times: int = 0) -> None:
    """Sync: log start, work for ``duration`` seconds (stopping early when told), log end."""
    _write(out, event="start", at=time.time(), **_fields(ctx))
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        if ctx.cancelled.is_set() or ctx.lease_lost.is_set():
            _write(
                out,
                event="stopped",
                at=time.time(),
                cancelled=ctx.cancelled.is_set(),
                lease_lost=ctx.lease_lost.is_set(),
                **_fields(ctx),
            )
            return
        time.sleep(0.02)
    if ctx.attempt <= fail_times:
        _write(out, event="fail", at=time.time(), **_fields(ctx))
        raise RuntimeError(f"failing attempt {ctx.attempt} on purpose")
    _write(out, event="end", at=time.time(), **_fields(ctx))


async def record_async(ctx: SweepContext, out: str, duration: float = 0.0) -> None:
    """Async: the same, cancelled by the daemon rather than told."""
    _write(out, event="start", at=time.time(), **_fields(ctx))
    try:
        await asyncio.sleep(duration)
    except asyncio.CancelledError:
        _write(out, event="cancelled", at=time.time(), **_fields(ctx))
        raise
    _write(out, event="end", at=time.time(), **_fields(ctx))


def restless(ctx: SweepContext, out: str, duration: float = 5.0) -> None:
    """Ignores ctx.cancelled like ``stubborn``, but keeps running Python code
    (short sleeps, an encode, a write) the whole time, so it is mid-bytecode
    whenever the process exits."""
    _write(out, event="start", at=time.time(), **_fields(ctx))
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        time.sleep(0.0005)
        json.dumps(_fields(ctx))
    _write(out, event="end", at=time.time(), **_fields(ctx))


def stubborn(ctx: SweepContext, out: str, duration: float = 5.0) -> None:
    """Ignores ctx.cancelled and returns only after ``duration``: the worst sync sweep."""
    _write(out, event="start", at=time.time(), **_fields(ctx))
    time.sleep(duration)
    _write(out, event="end", at=time.time(), **_fields(ctx))


async def block_loop(ctx: SweepContext, out: str, seconds: float = 1.0) -> None:
    """Async, and wedges the event loop on purpose for ``seconds``: what a sweep
    that calls blocking code from an ``async def`` does, for the watchdog test."""
    _write(out, event="start", at=time.time(), **_fields(ctx))
    time.sleep(seconds)  # not asyncio.sleep: nothing else on the loop may run meanwhile
    _write(out, event="end", at=time.time(), **_fields(ctx))
