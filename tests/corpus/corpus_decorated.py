"""A module declaring a sweep whose decorator settings are invalid."""

from __future__ import annotations

from sweepd import SweepContext, sweep


@sweep(every="ten", ttl="10m")
def tidy(ctx: SweepContext) -> None:
    """Never runs: the config that imports this module is refused."""
