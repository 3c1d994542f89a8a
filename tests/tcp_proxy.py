"""A TCP proxy in front of a database server, to play the server going away.

The shared servers cannot be stopped, so tests put this proxy between the code under test
and the server: ``stop()`` closes every proxied connection and refuses new ones, as a
stopped server does; ``start()`` brings it back on the same port; ``freeze()`` is a server
that stops answering without closing anything; ``stall()`` holds every byte in both directions
until ``resume()`` delivers them, as a network partition that heals before TCP gives up does.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306}


def _close(sock: socket.socket) -> None:
    # shutdown() first: it wakes a thread blocked in recv() or accept() on this socket,
    # which close() alone does not do on Linux.
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def port_below_ephemeral() -> int:
    """A free port below the ephemeral range, so no outgoing connection takes it while the
    proxy is stopped and start() can bind it again."""
    low = 32768
    with suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no free port below the ephemeral range")


class TcpProxy:
    """Forwards 127.0.0.1:port to a server; stop() is the server going down, start() it coming back.

    With ``port=0`` the first start() picks a port, then keeps it so a URL stays valid.
    ``freeze()`` is a server that stops answering without closing anything (a hung or
    partitioned host): bytes are read and dropped in both directions. ``stall()`` keeps the
    bytes instead, in order, and ``resume()`` sends them on: what was sent during the stall
    arrives late, not never.
    """

    def __init__(self, upstream: tuple[str, int], port: int = 0) -> None:
        self.upstream = upstream
        self.port = port
        self._frozen = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # The proxied connections closed by stop() linger in TIME_WAIT on this port.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(32)
        self.port = listener.getsockname()[1]
        self._frozen.clear()
        with self._lock:
            self._listener = listener
        self._spawn(self._accept, listener)

    def freeze(self) -> None:
        self._frozen.set()

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
            threads, self._threads = self._threads, []
        self._flowing.set()  # a pump holding bytes must get to its socket's error and end
        if listener is not None:
            _close(listener)
        for sock in sockets:
            _close(sock)
        for thread in threads:
            thread.join(5)
        assert not any(thread.is_alive() for thread in threads), "a proxy thread did not stop"

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="test-proxy", daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                # A connection accepted while stop() ran must not outlive it.
                alive = self._listener is listener
                if alive:
                    self._sockets.update((client, server))
            if not alive:
                _close(client)
                _close(server)
                return
            self._spawn(self._pump, client, server)
            self._spawn(self._pump, server, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                # One pump per direction, so waiting here keeps the held bytes in order.
                self._flowing.wait()
                if not self._frozen.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            _close(source)
            _close(sink)


def proxy_for(url: str, port: int = 0) -> tuple[TcpProxy, str]:
    """A started proxy to the server of ``url``, and the same URL pointed at the proxy."""
    parsed = make_url(url)
    upstream = (parsed.host or "127.0.0.1", parsed.port or DEFAULT_PORTS[parsed.get_backend_name()])
    proxy = TcpProxy(upstream, port)
    proxy.start()
    proxied = parsed.set(host="127.0.0.1", port=proxy.port)
    return proxy, proxied.render_as_string(hide_password=False)
