"""What a sweep function is handed about the run it is in."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass
class SweepContext:
    """The run a sweep function is in.

    A function receives one as its first argument when that parameter is
    annotated ``SweepContext`` or named ``ctx``. ``cancelled`` and
    ``lease_lost`` are ``threading.Event``s so that sync runs in worker threads
    and async runs on the loop read them the same way; a long sweep should
    check them between batches and stop early when either is set.
    """

    name: str
    tick: datetime  # the scheduled time this run is for, aware UTC
    fencing_token: int  # grows with every claim; pass it to writes that must not go stale
    attempt: int  # 1 for the first try, 2 for the first retry, ...
    holder: str  # hostname:pid:random of this replica
    logger: Any  # a structlog logger bound with sweep, tick, run id and holder
    cancelled: threading.Event = field(default_factory=threading.Event)
    lease_lost: threading.Event = field(default_factory=threading.Event)
