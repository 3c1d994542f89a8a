"""What ``serve`` does to the process before the loop starts (signals have system tests)."""

from __future__ import annotations

import asyncio
import gc
from typing import cast

from sweepd.daemon import Daemon
from sweepd.lifecycle import serve
from sweepd.observe import get_logger


class Recorder:
    """Stands in for the daemon: notes what the process looked like when it began."""

    frozen_at_start = -1

    async def run(self) -> None:
        self.frozen_at_start = gc.get_freeze_count()

    def stop(self) -> None: ...

    def request_reload(self) -> None: ...


def test_what_was_loaded_before_the_loop_is_frozen_out_of_the_collector() -> None:
    daemon = Recorder()
    try:
        status = asyncio.run(serve(cast(Daemon, daemon), get_logger()))
    finally:
        gc.unfreeze()
    assert status == 0
    # The modules, the config and the engine were made before serve(): frozen, a
    # full collection in a burst of ticks does not walk them again.
    assert daemon.frozen_at_start > 10_000
