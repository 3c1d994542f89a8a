"""Signals and the process's life: drain on the first SIGTERM/SIGINT, die on the second.

Handlers only schedule a call on the loop; they never raise and never do
work. ``serve`` returns the exit status for the CLI to exit with.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from types import FrameType
from typing import Any

from sweepd.daemon import Daemon
from sweepd.observe import flush_logs


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


async def serve(daemon: Daemon, log: Any, early: EarlySignals | None = None) -> int:
    """Run the daemon with signal handlers installed; 0 after a clean drain."""
    loop = asyncio.get_running_loop()
    received: list[int] = []

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
    # ticks as often as not, walks only what came after (docs/performance.md).
    gc.freeze()
    try:
        await daemon.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
    return 0
