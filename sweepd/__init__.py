"""sweepd: periodic maintenance jobs, each tick run exactly once across replicas."""

from importlib.metadata import PackageNotFoundError, version

from sweepd.context import SweepContext
from sweepd.registry import sweep

try:
    __version__ = version("sweepd")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["SweepContext", "__version__", "sweep"]
