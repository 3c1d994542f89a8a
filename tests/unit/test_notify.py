"""systemd's notify socket, on real datagram sockets (SPEC §8).

The test binds the ``AF_UNIX`` ``SOCK_DGRAM`` socket systemd would bind
(a path in the test's folder, or a name in the abstract namespace), and
reads back exactly what was sent. The last tests run ``serve`` over a
stand-in daemon that walks through its states, to see which message each
state sends, in which order.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from structlog.testing import capture_logs

from sweepd.daemon import Daemon
from sweepd.environment import read_environment
from sweepd.lifecycle import serve
from sweepd.notify import Beat, NotifySocket, watchdog_seconds
from sweepd.observe import get_logger


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """(NOTIFY_SOCKET's value, the bound socket that receives what is sent to it)."""
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        path = str(tmp_path / "notify")
        receiver.bind(path)
        address = path
    else:
        name = f"sweepd-test-{secrets.token_hex(6)}"
        receiver.bind("\0" + name)
        address = "@" + name
    receiver.settimeout(5)
    try:
        yield address, receiver
    finally:
        receiver.close()


@contextlib.contextmanager
def collecting(receiver: socket.socket) -> Iterator[list[str]]:
    """Every datagram that arrives meanwhile, read as it comes (the kernel queues only a
    few: net.unix.max_dgram_qlen is 10 on many hosts), as systemd reads them."""
    found: list[str] = []
    done = threading.Event()
    receiver.settimeout(0.05)

    def read() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                found.append(receiver.recv(4096).decode())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield found
    finally:
        done.set()
        reader.join(timeout=5)
        # A datagram is queued at the receiver when sendto returns: what is left is all there.
        found += received(receiver)


def received(receiver: socket.socket) -> list[str]:
    """Every datagram waiting on ``receiver``, without waiting for more."""
    found = []
    receiver.setblocking(False)
    try:
        while True:
            found.append(receiver.recv(4096).decode())
    except BlockingIOError:
        return found
    finally:
        receiver.settimeout(5)


def test_each_send_is_one_datagram_of_assignments_as_sent(
    listener: tuple[str, socket.socket],
) -> None:
    address, receiver = listener
    notify = NotifySocket(address, get_logger())
    try:
        assert notify.send("READY=1", "STATUS=3 sweeps, 0 running, no tick yet")
        assert notify.send("WATCHDOG=1")
    finally:
        notify.close()
    assert received(receiver) == ["READY=1\nSTATUS=3 sweeps, 0 running, no tick yet", "WATCHDOG=1"]


def test_without_notify_socket_there_is_no_socket() -> None:
    assert NotifySocket.from_environ({}, get_logger()) is None
    assert NotifySocket.from_environ({"NOTIFY_SOCKET": ""}, get_logger()) is None


def test_from_environ_takes_the_address(listener: tuple[str, socket.socket]) -> None:
    address, receiver = listener
    notify = NotifySocket.from_environ({"NOTIFY_SOCKET": address}, get_logger())
    assert notify is not None
    try:
        notify.send("READY=1")
    finally:
        notify.close()
    assert received(receiver) == ["READY=1"]


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_a_socket_nobody_listens_on_warns_once_and_never_raises(tmp_path: Path, kind: str) -> None:
    target = (
        str(tmp_path / "nobody-here") if kind == "path" else f"@sweepd-none-{secrets.token_hex(6)}"
    )
    with capture_logs() as logs:
        notify = NotifySocket(target, get_logger())
        try:
            assert notify.send("READY=1") is False
            assert notify.send("WATCHDOG=1") is False
            assert notify.send("STOPPING=1") is False
        finally:
            notify.close()
    warnings = [e for e in logs if e["event"] == "notify.failed"]
    assert len(warnings) == 1, logs
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["socket"] == target


def test_a_send_after_close_is_quiet_and_harmless(listener: tuple[str, socket.socket]) -> None:
    address, receiver = listener
    notify = NotifySocket(address, get_logger())
    notify.close()
    notify.close()
    assert notify.send("READY=1") is False
    assert received(receiver) == []


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "400000"}, 0.4),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4243"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "me"}, None),
    ],
)
def test_watchdog_seconds(environ: dict[str, str], expected: float | None) -> None:
    assert watchdog_seconds(environ, pid=4242) == expected


def test_a_beat_runs_on_the_loop_and_a_blocked_loop_runs_none() -> None:
    beats: list[float] = []

    async def main() -> None:
        beat = Beat(0.05, lambda: beats.append(time.monotonic()))
        beat.start()
        await asyncio.sleep(0.3)
        time.sleep(0.4)  # the loop is wedged: no beat may happen meanwhile
        await asyncio.sleep(0.2)
        beat.stop()
        stopped = len(beats)
        await asyncio.sleep(0.2)
        assert len(beats) == stopped, "a stopped beat went on"

    asyncio.run(main())
    assert len(beats) >= 6
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert max(gaps) >= 0.4, gaps
    assert sorted(gaps)[len(gaps) // 2] < 0.1, gaps


# -- serve(): what each state of the daemon tells systemd ------------------------------------


class Walker:
    """Stands in for the daemon: goes through its states as the real one tells them."""

    def __init__(self, hold: float = 0.0) -> None:
        self.watchers: list[Any] = []
        self.settings = SimpleNamespace(sweeps=[object(), object(), object()])
        self.runner = SimpleNamespace(inflight={})
        self.last_fired: datetime | None = None
        self.hold = hold

    def _tell(self, state: str) -> None:
        for watcher in self.watchers:
            watcher(state)

    async def run(self) -> None:
        self._tell("started")
        self.last_fired = datetime(2026, 1, 1, 14, 2, 5, tzinfo=UTC)
        self.runner.inflight["a"] = object()
        await asyncio.sleep(self.hold)
        self._tell("reloading")
        self.settings.sweeps.append(object())
        self._tell("reloaded")
        self._tell("draining")
        await asyncio.sleep(self.hold)
        self._tell("stopped")

    def stop(self) -> None: ...

    def request_reload(self) -> None: ...


def run_serve(daemon: Walker) -> int:
    try:
        # systemd's variables as the command reads them, with the rest of the environment.
        systemd = read_environment(os.environ).systemd
        return asyncio.run(serve(cast(Daemon, daemon), get_logger(), systemd_environ=systemd))
    finally:
        gc.unfreeze()


def test_serve_without_notify_socket_watches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    daemon = Walker()
    assert run_serve(daemon) == 0
    assert daemon.watchers == []


def test_serve_tells_systemd_each_state_in_order(
    listener: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, receiver = listener
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert run_serve(Walker()) == 0
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000

    messages = received(receiver)
    assert len(messages) == 4, messages
    ready, reloading, reloaded, draining = (m.split("\n") for m in messages)
    assert ready == ["READY=1", "STATUS=3 sweeps, 0 running, no tick yet"]
    assert reloading[0] == "RELOADING=1"
    assert reloading[1].startswith("MONOTONIC_USEC=")
    assert before <= int(reloading[1].removeprefix("MONOTONIC_USEC=")) <= after
    assert reloaded == ["READY=1", "STATUS=4 sweeps, 1 running, last tick 14:02:05 UTC"]
    assert draining == ["STOPPING=1", "STATUS=draining, 1 running"]


def test_serve_pings_the_watchdog_from_start_to_stop(
    listener: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, receiver = listener
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    with collecting(receiver) as messages:
        assert run_serve(Walker(hold=0.3)) == 0

    kinds = [m.split("\n")[0] for m in messages]
    assert kinds[0] == "READY=1"
    reloading = kinds.index("RELOADING=1")
    stopping = kinds.index("STOPPING=1")
    assert kinds[reloading + 1] == "READY=1"
    assert kinds[1:reloading].count("WATCHDOG=1") >= 3, kinds
    # The loop still turns while the daemon drains: the pings go on until "stopped".
    assert kinds[stopping + 1 :].count("WATCHDOG=1") >= 3, kinds
    assert set(kinds) == {"READY=1", "RELOADING=1", "STOPPING=1", "WATCHDOG=1"}, kinds


class EarlyStop(Walker):
    """A daemon stopped by a signal that came while the command was starting."""

    async def run(self) -> None:
        self._tell("draining")
        self._tell("started")
        self._tell("stopped")


def test_a_daemon_stopped_before_it_started_is_never_ready(
    listener: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, receiver = listener
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert run_serve(EarlyStop()) == 0
    assert received(receiver) == ["STOPPING=1\nSTATUS=draining, 0 running"]


def test_systemds_variables_are_read_with_the_others_and_only_those() -> None:
    environment = read_environment(
        {"NOTIFY_SOCKET": "@sd", "WATCHDOG_USEC": "400000", "WATCHDOG_PID": "", "HOME": "/root"}
    )
    assert environment.systemd == {"NOTIFY_SOCKET": "@sd", "WATCHDOG_USEC": "400000"}
