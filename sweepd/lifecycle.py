"""Signals and the process's life: drain on the first SIGTERM/SIGINT, die on the second.

Handlers only schedule a call on the loop; they never raise and never do
work. ``serve`` returns the exit status for the CLI to exit with. Under
systemd it also tells the notify socket each change of the daemon's state,
and pings the watchdog from the loop (``sweepd.notify``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

from sweepd.daemon import Daemon
from sweepd.notify import Beat, NotifySocket, watchdog_seconds
from sweepd.observe import flush_logs

# How often STATUS= is refreshed when no watchdog ping comes sooner: fresh
# enough for `systemctl status`, and one datagram in 5 s costs the loop nothing.
STATUS_EVERY = 5.0  # seconds


class EarlySignals:
    """Signals that arrive while the command is still starting (loading the
    config, waiting for the migration lock), kept for the loop to act on.

    Without this, a SIGHUP in those seconds would take the default action
    and kill the process without a word.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous = {
            sig: signal.signal(sig, self._keep)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }

    def _keep(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)

    def restore(self) -> list[int]:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return self.received


class Systemd:
    """Tells systemd, through its notify socket, what the daemon is doing (SPEC §8).

    A watcher of the daemon (called on the loop, so it only sends a datagram):
    READY=1 once the schedules are loaded and again after a reload,
    RELOADING=1 as one begins, STOPPING=1 at the drain, each with a STATUS=
    line; and, between "started" and "stopped", a beat that pings the
    watchdog (when systemd set one) and refreshes STATUS= when it changed.
    """

    def __init__(self, daemon: Daemon, notify: NotifySocket, watchdog: float | None) -> None:
        self.daemon = daemon
        self.notify = notify
        self.watchdog = watchdog
        # A ping every half of the watchdog's time, as sd_watchdog_enabled(3)
        # advises, so that one late ping is not yet a kill.
        self.beat = Beat(min(watchdog / 2, STATUS_EVERY) if watchdog else STATUS_EVERY, self._beat)
        self._draining = False
        self._status = ""

    def __call__(self, state: str) -> None:
        if state == "started":
            # A signal that came while the command was starting has begun the
            # drain already: systemd heard STOPPING=1, and READY=1 would be a lie.
            if not self._draining:
                self.notify.send("READY=1", self._status_line())
            self.beat.start()
        elif state == "reloading":
            # systemd 253+ wants the time the reload began on CLOCK_MONOTONIC,
            # to tell it from a reload begun before its own SIGHUP (Type=notify-reload).
            usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            self.notify.send("RELOADING=1", f"MONOTONIC_USEC={usec}")
        elif state == "reloaded":
            self.notify.send("READY=1", self._status_line())
        elif state == "draining":
            self._draining = True
            self.notify.send("STOPPING=1", self._status_line())
        elif state == "stopped":
            self.beat.stop()

    def status(self) -> str:
        running = len(self.daemon.runner.inflight)
        if self._draining:
            return f"draining, {running} running"
        count = len(self.daemon.settings.sweeps)
        last = self.daemon.last_fired
        tick = f"last tick {last:%H:%M:%S} UTC" if last is not None else "no tick yet"
        return f"{count} sweep{'' if count == 1 else 's'}, {running} running, {tick}"

    def _status_line(self) -> str:
        self._status = self.status()
        return f"STATUS={self._status}"

    def _beat(self) -> None:
        lines = ["WATCHDOG=1"] if self.watchdog else []
        if self.status() != self._status:
            lines.append(self._status_line())
        if lines:
            self.notify.send(*lines)


async def serve(
    daemon: Daemon,
    log: Any,
    early: EarlySignals | None = None,
    systemd_environ: Mapping[str, str] | None = None,
) -> int:
    """Run the daemon with signal handlers installed; 0 after a clean drain.

    ``systemd_environ``: systemd's variables as the command read them
    (``Environment.systemd``); without NOTIFY_SOCKET nothing is sent.
    """
    loop = asyncio.get_running_loop()
    received: list[int] = []
    environ = systemd_environ or {}
    notify = NotifySocket.from_environ(environ, log)
    systemd: Systemd | None = None
    if notify is not None:
        systemd = Systemd(daemon, notify, watchdog_seconds(environ, os.getpid()))
        daemon.watchers.append(systemd)

    def on_stop(signum: int) -> None:
        received.append(signum)
        if len(received) == 1:
            log.info("daemon.signal", signal=signal.Signals(signum).name, action="drain")
            daemon.stop()
            return
        # The second signal is the operator saying "now": no drain, no release
        # (the TTL frees the leases), the shell's status for death by signal.
        log.warning("daemon.signal", signal=signal.Signals(signum).name, action="exit now")
        flush_logs()  # os._exit skips every flush
        os._exit(128 + signum)

    def on_reload() -> None:
        log.info("daemon.signal", signal="SIGHUP", action="reload")
        daemon.request_reload()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_stop, signum)
    loop.add_signal_handler(signal.SIGHUP, on_reload)
    # The loop's handlers replaced the early ones; act on what came before.
    for early_signum in early.received if early is not None else []:
        if early_signum == signal.SIGHUP:
            on_reload()
        else:
            on_stop(early_signum)
    # What is loaded by now (the config, the sweeps' modules, SQLAlchemy and
    # the drivers) lives as long as the process. Frozen, it is out of the
    # cyclic collector's way: a full collection, which lands in a burst of
    # ticks as often as not, walks only what came after (its commit has the figures).
    gc.freeze()
    try:
        await daemon.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        if systemd is not None:
            systemd.beat.stop()  # also when the daemon failed before it said "stopped"
            daemon.watchers.remove(systemd)
            systemd.notify.close()
    return 0
