"""Sweeps bundled with sweepd, so the example config runs with no code of yours.

They touch nothing but the log; copy their shape, not their bodies.
"""

from __future__ import annotations

import asyncio
import time

from sweepd.context import SweepContext
from sweepd.registry import sweep


def heartbeat(ctx: SweepContext) -> None:
    """Log that the schedule is alive: the smallest sweep there is."""
    ctx.logger.info("example.heartbeat", fencing_token=ctx.fencing_token)


def purge(ctx: SweepContext, batch: int = 100, pause: float = 0.0) -> int:
    """Pretend to delete ``batch`` expired rows, stopping early when told to."""
    done = 0
    for _ in range(batch):
        if ctx.cancelled.is_set() or ctx.lease_lost.is_set():
            break
        done += 1
        if pause:
            time.sleep(pause)
    ctx.logger.info("example.purged", rows=done)
    return done


@sweep(every="1m", ttl="30s", timeout="20s")
async def reconcile(ctx: SweepContext) -> None:
    """An async sweep declared in code; the example config overrides its interval."""
    await asyncio.sleep(0.01)
    ctx.logger.info("example.reconciled", attempt=ctx.attempt)
