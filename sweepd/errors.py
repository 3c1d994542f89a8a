"""The exceptions sweepd raises and the exit codes the CLI maps them to.

Each class's docstring is its default message, so raising one bare still says
something useful. Only ``cli.py`` turns these into output and exit codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # a check failed or a runtime fault
    USAGE = 2  # bad CLI arguments, config or environment


class SweepdError(Exception):
    """sweepd failed."""

    exit_code: int = ExitCode.FAILED

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


@dataclass(frozen=True)
class Problem:
    """One thing wrong with what a user wrote, and where they wrote it.

    ``location`` is ``FILE:LINE:COL`` for a YAML node, ``$NAME`` for an
    environment variable, or ``module.py:LINE`` for a decorator; ``path`` is
    the key path spelled as in the file (``sweeps[2].every``), empty when the
    problem is the file as a whole.
    """

    location: str
    path: str
    message: str

    def __str__(self) -> str:
        return ": ".join(part for part in (self.location, self.path, self.message) if part)


class UsageError(SweepdError):
    """The command was called wrongly."""

    exit_code: int = ExitCode.USAGE


class ConfigError(UsageError):
    """The configuration is invalid."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(problem) for problem in problems))


class DatabaseFileError(UsageError):
    """The SQLite file of the database URL cannot be created or opened where it is."""


class StoreError(SweepdError):
    """The lease store failed: the database could not be reached or refused the statement."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        # The default keeps it picklable (unpickling passes the message only),
        # so it crosses process boundaries in pools and test workers intact.
        super().__init__(message)
        # Transient faults (a connection, a timeout) may pass by the next tick;
        # the others (a missing table, a wrong column) will not fix themselves.
        self.transient = transient
