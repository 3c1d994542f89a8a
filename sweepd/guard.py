"""``sweepd lock``: run one command only if this process wins the lease.

The same crontab line on three hosts runs its command once: each host
claims the lease for the same tick, the database picks one winner, and the
losers exit quietly. The winner heartbeats while the command runs, passes
SIGTERM and SIGINT on to it, and releases the lease when it ends.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from types import FrameType
from typing import Any

from sweepd.errors import SweepdError
from sweepd.lease import LeaseStore, Lost, Won
from sweepd.library import Heartbeat

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_POLL_SECONDS = 0.2


class CommandNotFound(SweepdError):
    """The command to run under the lease could not be started."""

    exit_code = 127  # the shell's status for "command not found"


def run_locked(
    store: LeaseStore,
    name: str,
    command: Sequence[str],
    *,
    ttl: timedelta,
    tick: datetime | None,
    holder: str,
    on_event: Callable[[str, dict[str, Any]], None],
) -> int | Lost:
    """The command's exit status, or the ``Lost`` outcome when another holder has the lease.

    A command killed by signal N reports 128 + N, as a shell would. If the
    lease is lost while the command runs (taken over after a long database
    outage), the command is sent SIGTERM: two copies running is the one
    thing this exists to prevent.
    """
    # Handlers go in before the claim: a signal that arrives while we claim,
    # or before the child exists, is kept and passed on, never lost to
    # Python's default (which would leave a child running unsupervised).
    relay = _Relay()
    previous = {sig: signal.signal(sig, relay.receive) for sig in FORWARDED}
    try:
        outcome = store.claim(name, holder, ttl, tick)
        if isinstance(outcome, Lost):
            return outcome
        on_event("lease.claimed", {"token": outcome.token})
        lost = threading.Event()
        heartbeat = Heartbeat(store, name, outcome, ttl, lost, on_event=on_event).start()
        try:
            if relay.pending:
                return 128 + relay.pending[0]  # told to stop before COMMAND began
            return _run(command, lost, outcome, relay, on_event)
        finally:
            heartbeat.stop()
            released = store.release(name, holder, outcome.token)
            on_event(
                "lease.released" if released else "lease.release_failed", {"token": outcome.token}
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Relay:
    """Signals for the child: passed on once it exists, kept until then."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []

    def receive(self, signum: int, _frame: FrameType | None) -> None:
        # Only pass it on; the child decides how to stop, and we wait for it.
        if self.child is None:
            self.pending.append(signum)
        else:
            self.child.send_signal(signum)


def _run(
    command: Sequence[str],
    lost: threading.Event,
    won: Won,
    relay: _Relay,
    on_event: Callable[[str, dict[str, Any]], None],
) -> int:
    try:
        # Its own process group, so a Ctrl-C at a terminal reaches it once,
        # through us, instead of twice.
        child = subprocess.Popen(list(command), process_group=0)
    except OSError as error:
        raise CommandNotFound(f"cannot run {command[0]!r}: {error.strerror or error}") from None
    relay.child = child
    for signum in relay.pending:  # arrived between the claim and the start
        child.send_signal(signum)
    terminated = False
    while True:
        try:
            status = child.wait(timeout=_POLL_SECONDS)
            break
        except subprocess.TimeoutExpired:
            if lost.is_set() and not terminated:
                on_event("lease.lost_command_terminated", {"token": won.token, "pid": child.pid})
                child.terminate()
                terminated = True
    return status if status >= 0 else 128 - status
