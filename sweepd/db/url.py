"""The database URL: which of our drivers it means, and whether it can be used.

``make_engine`` checks both before it makes an engine, and ``check-config``
reads the URL without making one: a wrong URL or an unusable SQLite folder is
one located line and exit 2, never a driver's traceback.
"""

from __future__ import annotations

import os

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from sweepd.errors import DatabaseFileError, UsageError
from sweepd.redact import mask_url

# Bare schemes mean our drivers: psycopg 3 and PyMySQL, not SQLAlchemy's defaults.
_DRIVERS = {
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "mysql": "mysql+pymysql",
    "mariadb": "mysql+pymysql",
    "mariadb+pymysql": "mysql+pymysql",
}
# The extra that installs each of our drivers: a plain `pip install sweepd` has neither.
EXTRAS = {"postgresql+psycopg": "postgres", "mysql+pymysql": "mysql"}


class DatabaseUrlError(UsageError):
    """The database URL cannot be used."""


def normalize_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseUrlError(f"invalid database URL {mask_url(url)!r}") from None
    driver = _DRIVERS.get(parsed.drivername)
    if driver is not None:
        parsed = parsed.set(drivername=driver)
    if parsed.get_backend_name() not in ("sqlite", "postgresql", "mysql"):
        raise DatabaseUrlError(
            f"unsupported database {parsed.get_backend_name()!r} in {mask_url(url)!r}"
        )
    return parsed


def check_sqlite_folder(url: URL) -> None:
    """Refuse a SQLite file whose folder cannot hold it, naming the path and why.

    SQLite itself says only "unable to open database file", and the migration
    lock beside the file fails before it. The folder must be writable, not
    only the file: WAL keeps two more files beside the database.
    """
    database = url.database
    if not database or database == ":memory:" or url.query.get("uri"):
        return  # in memory, or a URI filename that SQLite resolves itself
    path = os.path.abspath(database)
    folder = os.path.dirname(path)
    if not os.path.exists(folder):
        wrong = f"the folder {folder} does not exist"
    elif not os.path.isdir(folder):
        wrong = f"{folder} is a file, not a folder"
    elif not os.access(folder, os.W_OK | os.X_OK):
        wrong = f"the folder {folder} is not writable"
    else:
        return
    raise DatabaseFileError(f"database file {path}: {wrong}")
