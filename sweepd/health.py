"""``/healthz``, ``/readyz`` and ``/metrics``, served from a thread of their own.

The server never runs on the event loop and never touches the database: it
reports what the loop last recorded, so a scrape costs the loop nothing and
a hung database cannot hang a probe. The loop records it with a pulse, a
timer every second: the pulse proves the loop turns (a loop blocked by a
sweep's code sends none, and ``/healthz`` says so), and every other second
it asks the database for its clock, which proves the database answers and
measures this host's clock skew.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from datetime import UTC, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sweepd.clock import Clock, Timer
from sweepd.errors import StoreError, UsageError
from sweepd.metrics import Metrics
from sweepd.observe import flush_logs
from sweepd.offload import bounded
from sweepd.tasks import spawn

# How often the loop records that it turns.
PULSE_SECONDS = 1.0
# /healthz: the loop turned within this long. A few pulses, so that one slow
# turn of a busy loop is not a restart.
ALIVE_WITHIN = 5.0
# How often the pulse asks the database for its clock, and how long it waits.
CHECK_SECONDS = 2.0
# /readyz: the database answered within this long (two checks and a bit).
READY_WITHIN = 5.0


@dataclass
class Vitals:
    """What the loop last knew; written on the loop, read by the server's threads
    (each field is one object, swapped whole)."""

    turned_at: float | None = None  # monotonic
    answered_at: float | None = None  # monotonic: the database's last answer
    draining: bool = False
    skew: float | None = None  # seconds this host's clock is ahead of the database's


class Pulse:
    """The loop's timer that keeps ``Vitals`` true."""

    def __init__(
        self,
        vitals: Vitals,
        clock: Clock,
        database_now: Any,
        metrics: Metrics,
        log: Any,
    ) -> None:
        self.vitals = vitals
        self.clock = clock
        self.database_now = database_now
        self.metrics = metrics
        self.log = log
        self._timer: Timer | None = None
        self._checked_at: float | None = None
        # True from a check's start until its thread returns, which on a hung
        # database is long after the check gave up: a check a pulse, each
        # stuck on a thread, would take the threads the claims need.
        self._asking = False
        self._unreachable = False

    def start(self) -> None:
        self._beat()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _beat(self) -> None:
        now = self.clock.monotonic()
        self.vitals.turned_at = now
        due = self._checked_at is None or now - self._checked_at >= CHECK_SECONDS
        if due and not self._asking:
            self._checked_at = now
            self._asking = True
            spawn(self._check(), name="health-check")
        self._timer = self.clock.call_later(PULSE_SECONDS, self._beat)

    def _ask(self) -> Any:
        """The database's clock, on a worker thread."""
        try:
            return self.database_now()
        finally:
            self._asking = False

    async def _check(self) -> None:
        try:
            before = self.clock.now()
            database = await bounded(self._ask, timeout=CHECK_SECONDS)
            after = self.clock.now()
        except StoreError as error:
            if not self._unreachable:
                self.log.warning("health.database_unreachable", error=str(error))
            self._unreachable = True
            return
        if self._unreachable:
            self.log.info("health.database_reachable")
        self._unreachable = False
        self.vitals.answered_at = self.clock.monotonic()
        # The database read its clock somewhere in the round trip: its middle.
        middle = before + (after - before) / 2
        skew = (middle - database.astimezone(UTC)) / timedelta(seconds=1)
        self.vitals.skew = skew
        self.metrics.clock_skew.set(skew)


def alive(vitals: Vitals, now: float) -> bool:
    return vitals.turned_at is not None and now - vitals.turned_at <= ALIVE_WITHIN


def ready(vitals: Vitals, now: float) -> str | None:
    """Why this replica is not ready, or None when it is. A replica that runs
    nothing because others hold the leases is ready: it stands by."""
    if vitals.draining:
        return "draining"
    if vitals.answered_at is None or now - vitals.answered_at > READY_WITHIN:
        return "the database has not answered lately"
    return None


def serve_health(
    listen: str,
    vitals: Vitals,
    clock: Clock,
    metrics: Metrics,
    database_now: Any,
    log: Any,
) -> tuple[Pulse, HealthServer]:
    """Serve the three endpoints on ``listen``, and start the pulse that feeds them."""
    try:
        server = HealthServer(listen, vitals, clock, metrics)
    except OSError as error:
        # Another replica on this host has the port, most likely: one line, exit 2.
        raise UsageError(
            f"health.listen {listen}: {error.strerror or error}"
            " (give each replica on a host its own port, or port 0)"
        ) from None
    server.start()
    pulse = Pulse(vitals, clock, database_now, metrics, log)
    pulse.start()
    log.info("health.listening", address=server.listening)
    flush_logs()  # with port 0 this line is the only way to find the port: now, not later
    return pulse, server


class HealthServer:
    """The three endpoints on ``listen`` (``HOST:PORT``; port 0 picks a free one)."""

    def __init__(self, listen: str, vitals: Vitals, clock: Clock, metrics: Metrics) -> None:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        self.vitals, self.clock, self.metrics = vitals, clock, metrics
        server = _Server6 if ":" in host else ThreadingHTTPServer
        self._server = server((host, int(port)), _handler(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sweepd-health", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def listening(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serve_forever that never began
            self._server.shutdown()
        self._server.server_close()

    def answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path``."""
        now = self.clock.monotonic()
        if path == "/healthz":
            if alive(self.vitals, now):
                return 200, "text/plain", b"ok\n"
            return 503, "text/plain", b"the scheduler loop has not turned lately\n"
        if path == "/readyz":
            why = ready(self.vitals, now)
            self.metrics.ready.set(why is None)
            if why is None:
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", f"not ready: {why}\n".encode()
        if path == "/metrics":
            self.metrics.ready.set(ready(self.vitals, now) is None)
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics.render()
        return 404, "text/plain", b"not found: /healthz, /readyz and /metrics are\n"


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler(server: HealthServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, kind, body = server.answer(self.path.split("?", 1)[0])
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Probes come every few seconds: their lines would drown the daemon's."""

    return Handler
