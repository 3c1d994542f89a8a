"""The loop: ticks -> single-flight queues -> the runner; reload; drain.

One asyncio loop sleeps until the next due tick (a heap of fire times, no
polling), hands the tick to its sweep's queue, and goes back to sleep. Each
sweep has one flight: at most one run in progress and one tick waiting, so
a sweep never overlaps itself; ticks that arrive while one waits are folded
into it and counted. The runner's slots (``sweepd.slots``) claim a tick only
when a slot is free for it, so a tick waiting for a slot holds no lease.

``Daemon.run()`` installs no signal handlers: ``lifecycle`` does that for
the command, and tests and embedders call ``stop()`` themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from operator import attrgetter
from typing import Any

from sqlalchemy import Engine

from sweepd.clock import Clock, SystemClock
from sweepd.durations import format_duration
from sweepd.errors import StoreError
from sweepd.health import Vitals, serve_health
from sweepd.history import History
from sweepd.lease import LeaseStore, make_holder
from sweepd.metrics import Metrics
from sweepd.model import Settings, SweepDef
from sweepd.observe import get_logger
from sweepd.offload import bounded
from sweepd.runner import DRAIN_MESSAGE, Runner, iso
from sweepd.schedule import Every, jitter_delay, next_tick, previous_tick, stale_after, ticks_from

HISTORY_SWEEP = "sweepd.prune-history"
# Extra time, past drain_timeout, that cancelled runs get to notice and return.
CANCEL_GRACE_SECONDS = 2.0
# At most one daemon.short_of_slots warning this often: a replica that falls
# behind folds ticks of many sweeps every interval, and one line a minute says it.
SHORT_OF_SLOTS_EVERY_SECONDS = 60.0


@dataclass
class Flight:
    """One sweep's single-flight queue."""

    sweep: SweepDef
    task: asyncio.Task[None] | None = None
    waiting: datetime | None = None
    removed: bool = False


@dataclass(order=True)
class _Due:
    fire_at: datetime
    rank: float  # this replica's order among sweeps due at the same instant
    seq: int
    tick: datetime = field(compare=False)
    name: str = field(compare=False)
    generation: int = field(compare=False)


class Daemon:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        clock: Clock | None = None,
        holder: str | None = None,
        dry_run: bool = False,
        reload: Callable[[], Settings] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings, self.engine, self.dry_run, self._reload = settings, engine, dry_run, reload
        self.clock, self.rng = clock or SystemClock(), rng or random.Random()
        self.holder = holder or make_holder()
        self.stats: Counter[str] = Counter()
        self.log = get_logger(holder=self.holder, namespace=settings.namespace)
        self.metrics = Metrics()
        self.vitals = Vitals()
        self.history = History(engine, settings.namespace)
        self.runner = Runner(
            LeaseStore(engine, settings.namespace), self.history, self.holder, self.clock,
            self.log, self.stats, settings.concurrency, self.metrics,
        )  # fmt: skip
        self.flights: dict[str, Flight] = {}
        self.metrics.count_from(
            in_flight=lambda: len(self.runner.inflight),
            queued=lambda: sum(f.waiting is not None for f in list(self.flights.values())),
        )
        self._retired: list[Flight] = []  # removed by a reload, their last run still going
        self._heap: list[_Due] = []  # fire times, soonest first; _seq orders equal ones
        self._seq = 0
        self._generation: dict[str, int] = {}
        self._rank: dict[str, float] = {}  # this replica's order of the sweeps (_push)
        self._wake = asyncio.Event()
        self._stopping = self._reload_requested = False
        self._short_of_slots: float | None = None  # when it was last said (monotonic)
        self._folded_unstarted = 0  # ticks folded behind unstarted ones since then
        self.last_fired: datetime | None = None  # the latest tick handed to a flight
        # Told of each change of state, on the loop: "started" (schedules loaded),
        # "reloading", "reloaded" (taken or not), "draining" and "stopped". systemd's
        # notify protocol and the readiness probe listen here; none may block.
        self.watchers: list[Callable[[str], None]] = []

    def _tell(self, state: str) -> None:
        for watcher in self.watchers:
            try:
                watcher(state)
            except Exception as error:  # a watcher's bug must not stop the daemon
                self.log.exception("daemon.watcher_failed", state=state, error=str(error))

    # -- control, safe to call from signal handlers and other threads via call_soon ----

    def stop(self) -> None:
        """Begin draining; a second call changes nothing."""
        if not self._stopping:
            self._tell("draining")
        self._stopping = True
        self.vitals.draining = True
        self.runner.drain()
        self._wake.set()

    def request_reload(self) -> None:
        self._reload_requested = True
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self._stopping

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        listen = self.settings.health_listen  # empty: no health server
        pulse, server = (
            serve_health(
                listen, self.vitals, self.clock, self.metrics, self.runner.ticks.now, self.log
            )
            if listen
            else (None, None)
        )
        try:
            await self._run()
        finally:
            if pulse is not None and server is not None:
                pulse.stop()
                server.stop()

    async def _run(self) -> None:
        now = self.clock.now()
        for sweep in self._all_sweeps(self.settings):
            self._add(sweep, now, starting=True)
        # The config's sweeps, counted as check-config counts them; the
        # internal history sweep is the daemon's own business.
        self.log.info(
            "daemon.started",
            sweeps=len(self.settings.sweeps),
            concurrency=self.settings.concurrency,
            dry_run=self.dry_run,
        )
        self._tell("started")
        try:
            await self._loop()
        finally:
            await self._drain()
            self._tell("stopped")

    async def _loop(self) -> None:
        while not self._stopping:
            if self._reload_requested:
                self._reload_requested = False
                await self._apply_reload()
                continue
            now = self.clock.now()
            while self._heap and self._heap[0].fire_at <= now:
                due = heapq.heappop(self._heap)
                if self._generation.get(due.name) == due.generation:
                    self._fire(due, now)
            # Read the clock again: firing a burst of ticks takes milliseconds,
            # and a delay counted from before it would wake that much late.
            delay = (
                (self._heap[0].fire_at - self.clock.now()).total_seconds() if self._heap else 3600.0
            )
            # Wake at least every 30 s, so a stepped wall clock is noticed
            # without waiting out a long delay.
            await self._sleep(min(delay, 30.0))

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        if self._stopping or self._reload_requested:
            return
        # A timer set now, not a sleeping task: a task's first step, where its
        # sleep would begin, waits behind every flight the burst just started.
        timer = self.clock.call_later(seconds, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()

    # -- schedules ---------------------------------------------------------------------------

    def _all_sweeps(self, settings: Settings) -> list[SweepDef]:
        sweeps = [s for s in settings.sweeps if s.enabled]
        sweeps.append(self._history_sweep(settings))
        return sweeps

    def _history_sweep(self, settings: Settings) -> SweepDef:
        """Pruning is a sweep like any other: leased, recorded, once per tick across replicas."""
        keep = settings.history_keep
        history = self.history

        def prune() -> None:
            deleted = history.prune(keep)
            self.log.info("history.pruned", deleted=deleted, keep=format_duration(keep))

        return SweepDef(
            name=HISTORY_SWEEP,
            func=prune,
            target="sweepd.daemon:prune-history",
            schedule=Every(min(timedelta(hours=1), max(keep / 4, timedelta(minutes=1)))),
            ttl=timedelta(minutes=5),
            timeout=None,
            misfire_grace=timedelta(minutes=5),
        )

    def _add(self, sweep: SweepDef, now: datetime, *, starting: bool = False) -> None:
        generation = self._generation.get(sweep.name, 0) + 1
        self._generation[sweep.name] = generation
        flight = self.flights.get(sweep.name) or self._revive(sweep.name)
        if flight is None:
            self.flights[sweep.name] = Flight(sweep)
        else:
            flight.sweep = sweep  # the run in flight finishes with the settings it started with
        # The stale-after gauge, for an alert on a sweep nobody runs (`sweepd status`'s rule).
        stale = stale_after(sweep.schedule, sweep.ttl, now)
        self.metrics.stale_after.labels(sweep.name).set(stale.total_seconds())
        # No catch-up by default: the first tick is the next one from now, so
        # a restart or an edited schedule never causes a surprise run.
        first = next(ticks_from(sweep.schedule, now), None)
        if starting and sweep.catch_up == "latest":
            latest = previous_tick(sweep.schedule, now)
            if latest is not None and latest < now:
                self.log.info("tick.catch_up", sweep=sweep.name, tick=iso(latest))
                self._enqueue(sweep.name, latest)
        if first is not None:
            self._push(sweep, first, generation)

    def _revive(self, name: str) -> Flight | None:
        """The flight of a sweep that a reload removed and this one adds back,
        if its last tick is still running or waiting for a slot. It takes the
        sweep back: a second flight would race the first for the lease, and
        both could be handed the same claim."""
        for flight in self._retired:
            if flight.sweep.name == name and flight.task is not None:
                self._retired.remove(flight)
                flight.removed = False
                self.flights[name] = flight
                return flight
        return None

    def _push(self, sweep: SweepDef, tick: datetime, generation: int) -> None:
        # Each replica walks the sweeps due at one instant in an order of its
        # own. In one shared order every replica would ask for the same rows
        # first and most claims would find them taken; in different orders
        # each mostly finds its first choices free, and a burst is spread
        # over the replicas sooner.
        self._seq += 1
        fire_at = tick + jitter_delay(sweep.jitter, self.rng)
        rank = self._rank.setdefault(sweep.name, self.rng.random())
        heapq.heappush(self._heap, _Due(fire_at, rank, self._seq, tick, sweep.name, generation))

    def _fire(self, due: _Due, now: datetime) -> None:
        flight = self.flights[due.name]
        sweep = flight.sweep
        following = next_tick(sweep.schedule, due.tick)
        late = now - due.tick
        if late > sweep.misfire_grace + (sweep.jitter if sweep.jitter else timedelta(0)):
            # Fell behind (a suspended host, a stepped clock): every missed tick
            # is counted, but the loop jumps to the present in one step.
            missed = [due.tick]
            while following is not None and following + sweep.misfire_grace < now:
                missed.append(following)
                following = next_tick(sweep.schedule, following)
            self.stats["skipped.missed"] += len(missed)
            self.metrics.skips.labels(sweep.name, "missed").inc(len(missed))
            self.log.warning(
                "tick.skipped",
                reason="missed",
                sweep=sweep.name,
                tick=iso(missed[0]),
                last=iso(missed[-1]),
                count=len(missed),
                late=round(late.total_seconds(), 3),
            )
        else:
            self.last_fired = due.tick
            self._enqueue(due.name, due.tick)
        if following is not None:
            self._push(sweep, following, due.generation)

    # -- single flight --------------------------------------------------------------------------

    def _enqueue(self, name: str, tick: datetime) -> None:
        flight = self.flights[name]
        if self._stopping:
            self._skip(flight.sweep, tick, "draining")
            return
        if self.dry_run:
            self.stats["ticks.would_fire"] += 1
            self.log.info("tick.would_fire", sweep=name, tick=iso(tick))
            return
        if flight.task is None:
            flight.task = asyncio.create_task(self._fly(flight, tick), name=f"flight-{name}")
            return
        if flight.waiting is None:
            flight.waiting = tick
            self.stats["ticks.queued"] += 1
            self.log.info("tick.queued", sweep=name, tick=iso(tick))
            return
        # One tick already waits: fold this one into it.
        if flight.sweep.coalesce == "latest":
            folded, flight.waiting = flight.waiting, tick
        else:
            folded = tick
        self._skip(flight.sweep, folded, "coalesced", kept=iso(flight.waiting))
        if not self.runner.holds(name):
            self._behind(flight.sweep)

    def _behind(self, sweep: SweepDef) -> None:
        """A tick folded while the one ahead of it is still not claimed: not a
        long run (that folds quietly, as single-flight should), but a replica
        whose slots or claims cannot keep up, which would otherwise show only
        as info lines and lateness."""
        self._folded_unstarted += 1
        now = self.clock.monotonic()
        if (
            self._short_of_slots is not None
            and now - self._short_of_slots < SHORT_OF_SLOTS_EVERY_SECONDS
        ):
            return
        self._short_of_slots = now
        waiting = sum(
            f.task is not None and not self.runner.holds(f.sweep.name)
            for f in list(self.flights.values())
        )
        self.log.warning(
            "daemon.short_of_slots",
            sweep=sweep.name,
            folded=self._folded_unstarted,
            waiting=waiting,
            concurrency=self.settings.concurrency,
            note="ticks are folded before the one ahead of them is claimed: raise concurrency,"
            " add replicas, or look for slow claims",
        )
        self._folded_unstarted = 0

    def _skip(self, sweep: SweepDef, tick: datetime, reason: str, **fields: Any) -> None:
        self.stats[f"skipped.{reason}"] += 1
        self.metrics.skips.labels(sweep.name, reason).inc()
        self.log.info("tick.skipped", reason=reason, sweep=sweep.name, tick=iso(tick), **fields)

    async def _fly(self, flight: Flight, tick: datetime | None) -> None:
        try:
            while tick is not None and not self._stopping:
                # The runner takes one of the concurrency slots before it claims.
                if await self.runner.execute(flight.sweep, tick) == "draining":
                    break
                tick, flight.waiting = flight.waiting, None
            if tick is not None and self._stopping:
                self._skip(flight.sweep, tick, "draining")
        except Exception as error:  # a bug here must not take the daemon down silently
            self.log.exception("daemon.flight_crashed", sweep=flight.sweep.name, error=str(error))
        finally:
            flight.task = None
            flight.waiting = None
            if flight.removed and flight in self._retired:
                self._retired.remove(flight)

    # -- reload ---------------------------------------------------------------------------------

    async def _apply_reload(self) -> None:
        if self._reload is None:
            return
        self._tell("reloading")
        try:
            await self._reload_now()
        finally:
            self._tell("reloaded")

    async def _reload_now(self) -> None:
        assert self._reload is not None
        try:
            new = await asyncio.to_thread(self._reload)
        except Exception as error:
            problems = getattr(error, "problems", None)
            self.log.error(
                "config.reload_failed",
                error=str(error).splitlines()[0] if str(error) else type(error).__name__,
                problems=[str(p) for p in problems] if problems else None,
                note="the running config is kept",
            )
            return
        now = self.clock.now()
        old = {s.name: s for s in self._all_sweeps(self.settings)}
        fresh = {s.name: s for s in self._all_sweeps(new)}
        removed = sorted(old.keys() - fresh.keys())
        for name in removed:
            self._retire(name)
        added = sorted(fresh.keys() - old.keys())
        changed = sorted(n for n in fresh.keys() & old.keys() if _differs(fresh[n], old[n]))
        for name in changed:
            # A tick of the old schedule still waiting would be a surprise
            # run after the edit: the next run is the new schedule's next tick.
            flight = self.flights.get(name)
            if flight is not None and flight.waiting is not None:
                self._skip(flight.sweep, flight.waiting, "rescheduled")
                flight.waiting = None
        for name in added + changed:
            self._add(fresh[name], now)
        self.settings = replace(self.settings, sweeps=new.sweeps, warnings=new.warnings)
        self.log.info("config.reloaded", added=added, removed=removed, changed=changed)

    def _retire(self, name: str) -> None:
        """A sweep the reload removed: no more ticks; a run in flight finishes."""
        self._generation[name] = self._generation.get(name, 0) + 1  # drops its fire times
        with contextlib.suppress(KeyError):  # a removed sweep is stale for nobody
            self.metrics.stale_after.remove(name)
        flight = self.flights.pop(name, None)
        if flight is not None:
            flight.removed = True
            flight.waiting = None
            if flight.task is not None:
                self._retired.append(flight)

    # -- drain ----------------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Stop claiming, let runs finish (heartbeats go on), cancel the rest, release."""
        self.runner.drain()
        for flight in self.flights.values():
            if flight.waiting is not None:
                self._skip(flight.sweep, flight.waiting, "draining")
                flight.waiting = None
        flights = [*self.flights.values(), *self._retired]
        tasks = [f.task for f in flights if f.task is not None]
        self.log.info(
            "daemon.draining",
            in_flight=len(tasks),
            timeout=self.settings.drain_timeout.total_seconds(),
        )
        if tasks:
            _, pending = await asyncio.wait(
                tasks, timeout=self.settings.drain_timeout.total_seconds()
            )
            if pending:
                await self._cancel_in_flight(pending)
        await self.runner.settle()
        if self.runner.unreleased:
            self.log.warning(
                "lease.release_failed",
                count=len(self.runner.unreleased),
                note="not released at exit; each frees itself at its expiry",
            )
        if self.runner.unfinished:
            self.log.error(
                "run.record_failed",
                operation="finish",
                count=len(self.runner.unfinished),
                note="left running; the next claim of each sweep marks them lost",
            )
        self.log.info("daemon.stopped", stats=dict(sorted(self.stats.items())))

    async def _cancel_in_flight(self, pending: set[asyncio.Task[None]]) -> None:
        ticks = self.runner.ticks
        stuck = []
        for name in list(self.runner.inflight):
            attempt = self.runner.stop(name, "cancelled")
            if attempt is None:
                continue
            stuck.append(attempt)
            self.log.warning(
                "run.cancelling", sweep=name, run_id=attempt.run_id, reason="drain_timeout"
            )
            # Recorded now, before the code gets its chance to return: a run cut
            # off at the deadline is "cancelled" whatever it does next. One
            # that had timed out already says so, and keeps saying it.
            if attempt.run_id is not None and attempt.reason != "timeout":
                try:
                    ending = (attempt.run_id, name, "cancelled", DRAIN_MESSAGE)
                    await bounded(ticks.finish, ending)
                except Exception as error:
                    self.log.error(
                        "run.record_failed", sweep=name, operation="finish", error=str(error)
                    )
        _, still = await asyncio.wait(pending, timeout=CANCEL_GRACE_SECONDS)
        for task in still:
            task.cancel()
        # A sync sweep that ignores ctx.cancelled cannot be stopped from here;
        # its lease is released and the process exit ends its thread.
        with contextlib.suppress(StoreError):
            await bounded(ticks.release, [(a.sweep.name, a.token) for a in stuck])


def _differs(a: SweepDef, b: SweepDef) -> bool:
    """Whether a reload changed how the sweep runs, so its next tick is the new schedule's."""
    return _HOW(a) != _HOW(b) or dict(a.args) != dict(b.args)


_HOW = attrgetter("schedule", "ttl", "timeout", "jitter", "target", "retries")
