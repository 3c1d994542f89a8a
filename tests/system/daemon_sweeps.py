"""Sweeps for the system tests: each run leaves a line that the test can count.

Every line is one JSON object appended with O_APPEND (one write per line, so
lines from several processes never interleave): ``start`` when the run
begins, ``end`` when it returns. The test reads the file to see what really
ran, where, for which tick, and whether any two runs of a sweep overlapped.

``fenced`` also writes to a fenced resource: a file that accepts a write only
under a fencing token at least as high as every one it accepted before.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import os
import threading
import time
from typing import Any

from sqlalchemy import Engine, create_engine, text

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


def fenced_write(resource: str, fencing_token: int, **fields: Any) -> tuple[bool, int]:
    """Write to the fenced resource under a token: (accepted, highest token accepted before).

    The resource is a ledger of every write tried, one JSON line each, under an
    exclusive lock: a write whose token is lower than the highest accepted so
    far is refused, and recorded as refused. What a storage system that honours
    fencing tokens does, and what makes a stale holder harmless.
    """
    with open(resource, "a+") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)  # released when the file is closed
        ledger.seek(0)
        tried = [json.loads(line) for line in ledger.read().splitlines() if line.strip()]
        highest = max((int(t["token"]) for t in tried if t["accepted"]), default=0)
        accepted = fencing_token >= highest
        entry = {"token": fencing_token, "accepted": accepted, "highest": highest}
        ledger.write(json.dumps({**fields, **entry, "at": time.time()}) + "\n")
        ledger.flush()
    return accepted, highest


def fenced(
    ctx: SweepContext, out: str, resource: str, duration: float = 3.0, step: float = 0.05
) -> None:
    """Sync: work ``duration`` seconds in steps of ``step``, then write the result to the
    fenced resource under the run's token, whatever ``ctx.lease_lost`` says.

    Time the process spends stopped is not work: a run paused mid-way has the rest
    of its steps to do when it resumes, and then writes. It ignores ``lease_lost``
    on purpose, as code paused between its last check and its write would: only
    the token can stop that write. The ``end`` line says whether it was accepted
    and whether the run had been told of the loss by then.
    """
    _write(out, event="start", at=time.time(), **_fields(ctx))
    for _ in range(round(duration / step)):
        time.sleep(step)
    told = ctx.lease_lost.is_set()
    accepted, highest = fenced_write(resource, ctx.fencing_token, **_fields(ctx))
    _write(
        out,
        event="end",
        at=time.time(),
        accepted=accepted,
        highest=highest,
        lease_lost=told,
        **_fields(ctx),
    )


@functools.cache
def _engine(url: str) -> Engine:
    return create_engine(url)  # one pool per process and URL, as an application keeps


def fenced_sql(ctx: SweepContext, out: str, url: str, duration: float = 1.0) -> None:
    """Sync: work ``duration`` seconds, then write the result to a row of table ``fence`` in
    the database at ``url``, only if the run's token is above the one written last.

    The write goes over the run's own connection, so a network that stalls the daemon's
    statements stalls it too, and it arrives when the network heals: after a newer holder's,
    if one took over meanwhile. The condition in the UPDATE is what refuses it then, as a
    fenced store does. The ``end`` line says whether it was accepted.
    """
    _write(out, event="start", at=time.time(), **_fields(ctx))
    time.sleep(duration)
    with _engine(url).begin() as connection:
        accepted = (
            connection.execute(
                text("UPDATE fence SET token = :token WHERE name = :name AND token < :token"),
                {"token": ctx.fencing_token, "name": ctx.name},
            ).rowcount
            == 1
        )
    _write(out, event="end", at=time.time(), accepted=accepted, **_fields(ctx))


def leaky(ctx: SweepContext, out: str) -> None:
    """Sync: starts a thread that never ends, not a daemon thread (as a client library's
    flusher may be), and returns. The interpreter waits for such threads before it exits."""
    _write(out, event="start", at=time.time(), **_fields(ctx))
    name = f"leaked-{ctx.tick:%H%M%S}"
    threading.Thread(target=threading.Event().wait, name=name, daemon=False).start()
    _write(out, event="end", at=time.time(), **_fields(ctx))


def hung(ctx: SweepContext, out: str) -> None:
    """Sync: a call that never returns, and no look at ``ctx.cancelled``."""
    _write(out, event="start", at=time.time(), **_fields(ctx))
    threading.Event().wait()
