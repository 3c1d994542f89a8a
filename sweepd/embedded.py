"""The daemon inside a host's own asyncio program: an ASGI app's lifespan, a worker's main.

``sweepd run`` owns its process: it installs signal handlers, drains on SIGTERM and exits. A
host that owns those already needs the daemon without them. ``Scheduler`` runs it as a task on
the host's loop and drains it when the host says so; signals, logging's set-up and the exit stay
the host's.
"""

from __future__ import annotations

import asyncio
import os
from types import TracebackType

from sqlalchemy import Engine

from sweepd.config import Overrides, load_settings
from sweepd.daemon import Daemon
from sweepd.db import migrate
from sweepd.db.engine import make_engine
from sweepd.environment import Environment
from sweepd.model import Settings


class Scheduler:
    """The sweeps of one config file, fired on the running loop until ``drain()``.

    A bad config raises ``sweepd.errors.ConfigError`` here, listing every problem. The
    environment is not read: the host passes what it decided, ``database_url`` above the
    file's. sweepd logs through structlog as the host configured it.
    """

    def __init__(self, config: str | os.PathLike[str], *, database_url: str | None = None) -> None:
        path = os.fspath(config)
        overrides = Overrides(database_url=database_url)
        self.settings: Settings = load_settings(path, Environment(), overrides)
        self._reload_from = (path, overrides)
        self._engine: Engine | None = None
        self._daemon: Daemon | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bring the schema up to date (unless the config says ``migrate: never``), then start
        firing; returns once every schedule is loaded."""
        if self._task is not None:
            raise RuntimeError("this scheduler has been started already")
        url = self.settings.database.url
        if self.settings.database.migrate == "auto":
            await asyncio.to_thread(migrate.upgrade, url)
        self._engine = make_engine(url)
        await asyncio.to_thread(migrate.require_current, self._engine)
        self._daemon = Daemon(self.settings, self._engine, reload=self._load)
        started = asyncio.Event()
        self._daemon.watchers.append(lambda state: started.set() if state == "started" else None)
        self._task = asyncio.create_task(self._daemon.run(), name="sweepd")
        waiting = asyncio.create_task(started.wait())
        await asyncio.wait({self._task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if self._task.done():  # it failed before its schedules were loaded
            await self.drain()

    def reload(self) -> None:
        """Read the config file again, as SIGHUP does to ``sweepd run``."""
        if self._daemon is not None:
            self._daemon.request_reload()

    async def drain(self) -> None:
        """Stop firing, let the runs in flight finish (up to ``drain_timeout``), release the
        leases; returns when all that is done, raising what stopped the daemon if it failed."""
        if self._daemon is None or self._task is None:
            return
        self._daemon.stop()
        try:
            await self._task
        finally:
            if self._engine is not None:
                self._engine.dispose()

    async def __aenter__(self) -> Scheduler:
        await self.start()
        return self

    async def __aexit__(
        self,
        _type: type[BaseException] | None,
        _error: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        await self.drain()

    def _load(self) -> Settings:
        path, overrides = self._reload_from
        return load_settings(path, Environment(), overrides)
