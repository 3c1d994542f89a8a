"""The environment, read once.

Every variable sweepd honours is read here, by one call the CLI makes when a
command starts. Nothing else looks at ``os.environ``: a variable that some
module read at import and another read later could disagree about which
value was in force, and an operator could not tell which one won. What each
variable does is in the README's table of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# systemd's own variables for the process it started (sd_notify(3)), taken with
# the others so that nothing else reads os.environ either.
SYSTEMD_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass(frozen=True)
class Environment:
    config: str | None = None
    database_url: str | None = None
    namespace: str | None = None
    health_listen: str | None = None
    log_format: str | None = None
    log_level: str | None = None
    env: str | None = None
    systemd: Mapping[str, str] = field(default_factory=dict)

    @property
    def production(self) -> bool:
        return (self.env or "").strip().lower() == "production"


def read_environment(environ: Mapping[str, str]) -> Environment:
    """Take every SWEEPD_* value, and systemd's, at this one moment; empty counts as unset."""

    def get(name: str) -> str | None:
        value = environ.get(name)
        return value if value else None

    return Environment(
        config=get("SWEEPD_CONFIG"),
        database_url=get("SWEEPD_DATABASE_URL"),
        namespace=get("SWEEPD_NAMESPACE"),
        health_listen=environ.get("SWEEPD_HEALTH_LISTEN"),  # "" is meaningful: disables
        log_format=get("SWEEPD_LOG_FORMAT"),
        log_level=get("SWEEPD_LOG_LEVEL"),
        env=get("SWEEPD_ENV"),
        systemd={name: environ[name] for name in SYSTEMD_VARIABLES if environ.get(name)},
    )
