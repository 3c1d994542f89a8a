"""The daemon's Prometheus metrics: the only module that imports prometheus_client.

Every name starts with ``sweepd_``, and labels are bounded: a sweep's name,
a status, a skip's reason, a store operation. Never a tick or a holder,
which would make a new series every second. Each daemon has a registry of
its own, so an embedder's global registry is left alone and tests do not
see each other's counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from sweepd import __version__

# Seconds, for run durations and tick lateness alike: maintenance jobs take
# from a millisecond (nothing to do) to an hour (a big reconciliation), and
# a tick is claimed within milliseconds of its time or, when the replicas
# are short of slots, minutes late.
BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    1800.0,
    3600.0,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.runs = Counter(
            "sweepd_runs", "Run attempts that ended, by outcome.", ["sweep", "status"], registry=r
        )
        self.run_duration = Histogram(
            "sweepd_run_duration_seconds",
            "How long a run attempt's code took.",
            ["sweep"],
            buckets=BUCKETS,
            registry=r,
        )
        self.tick_lateness = Histogram(
            "sweepd_tick_lateness_seconds",
            "From a tick's scheduled time to this replica's claim of it.",
            ["sweep"],
            buckets=BUCKETS,
            registry=r,
        )
        self.skips = Counter(
            "sweepd_ticks_skipped",
            "Ticks this replica did not run, by reason (already_run and lease_held: another"
            " replica has them).",
            ["sweep", "reason"],
            registry=r,
        )
        self.store_errors = Counter(
            "sweepd_store_errors",
            "Database calls that failed, by operation.",
            ["operation"],
            registry=r,
        )
        self.lease_losses = Counter(
            "sweepd_lease_losses",
            "Leases lost while their run was in flight (taken, or the database unreachable).",
            ["sweep"],
            registry=r,
        )
        self.last_run = Gauge(
            "sweepd_last_run_timestamp_seconds",
            "When this replica last ended a run attempt of the sweep (Unix time).",
            ["sweep"],
            registry=r,
        )
        self.last_success = Gauge(
            "sweepd_last_success_timestamp_seconds",
            "When this replica last ended a successful run of the sweep (Unix time).",
            ["sweep"],
            registry=r,
        )
        self.stale_after = Gauge(
            "sweepd_sweep_stale_after_seconds",
            "How long a sweep may go without a success before it is stale: two intervals"
            " and its ttl, the rule of sweepd status.",
            ["sweep"],
            registry=r,
        )
        self.in_flight = Gauge(
            "sweepd_runs_in_flight", "Runs whose code is running now.", registry=r
        )
        self.queued = Gauge(
            "sweepd_ticks_queued", "Ticks waiting behind their sweep's run in flight.", registry=r
        )
        self.clock_skew = Gauge(
            "sweepd_clock_skew_seconds",
            "This host's clock minus the database's, as last measured (leases use the database's).",
            registry=r,
        )
        self.ready = Gauge("sweepd_ready", "1 while /readyz says ready, else 0.", registry=r)
        Gauge("sweepd_build_info", "The running sweepd's version.", ["version"], registry=r).labels(
            __version__
        ).set(1)

        self._sweeps: dict[str, SweepSeries] = {}

    def of(self, sweep: str) -> SweepSeries:
        """The series a run of ``sweep`` updates, looked up once per sweep."""
        series = self._sweeps.get(sweep)
        if series is None:
            series = self._sweeps[sweep] = SweepSeries(self, sweep)
        return series

    def count_from(self, in_flight: Callable[[], int], queued: Callable[[], int]) -> None:
        """Read the two gauges of the daemon's own state at each scrape, not at each change."""
        self.in_flight.set_function(in_flight)
        self.queued.set_function(queued)

    def render(self) -> bytes:
        """The Prometheus text format (0.0.4)."""
        return generate_latest(self.registry)


class SweepSeries:
    """One sweep's children of the labelled metrics a run updates.

    ``labels()`` takes a lock and builds a key on every call: the five updates
    of a run cost 8.6 us through it and 3.0 us through children kept here
    (timeit, this project's 2-core machine), about a sixtieth of a run's CPU.
    """

    def __init__(self, metrics: Metrics, sweep: str) -> None:
        self._metrics, self._sweep = metrics, sweep
        self.lateness = metrics.tick_lateness.labels(sweep)
        self.duration = metrics.run_duration.labels(sweep)
        self.last_run = metrics.last_run.labels(sweep)
        self._last_success: Any = None  # made at the first success: absent until then
        self._runs: dict[str, Any] = {}

    def ended(self, status: str, duration: float, at: float) -> None:
        """A run attempt ended ``at`` (Unix time) with ``status``."""
        runs = self._runs.get(status)
        if runs is None:
            runs = self._runs[status] = self._metrics.runs.labels(self._sweep, status)
        runs.inc()
        self.duration.observe(duration)
        self.last_run.set(at)
        if status == "success":
            if self._last_success is None:
                self._last_success = self._metrics.last_success.labels(self._sweep)
            self._last_success.set(at)
