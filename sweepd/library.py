"""The lease outside the daemon: held by a heartbeat thread while some code runs.

``sweepd lock`` (``sweepd.guard``) and code that has its own scheduler
(``Lease``, ``leased``) claim a lease with ``LeaseStore`` and keep it alive
from a thread of their own; the daemon renews all of its leases together
(``sweepd.runner.Renewals``) instead.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, overload

from sqlalchemy import Engine

from sweepd.db.engine import make_engine
from sweepd.durations import parse_duration
from sweepd.errors import StoreError, SweepdError
from sweepd.lease import Claim, LeaseStore, Lost, Won, make_holder


class Heartbeat:
    """Keeps a held lease alive from a background thread, every ttl/3.

    ``ttl`` bounds how long a crashed holder blocks the sweep, not how long a
    run may take: a live holder keeps renewing. A renewal that finds the
    lease taken sets ``lost``. Renewals that fail for two thirds of the ttl
    (on the monotonic clock, from the last renewal that succeeded) set it
    too: by then the row may expire before another renewal gets through.
    """

    def __init__(
        self,
        store: LeaseStore,
        name: str,
        won: Won,
        ttl: timedelta,
        lost: threading.Event,
        *,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.name, self.won, self.ttl, self.lost = store, name, won, ttl, lost
        self.on_event = on_event or (lambda _event, _fields: None)
        self.monotonic = monotonic
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"sweepd-heartbeat-{name}", daemon=True
        )

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # Bounded: a renewal stuck on a silent database must not hang the caller.
            self._thread.join(timeout=self.ttl.total_seconds() / 3 + 1)

    def _renew(self, timeout: float) -> bool:
        """One renewal, given up on after ``timeout``: a hung call counts as a failed one."""
        result: list[bool | BaseException] = []

        def call() -> None:
            try:
                result.append(
                    self.store.renew(self.name, self.won.holder, self.won.token, self.ttl)
                )
            except StoreError as error:
                result.append(error)

        worker = threading.Thread(target=call, name=f"sweepd-renew-{self.name}", daemon=True)
        worker.start()
        worker.join(timeout)
        if not result:
            raise StoreError(
                f"lease renew for {self.name!r} got no answer within {timeout:g}s", transient=True
            )
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def _run(self) -> None:
        interval = self.ttl.total_seconds() / 3
        last_ok = self.monotonic()
        while not self._stop.wait(interval):
            attempt_at = self.monotonic()
            try:
                renewed = self._renew(timeout=interval)
            except StoreError as error:
                self.on_event("lease.renew_failed", {"error": str(error)})
                if attempt_at - last_ok >= interval * 2:
                    self.on_event("lease.lost", {"reason": "unreachable", "error": str(error)})
                    self.lost.set()
                    return
                continue
            if not renewed:
                self.on_event("lease.lost", {"reason": "taken"})
                self.lost.set()
                return
            last_ok = attempt_at


class LeaseUnavailable(SweepdError):
    """The lease is held by another holder, or this tick was already claimed."""

    def __init__(self, name: str, lost: Lost) -> None:
        self.lost = lost
        holder = lost.holder or "another holder"
        until = f" until {lost.expires_at.isoformat()}" if lost.expires_at else ""
        if lost.reason == "already_run":
            super().__init__(
                f"{name}: tick {lost.tick.isoformat() if lost.tick else '?'} was already claimed by {holder}"
            )
        else:
            super().__init__(f"{name}: held by {holder}{until}")


P = ParamSpec("P")
R = TypeVar("R")


class Lease:
    """The lease as a library, for code that has its own scheduler.

    ``with Lease(url, "nightly-export", ttl="10m", tick=slot) as held:`` runs
    the block only when this process wins (``LeaseUnavailable`` otherwise),
    heartbeats while it runs and releases after. ``held.token`` is the
    fencing token; ``held.lost`` is set if the lease slips away. ``async
    with`` works the same way without blocking the event loop.
    """

    def __init__(
        self,
        database: str | Engine,
        name: str,
        *,
        ttl: timedelta | str,
        tick: datetime | None = None,
        namespace: str = "default",
        holder: str | None = None,
    ) -> None:
        self._owns_engine = isinstance(database, str)
        self.engine = make_engine(database) if isinstance(database, str) else database
        self.store = LeaseStore(self.engine, namespace)
        self.name = name
        self.ttl = parse_duration(ttl) if isinstance(ttl, str) else ttl
        self.tick = tick
        self.holder = holder or make_holder()
        self.lost = threading.Event()
        self.token: int | None = None
        self._heartbeat: Heartbeat | None = None

    def acquire(self) -> Claim:
        """Try once; on a win, start heartbeating. Store faults raise ``StoreError``."""
        outcome = self.store.claim(self.name, self.holder, self.ttl, self.tick)
        if isinstance(outcome, Won):
            self.token = outcome.token
            self.lost.clear()
            self._heartbeat = Heartbeat(self.store, self.name, outcome, self.ttl, self.lost).start()
        return outcome

    def release(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self.token is not None:
            self.store.release(self.name, self.holder, self.token)
            self.token = None
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> Lease:
        outcome = self.acquire()
        if isinstance(outcome, Lost):
            self.release()
            raise LeaseUnavailable(self.name, outcome)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return await asyncio.to_thread(self.__enter__)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.release)


class leased:  # lowercase: used as a decorator, it reads as one
    """Decorate a function so each call runs only if it wins the lease; a lost call returns None.

    Works on sync and async functions. Each call is its own claim with no
    tick: the lease keeps calls on several hosts from overlapping.
    """

    def __init__(
        self, database: str | Engine, name: str, *, ttl: timedelta | str, namespace: str = "default"
    ) -> None:
        self.engine = make_engine(database) if isinstance(database, str) else database
        self.name, self.ttl, self.namespace = name, ttl, namespace

    def _lease(self) -> Lease:
        return Lease(self.engine, self.name, ttl=self.ttl, namespace=self.namespace)

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]: ...
    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                try:
                    async with self._lease():
                        return await fn(*args, **kwargs)
                except LeaseUnavailable:
                    return None

            return run_async

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> Any:
            try:
                with self._lease():
                    return fn(*args, **kwargs)
            except LeaseUnavailable:
                return None

        return run


__all__ = ["Heartbeat", "Lease", "LeaseUnavailable", "leased"]
