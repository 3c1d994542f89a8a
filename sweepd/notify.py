"""systemd's notify socket (sd_notify(3)): a datagram socket and a few lines, no dependency.

systemd hands a ``Type=notify`` service the address of a datagram socket in
``NOTIFY_SOCKET``; each datagram is newline-separated assignments
(``READY=1``, ``STATUS=...``, ``WATCHDOG=1``). Without that variable there is
nobody to tell and nothing here is made. Telling systemd is never worth the
daemon's life: a send that fails is logged once and the daemon goes on.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping
from typing import Any


class NotifySocket:
    """Where the daemon tells systemd what it is doing."""

    def __init__(self, address: str, log: Any) -> None:
        self.address = address  # as systemd wrote it, for the log
        # "@name" is a name in the abstract namespace, which begins with a NUL byte.
        self._target = "\0" + address[1:] if address.startswith("@") else address
        self._log = log
        self._warned = False
        self._socket: socket.socket | None = None
        try:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # A full queue at systemd's end is a message lost, never a loop that stalls.
            self._socket.setblocking(False)
        except OSError as error:
            self._warn(error)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], log: Any) -> NotifySocket | None:
        address = environ.get("NOTIFY_SOCKET")
        return cls(address, log) if address else None

    def send(self, *assignments: str) -> bool:
        """One datagram of ``NAME=value`` lines; False (and one warning, ever) if it failed."""
        if self._socket is None:
            return False
        try:
            self._socket.sendto("\n".join(assignments).encode(), self._target)
        except OSError as error:
            self._warn(error)
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _warn(self, error: OSError) -> None:
        # Once: a socket that failed will mostly go on failing, at every ping.
        if not self._warned:
            self._warned = True
            self._log.warning(
                "notify.failed",
                socket=self.address,
                error=str(error),
                note="systemd is not told; later failures are not logged",
            )


def watchdog_seconds(environ: Mapping[str, str], pid: int) -> float | None:
    """``WatchdogSec`` as systemd passed it, or None: unset, malformed, or another process's
    (``WATCHDOG_PID`` names the process systemd watches; a child that inherited it is not)."""
    try:
        usec = int(environ.get("WATCHDOG_USEC") or 0)
        owner = environ.get("WATCHDOG_PID")
        if owner and int(owner) != pid:
            return None
    except ValueError:
        return None
    return usec / 1e6 if usec > 0 else None


class Beat:
    """Calls ``beat`` every ``every`` seconds, by a chain of timers on the running loop.

    The watchdog's ping comes from here, and from the loop rather than a
    thread: what systemd should learn is whether the loop still turns. A
    thread would go on pinging while a sweep that blocks the loop (blocking
    code in an ``async def``) kept every tick from firing; a blocked loop
    runs no timer, sends no ping, and systemd kills the wedged daemon.
    """

    def __init__(self, every: float, beat: Callable[[], None]) -> None:
        self.every = every
        self._beat = beat
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.every, self._fire)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        # The next beat is set first, so that a beat that raises does not end the chain.
        self.start()
        self._beat()
