"""Is the database usable: reachable, at the current schema, with a sane clock.

Leases compare times on the database's clock, so a host whose own clock is
off does no harm to them; but the skew is still worth a warning, because an
operator reading logs from both will be misled by it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from sweepd.db import migrate
from sweepd.db.engine import db_now, make_engine
from sweepd.errors import DatabaseFileError
from sweepd.redact import mask_in

SKEW_WARNING_SECONDS = 1.0


@dataclass(frozen=True)
class DatabaseReport:
    reachable: bool
    error: str | None = None
    revision: str | None = None
    head: str | None = None
    skew_seconds: float | None = None  # the database's clock minus this host's

    @property
    def current(self) -> bool:
        return self.reachable and self.revision == self.head

    @property
    def skewed(self) -> bool:
        return self.skew_seconds is not None and abs(self.skew_seconds) > SKEW_WARNING_SECONDS


def check_database(url: str) -> DatabaseReport:
    try:
        engine = make_engine(url)
    except DatabaseFileError as error:
        # A SQLite file that cannot be made is what this check is for: say where, and why.
        return DatabaseReport(False, error=str(error))
    try:
        with engine.connect() as connection:
            before = time.time()
            database_now = connection.execute(select(db_now())).scalar_one()
            after = time.time()
        assert isinstance(database_now, datetime)
        # The midpoint of the round trip is our best guess at when the database read its clock.
        local = datetime.fromtimestamp((before + after) / 2, UTC)
        skew = (database_now - local).total_seconds()
        return DatabaseReport(
            True, revision=migrate.current(engine), head=migrate.head(), skew_seconds=skew
        )
    except SQLAlchemyError as error:
        orig = getattr(error, "orig", None) or error
        first_line = (str(orig).strip().splitlines() or [""])[0]
        return DatabaseReport(False, error=mask_in(f"{type(orig).__name__}: {first_line}", url))
    finally:
        engine.dispose()
