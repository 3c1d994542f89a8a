"""`sweepd run` under a stand-in for systemd: the notify protocol and the watchdog (SPEC §8).

The test binds the datagram socket systemd would bind (a path, or a name in
the abstract namespace), starts a real daemon with ``NOTIFY_SOCKET`` and
``WATCHDOG_USEC`` pointing at it, and records every datagram as it arrives,
with the time and the sender's pid (``SO_PASSCRED``). One sweep wedges the
daemon's event loop on purpose for a second, every other second: a
watchdog that pinged from a thread would go on through that second; the
daemon's must fall silent, so that systemd would kill it.
"""

from __future__ import annotations

import itertools
import secrets
import signal
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_harness import Cluster, read_runs, sweep, write_config

pytestmark = pytest.mark.slow

WATCHDOG_USEC = 400_000  # WatchdogSec=0.4s: a ping every 0.2 s
PING = WATCHDOG_USEC / 2 / 1e6
BLOCK = 1.0  # seconds the blocking sweep holds the loop, every other second
# Receiving a datagram takes microseconds; the gap across a block is allowed
# that much less than the block itself, and no more.
RECEIPT_SLACK = 0.01
CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Datagram:
    at: float  # time.time() when it arrived
    usec: int  # and CLOCK_MONOTONIC then, in µs
    pid: int  # the sender's
    lines: list[str]

    @property
    def kind(self) -> str:
        return self.lines[0]

    def field(self, name: str) -> str | None:
        return next(
            (line.split("=", 1)[1] for line in self.lines if line.startswith(name + "=")), None
        )


class Listener:
    """The notify socket, read by a thread that stamps each datagram as it arrives."""

    def __init__(self, receiver: socket.socket, address: str) -> None:
        self.address = address
        self.received: list[Datagram] = []
        self._receiver = receiver
        self._receiver.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._receiver.settimeout(0.1)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._done.is_set():
            try:
                data, ancillary, _flags, _address = self._receiver.recvmsg(
                    4096, socket.CMSG_SPACE(CREDENTIALS.size)
                )
            except TimeoutError:
                continue
            at, usec = time.time(), time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            pid = next(
                CREDENTIALS.unpack(payload[: CREDENTIALS.size])[0]
                for level, kind, payload in ancillary
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
            )
            self.received.append(Datagram(at, usec, pid, data.decode().split("\n")))

    def wait_for(self, predicate: Callable[[list[Datagram]], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(list(self.received)):
                return
            time.sleep(0.02)
        kinds = [d.kind for d in self.received]
        raise AssertionError(f"not received within {timeout}s; got {kinds}")

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._receiver.close()


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        receiver.bind(str(tmp_path / "notify"))
        address = str(tmp_path / "notify")
    else:
        name = f"sweepd-test-{secrets.token_hex(6)}"
        receiver.bind("\0" + name)
        address = "@" + name
    found = Listener(receiver, address)
    try:
        yield found
    finally:
        found.close()


def kinds(datagrams: list[Datagram], kind: str) -> list[Datagram]:
    return [d for d in datagrams if d.kind == kind]


def after(datagrams: list[Datagram], kind: str, start: float) -> list[Datagram]:
    return [d for d in datagrams if d.kind == kind and d.at > start]


def milestones(datagrams: list[Datagram]) -> list[str]:
    """The kinds of datagram in order, each run of WATCHDOG=1 pings folded into one."""
    found: list[str] = []
    for datagram in datagrams:
        if not (datagram.kind == "WATCHDOG=1" and found and found[-1] == "WATCHDOG=1"):
            found.append(datagram.kind)
    return found


@pytest.mark.parametrize("dialect", ["sqlite"])
def test_ready_watchdog_reload_and_stop_reach_systemd_in_order(
    cluster: Cluster, listener: Listener, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    blocker = sweep(
        "wedge", out, every="2s", callable="daemon_sweeps:block_loop", args={"seconds": BLOCK}
    )
    config = write_config(tmp_path / "sweepd.yaml", cluster.url, [blocker])
    env = {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    (replica,) = cluster.start(config, env=[env])

    listener.wait_for(lambda got: bool(kinds(got, "READY=1")))
    # Three blocks, each followed by pings again: the loop came back each time. (The
    # first may begin before any ping has arrived, and then tells nothing.)
    deadline = time.monotonic() + 20
    while len([r for r in read_runs(out) if r["event"] == "end"]) < 3:
        assert time.monotonic() < deadline, "the blocking sweep did not run three times"
        time.sleep(0.05)
    third_end = [r for r in read_runs(out) if r["event"] == "end"][2]["at"]
    listener.wait_for(lambda got: len(after(got, "WATCHDOG=1", third_end)) >= 3)

    replica.signal(signal.SIGHUP)
    listener.wait_for(lambda got: bool(kinds(got, "RELOADING=1")))
    reloading_at = kinds(listener.received, "RELOADING=1")[0].at
    listener.wait_for(lambda got: bool(after(got, "READY=1", reloading_at)))
    replica.signal(signal.SIGTERM)
    assert replica.wait(20) == 0
    listener.wait_for(lambda got: bool(kinds(got, "STOPPING=1")), timeout=5)

    got = list(listener.received)
    # The order systemd must see: ready, alive, reloading, ready again, stopping.
    order = milestones(got)
    assert order[:2] == ["READY=1", "WATCHDOG=1"], order
    assert [k for k in order if k != "WATCHDOG=1"] == [
        "READY=1",
        "RELOADING=1",
        "READY=1",
        "STOPPING=1",
    ], order
    assert all(d.pid == replica.pid for d in got), "a datagram came from another process"

    ready = got[0]
    assert ready.field("STATUS") == "1 sweep, 0 running, no tick yet", ready
    reloading = kinds(got, "RELOADING=1")[0]
    # CLOCK_MONOTONIC is the machine's, the same in both processes: sent just before it arrived.
    sent = int(reloading.field("MONOTONIC_USEC") or "0")
    assert 0 <= reloading.usec - sent < 1_000_000, (sent, reloading.usec)
    reloaded = after(got, "READY=1", reloading.at)[0]
    assert (reloaded.field("STATUS") or "").startswith("1 sweep, "), reloaded
    assert "last tick " in (reloaded.field("STATUS") or ""), reloaded
    stopping = kinds(got, "STOPPING=1")[0]
    assert (stopping.field("STATUS") or "").startswith("draining, "), stopping

    pings = [d.at for d in kinds(got, "WATCHDOG=1")]
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert statistics.median(gaps) < PING * 1.5, gaps
    blocks = [r for r in read_runs(out) if r["event"] == "start"]
    ends = {r["tick"]: r["at"] for r in read_runs(out) if r["event"] == "end"}
    checked = 0
    for block in blocks:
        if block["tick"] not in ends:
            continue  # cut short by the drain
        start, end = block["at"], ends[block["tick"]]
        before = [p for p in pings if p <= start]
        later = [p for p in pings if p >= end]
        if not before or not later:
            continue
        # A ping sent just before the block may be received just after it began.
        inside = [p for p in pings if start + 0.05 < p < end]
        assert not inside, f"pings while the loop was blocked: {inside}"
        gap = later[0] - before[-1]
        assert gap >= BLOCK - RECEIPT_SLACK, (gap, start, end)
        assert gap < BLOCK + 3 * PING, "the pings did not come back after the block"
        checked += 1
    assert checked >= 2, "no blocked second was watched"
