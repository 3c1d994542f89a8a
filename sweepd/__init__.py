"""sweepd: periodic maintenance jobs, each tick run exactly once across replicas."""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from sweepd.context import SweepContext
from sweepd.registry import sweep

if TYPE_CHECKING:
    from sweepd.library import Lease, leased

try:
    __version__ = version("sweepd")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["Lease", "SweepContext", "__version__", "leased", "sweep"]


def __getattr__(name: str) -> Any:
    # The lease pulls in SQLAlchemy; importing it lazily keeps `import sweepd`
    # (and so every CLI start and every module with @sweep) light.
    if name in ("Lease", "leased"):
        from sweepd import library

        return getattr(library, name)
    raise AttributeError(f"module 'sweepd' has no attribute {name!r}")
