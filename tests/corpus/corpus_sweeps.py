"""Sweep callables that the invalid-config corpus names.

The cases run with this folder (copied) as the working directory, so a
config can say ``callable: corpus_sweeps:purge``.
"""

from __future__ import annotations

from sweepd import SweepContext


def purge(ctx: SweepContext, batch: int = 100) -> int:
    """Takes the context and one optional keyword."""
    return batch


def prune(ctx: SweepContext, table: str) -> str:
    """Needs ``table``, which a config must pass in ``args``."""
    return table


LIMIT = 500  # an attribute that is not callable
