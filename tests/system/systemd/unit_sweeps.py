"""Sweeps for tests/system/test_systemd_unit.py, run by systemd in a container.

This file is copied into the container's /opt/sweepd venv, beside sweepd, and
named in the test's config. Each sweep appends JSON lines to a file in the
unit's state directory, the one place the sandbox lets it write, which the
test reads from outside. ``UNIT_SWEEPS_IMPORT_DELAY`` (seconds, from a
drop-in) makes the import slow, so that the test can see the unit wait for
READY=1 rather than go active when the process starts.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from typing import Any

from sweepd import SweepContext

# A test knob, read by this test module only; sweepd's own code reads its
# environment in one place (sweepd/environment.py).
IMPORT_DELAY = float(os.environ.get("UNIT_SWEEPS_IMPORT_DELAY") or 0)
if IMPORT_DELAY:
    time.sleep(IMPORT_DELAY)


def _append(out: str, **fields: Any) -> None:
    line = json.dumps({"at": time.time(), "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def record(ctx: SweepContext, out: str, duration: float = 0.0) -> None:
    """Log start, work ``duration`` seconds (stopping early when cancelled), log how it ended."""
    _append(out, sweep=ctx.name, tick=ctx.tick.isoformat(), event="start")
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        if ctx.cancelled.is_set():
            _append(out, sweep=ctx.name, tick=ctx.tick.isoformat(), event="cancelled")
            return
        time.sleep(0.05)
    _append(out, sweep=ctx.name, tick=ctx.tick.isoformat(), event="end")


def _outcome(error: OSError) -> str:
    return errno.errorcode.get(error.errno or 0, str(error))


def probe(ctx: SweepContext, out: str, paths: list[str]) -> None:
    """Try what the sandbox should allow and forbid, and write down what happened.

    Each path is created and written ("ok", or the errno's name, such as
    EROFS); a created file's mode shows the unit's UMask. The rest: who the
    process is, whether it sees other processes' /proc, and whether it may
    open a socket family the unit does not allow.
    """
    files: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                os.write(fd, b"written by the sandbox probe\n")
                mode = os.fstat(fd).st_mode & 0o777
            finally:
                os.close(fd)
            files[path] = {"outcome": "ok", "mode": oct(mode)}
        except OSError as error:
            files[path] = {"outcome": _outcome(error)}
    try:
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close()
        netlink = "ok"
    except OSError as error:
        netlink = _outcome(error)
    with open("/proc/self/status", encoding="ascii") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    _append(
        out,
        sweep=ctx.name,
        event="probe",
        files=files,
        netlink=netlink,
        uid=os.getuid(),
        gid=os.getgid(),
        cap_eff=fields["CapEff"].strip(),
        no_new_privs=fields["NoNewPrivs"].strip(),
        seccomp=fields["Seccomp"].strip(),
        sees_pid_1=os.path.exists("/proc/1"),
    )
