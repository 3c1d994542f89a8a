"""One tick of one sweep: take a slot (which claims it), call, renew, retry, close.

Every outcome is accounted for: a lost claim is a counted skip, a failed one
a loud error; a run's row is written before its code is called and finished
after, whatever happened, and a row or a release that could not be written
is written again as soon as the database answers.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sweepd.clock import Clock, Timer
from sweepd.context import SweepContext
from sweepd.durations import format_duration
from sweepd.errors import StoreError
from sweepd.history import History, Status, Trigger, describe_error
from sweepd.lease import LeaseStore, Lost, Won
from sweepd.metrics import Metrics
from sweepd.model import SweepDef
from sweepd.observe import format_traceback
from sweepd.offload import Batcher, Threads, bounded
from sweepd.slots import Peers, Slots
from sweepd.store import Ask, Closed, Hand, Opened, Row, Started, TickStore, tick_store
from sweepd.tasks import spawn

CancelReason = Literal["timeout", "lost", "cancelled"]

# How long a run's ending waits for others to go in the same call. Sync runs
# in a burst end a turn of the loop apart, so without it most runs paid a call
# of their own to finish their row and release their lease. Only the run's own
# end waits for it (its run.finished line, its sweep's next tick): its slot is
# back already, and its lease, renewed at most ttl/3 ago, has time to spare.
CLOSE_GATHER_SECONDS = 0.02
LOST_MESSAGE = "the lease was lost while the run was in flight"
DRAIN_MESSAGE = "drain timeout reached"
# What the row of a tick says when it was won for a flight that had gone.
ORPHANED_ERROR = "its flight had stopped when the claim came back; the lease was given back"


def iso(instant: datetime | None) -> str | None:
    return None if instant is None else instant.isoformat().replace("+00:00", "Z")


@dataclass
class Ended:
    """An attempt that returned, whose row is still to be finished."""

    run_id: int
    name: str
    status: Status
    message: str | None
    duration: float
    log: Any
    error: BaseException | None = None  # the sweep's own exception, for its traceback

    def row(self) -> Row:
        return self.run_id, self.name, self.status, self.message


@dataclass
class Attempt:
    """What the daemon may need to reach into while a run is in flight."""

    sweep: SweepDef
    token: int
    ctx: SweepContext
    run_id: int | None = None
    task: asyncio.Future[Any] | None = None  # the async run, or the sync run's bridge future
    reason: CancelReason | None = None  # why it was stopped, when it was


class Runner:
    def __init__(
        self,
        store: LeaseStore,
        history: History,
        holder: str,
        clock: Clock,
        log: Any,
        stats: Counter[str],
        concurrency: int = 4,
        metrics: Metrics | None = None,
    ) -> None:
        self.holder = holder
        self.clock, self.log, self.stats = clock, log, stats
        self.metrics = metrics or Metrics()
        # False after a lease was lost to an outage: the replica claims nothing
        # new until a probe gets through to the database again.
        self.store_healthy = True
        self.inflight: dict[str, Attempt] = {}
        self.draining = False
        self.unfinished: list[Row] = []  # endings not yet written
        self.unreleased: dict[str, int] = {}  # leases whose release failed: name -> token
        self._probing: asyncio.Task[None] | None = None
        self._settling: asyncio.Task[None] | None = None
        self.ticks = tick_store(store, history, holder)
        self.peers = Peers(clock.monotonic)
        self._slots: Slots[Ask, Opened] = Slots(
            concurrency,
            self.ticks.open,
            holds=lambda opened: isinstance(opened.claim, Won),
            share=self.peers.share,
            orphaned=self._orphaned,
            clock=clock,
            stats=stats,
            log=log,
        )
        self._closes = Batcher(self.ticks.close, gather=CLOSE_GATHER_SECONDS, clock=clock)
        self.renewals = Renewals(self.ticks, clock, on_lost=self._lose, on_error=self._renew_failed)

    # -- one tick ----------------------------------------------------------------------

    async def execute(
        self, sweep: SweepDef, tick: datetime | None, trigger: Trigger = "schedule"
    ) -> str:
        """Run ``tick`` of ``sweep`` if this replica wins it; return what happened."""
        log = self.log.bind(sweep=sweep.name, tick=iso(tick), holder=self.holder)
        if not self.store_healthy:
            return self._skip(sweep.name, log, "store_unavailable")
        if self.unfinished or self.unreleased:
            await self.settle()
        try:
            opened = await self._slots.take(Ask(sweep, tick, trigger))
        except StoreError as error:
            # Loud: every replica failing here is a sweep that silently stopped.
            self.stats["lease_errors"] += 1
            self.stats["ticks_failed"] += 1
            self.metrics.store_errors.labels("claim").inc()
            log.error("lease.error", operation="claim", error=str(error), transient=error.transient)
            return "lease_error"
        if opened is None:
            return "draining"  # the daemon began draining while this tick waited for a slot
        if isinstance(opened.claim, Lost):
            if opened.claim.holder is not None and opened.claim.holder != self.holder:
                self.peers.seen(opened.claim.holder)
            return self._skip(
                sweep.name,
                log,
                opened.claim.reason,
                held_by=opened.claim.holder,
                expires_at=iso(opened.claim.expires_at),
            )
        return await self._run(sweep, tick, trigger, opened, log)

    def holds(self, name: str) -> bool:
        """Whether a tick of ``name`` is claimed here: from its claim, through its
        attempts, their backoff and a timed-out thread, to its release."""
        return self.renewals.holds(name)

    def drain(self) -> None:
        """Claim nothing more: ticks waiting for a slot are answered ``draining``, no retries."""
        self.draining = True
        self._slots.drain()

    async def _run(
        self,
        sweep: SweepDef,
        tick: datetime | None,
        trigger: Trigger,
        opened: Opened,
        log: Any,
    ) -> str:
        """Run a won tick in its slot: attempts under renewals, then finish and release."""
        assert isinstance(opened.claim, Won) and opened.started is not None
        token, started = opened.claim.token, opened.started
        log = log.bind(fencing_token=token)
        lease_lost, cancelled = threading.Event(), threading.Event()
        status: Status = "failed"
        ended: Ended | None = None  # the last attempt, its row finished with the release
        try:
            self._claimed(sweep, tick, trigger, opened, log)
            self.renewals.hold(sweep, token, lease_lost, log)
            for attempt in range(1, sweep.retries.max + 2):
                if attempt > 1:
                    started = await self._start(sweep, tick, token, attempt, trigger)
                ctx = self._context(sweep, tick, token, attempt, log, cancelled, lease_lost)
                ended = await self._attempt(sweep, started, token, ctx, trigger, log)
                status = "failed" if ended is None else ended.status
                if status not in ("failed", "timeout") or attempt > sweep.retries.max:
                    break  # done: a success, the last attempt, or stopped from outside
                if ended is not None:  # another attempt follows: this one's row is finished now
                    await self._finish(ended)
                    ended = None
                if not self.draining and sweep.retries.backoff.total_seconds() > 0:
                    await self.clock.sleep(sweep.retries.backoff.total_seconds())
                if self.draining or lease_lost.is_set():  # no retry for a drain or a lost lease
                    break
        finally:
            # The slot bounds running code, so it goes back before the close; the
            # sweep's next tick still waits for the release, in this flight.
            self._slots.give_back()
            self.renewals.drop(sweep.name)
            await self._hand_back(sweep.name, token, ended, lease_lost, log)
        return status

    def _claimed(
        self, sweep: SweepDef, tick: datetime | None, trigger: Trigger, opened: Opened, log: Any
    ) -> None:
        """Count and log a won tick, and the rows its claim found left running."""
        self.stats["ticks_claimed"] += 1
        lateness = None if tick is None else round((self.clock.now() - tick).total_seconds(), 6)
        if lateness is not None:
            self.metrics.of(sweep.name).lateness.observe(max(0.0, lateness))
        # The first attempt's row id goes here: its run.started line would say
        # nothing more, so it is a debug line, one fewer per run (a retry's is info).
        run_id = opened.started if isinstance(opened.started, int) else None  # None: no row
        log.info("tick.claimed", lateness=lateness, trigger=trigger, run_id=run_id)
        if opened.lost_error is not None:
            self._record_failed(log, "mark lost", opened.lost_error)
        elif opened.lost_runs:
            self.stats["runs.lost"] += opened.lost_runs
            log.warning("run.marked_lost", count=opened.lost_runs)

    def _context(
        self,
        sweep: SweepDef,
        tick: datetime | None,
        token: int,
        attempt: int,
        log: Any,
        cancelled: threading.Event,
        lease_lost: threading.Event,
    ) -> SweepContext:
        return SweepContext(
            name=sweep.name,
            tick=tick if tick is not None else self.clock.now(),
            fencing_token=token,
            attempt=attempt,
            holder=self.holder,
            logger=log,
            cancelled=cancelled,
            lease_lost=lease_lost,
        )

    async def _hand_back(
        self, name: str, token: int, ended: Ended | None, lease_lost: threading.Event, log: Any
    ) -> None:
        """Finish the last attempt's row and release the lease, then say how it went."""
        closed = await self._close(name, token, None if ended is None else ended.row(), log)
        taken = not closed.released and closed.release_error is None
        if taken and not lease_lost.is_set() and not self.draining:
            # Another replica claimed the lease while the run was in flight,
            # and no renewal came round to say so (this replica was paused, and
            # the code returned as it resumed): the run was lost, as its row
            # says already, whatever its code returned. (A drain's deadline
            # releases the leases of the runs it gave up on itself.)
            self.stats["leases_lost"] += 1
            self.metrics.lease_losses.labels(name).inc()
            log.error("lease.lost", reason="taken", note="found at the release")
            if ended is not None:
                ended.status, ended.message, ended.error = "lost", LOST_MESSAGE, None
        if ended is not None:
            self._finished(ended, closed.row_error)
        if closed.released:
            log.debug("lease.released")

    # -- the database side of a run: retries' rows, and the closing hop ---------------------

    async def _start(
        self, sweep: SweepDef, tick: datetime | None, token: int, attempt: int, trigger: Trigger
    ) -> Started:
        try:
            return await bounded(self.ticks.start, sweep.name, tick, token, attempt, trigger)
        except StoreError as error:
            return str(error)

    async def _finish(self, ended: Ended) -> None:
        try:
            await bounded(self.ticks.finish, ended.row())
        except StoreError as error:
            self._finished(ended, str(error))
        else:
            self._finished(ended, None)

    async def _close(self, name: str, token: int, ending: Row | None, log: Any) -> Closed:
        """Finish a run's last row and release its lease; a release that failed is
        kept to be retried as soon as the database answers."""
        try:
            closed = await self._closes.submit(Hand(name, token, ending))
        except StoreError as error:
            closed = Closed(None if ending is None else str(error), False, str(error))
        if closed.release_error is not None:
            self.metrics.store_errors.labels("release").inc()
            # Until it is freed, this sweep's next tick is blocked on every
            # replica; waiting out the ttl would cost ticks once the database is back.
            self.unreleased[name] = token
            log.warning(
                "lease.release_failed",
                error=closed.release_error,
                note="retried as soon as the database answers; at worst it frees itself at its expiry",
            )
            self._recover()
        return closed

    def _orphaned(self, ask: Ask, opened: Opened) -> None:
        """A tick won for a flight that had gone (cancelled while its claim was
        out): its row says so and its lease goes back now, not at its expiry."""
        assert isinstance(opened.claim, Won)
        token, name = opened.claim.token, ask.sweep.name
        log = self.log.bind(sweep=name, tick=iso(ask.tick), holder=self.holder, fencing_token=token)
        log.warning("tick.orphaned", note="won after its flight had stopped; given back")
        self.stats["ticks.orphaned"] += 1
        ending: Row | None = None
        if isinstance(opened.started, int):
            ending = (opened.started, name, "cancelled", ORPHANED_ERROR)
        spawn(self._give_back(name, token, ending, log), name=f"give-back-{name}")

    async def _give_back(self, name: str, token: int, ending: Row | None, log: Any) -> None:
        closed = await self._close(name, token, ending, log)
        if ending is not None and closed.row_error is not None:
            self._record_failed(log, "finish", closed.row_error)
            self.unfinished.append(ending)
            self._recover()

    def _finished(self, ended: Ended, failed: str | None) -> None:
        """Count and log the attempt's end once its row says so (or could not be made to)."""
        self.stats[f"runs.{ended.status}"] += 1
        self.metrics.of(ended.name).ended(
            ended.status, ended.duration, self.clock.now().timestamp()
        )
        if failed is not None:
            self._record_failed(ended.log, "finish", failed, status=ended.status)
            self.unfinished.append(ended.row())
            self._recover()
        fields: dict[str, Any] = {"status": ended.status, "duration": ended.duration}
        if ended.status == "success":
            ended.log.info("run.finished", **fields)
            return
        if ended.error is not None:
            fields["exception"] = format_traceback(ended.error)
        ended.log.error("run.finished", **fields, error=ended.message)

    def _skip(self, name: str, log: Any, reason: str, **fields: Any) -> str:
        self.stats[f"skipped.{reason}"] += 1
        self.metrics.skips.labels(name, reason).inc()
        # Losing to another replica is the system working: quiet. The rest is
        # news, and a replica whose clock runs ahead of the database is a fault.
        if reason in ("lease_held", "already_run"):
            log.debug("tick.skipped", reason=reason, **fields)
        elif reason == "clock_skew":
            log.error(
                "tick.skipped",
                reason=reason,
                note="this host's clock is ahead of the database's; fix its time sync",
                **fields,
            )
        else:
            log.warning("tick.skipped", reason=reason, **fields)
        return reason

    def _record_failed(self, log: Any, operation: str, error: str, **fields: Any) -> None:
        """A run row that could not be written: loud, and counted as the store's error."""
        self.metrics.store_errors.labels(operation).inc()
        log.error("run.record_failed", operation=operation, error=error, **fields)

    # -- one attempt ----------------------------------------------------------------------

    async def _attempt(
        self,
        sweep: SweepDef,
        started: Started,
        token: int,
        ctx: SweepContext,
        trigger: Trigger,
        log: Any,
    ) -> Ended | None:
        """Call the sweep once; None if its row could not be written, so it never ran."""
        if isinstance(started, str):
            # No row, no run: a run nobody can account for is worse than a
            # loudly failed tick.
            self.stats["ticks_failed"] += 1
            self._record_failed(log, "start", started, attempt=ctx.attempt)
            return None
        run_id = started
        log = log.bind(run_id=run_id, attempt=ctx.attempt)
        ctx.logger = log
        attempt = Attempt(sweep=sweep, token=token, ctx=ctx, run_id=run_id)
        self.inflight[sweep.name] = attempt
        began = self.clock.monotonic()
        (log.info if ctx.attempt > 1 else log.debug)("run.started", trigger=trigger)
        try:
            status, message, error = await self._call(attempt)
        finally:
            self.inflight.pop(sweep.name, None)
        duration = round(self.clock.monotonic() - began, 6)
        return Ended(run_id, sweep.name, status, message, duration, log, error)

    async def _call(self, attempt: Attempt) -> tuple[Status, str | None, BaseException | None]:
        """Run the sweep's code once: its status, the row's error text, and the
        sweep's own exception when it raised one."""
        sweep, ctx = attempt.sweep, attempt.ctx
        call = (
            functools.partial(sweep.func, ctx, **sweep.args)
            if sweep.takes_context
            else functools.partial(sweep.func, **sweep.args)
        )
        loop = asyncio.get_running_loop()
        if inspect.iscoroutinefunction(sweep.func):
            attempt.task = asyncio.ensure_future(call())
        else:
            attempt.task = loop.create_future()
            SWEEP_THREADS.run(loop, attempt.task, _named(call, sweep.name))
        if sweep.timeout is not None:  # without one, the outcome is all there is to wait for
            await self._time_out(attempt, sweep.timeout.total_seconds())
        # A sync run keeps its lease and its slot until its thread returns:
        # letting the next tick start beside it would be the overlap we forbid.
        outcome: Any = (await asyncio.gather(attempt.task, return_exceptions=True))[0]
        if attempt.reason is not None:
            return attempt.reason, _reason_text(attempt), None
        if ctx.lease_lost.is_set():
            return "lost", LOST_MESSAGE, None
        if isinstance(outcome, asyncio.CancelledError):
            return "cancelled", None, None
        if isinstance(outcome, BaseException):
            return "failed", describe_error(outcome), outcome
        return "success", None, None

    async def _time_out(self, attempt: Attempt, timeout: float) -> None:
        """Stop a run still going after ``timeout``: cancel an async one, tell a sync one."""
        assert attempt.task is not None
        done, _ = await asyncio.wait({attempt.task}, timeout=timeout)
        if done or attempt.reason is not None:
            return
        attempt.reason = "timeout"
        attempt.ctx.cancelled.set()
        if inspect.iscoroutinefunction(attempt.sweep.func):
            attempt.task.cancel()
            return
        # Said now, not when the thread finally returns: a sync sweep that
        # ignores ctx.cancelled holds its lease until it does, and its row
        # says how it ended meanwhile (§5: timeout).
        attempt.ctx.logger.warning(
            "run.timed_out", timeout=timeout, note="waiting for the thread to return"
        )
        await self._record_timeout(attempt)

    async def _record_timeout(self, attempt: Attempt) -> None:
        """Finish a timed-out sync run's row now; the close, when its thread
        returns, changes a finished row no more."""
        if attempt.run_id is None:
            return
        try:
            ending = (attempt.run_id, attempt.sweep.name, "timeout", _reason_text(attempt))
            await bounded(self.ticks.finish, ending)
        except StoreError as error:
            # The close writes it when the thread returns, or a settle after that.
            self._record_failed(attempt.ctx.logger, "timeout", str(error))

    def stop(self, name: str, reason: CancelReason) -> Attempt | None:
        """Tell the in-flight run of ``name`` to stop; an async run is cancelled."""
        attempt = self.inflight.get(name)
        if attempt is None:
            return None
        if attempt.reason is None:
            attempt.reason = reason
        (attempt.ctx.lease_lost if reason == "lost" else attempt.ctx.cancelled).set()
        if attempt.task is not None and inspect.iscoroutinefunction(attempt.sweep.func):
            attempt.task.cancel()
        return attempt

    # -- the renewals -----------------------------------------------------------------------

    def _renew_failed(self, error: StoreError, leases: int) -> None:
        self.stats["lease_errors"] += 1
        self.metrics.store_errors.labels("renew").inc()
        self.log.error(
            "lease.error",
            operation="renew",
            error=str(error),
            transient=error.transient,
            leases=leases,
        )

    def _lose(self, held: Held, why: str) -> None:
        self.stats["leases_lost"] += 1
        self.metrics.lease_losses.labels(held.sweep.name).inc()
        held.log.error("lease.lost", reason=why)
        self.stop(held.sweep.name, "lost")
        if why == "unreachable":
            # The database may be down for every lease: claim nothing until a probe gets through.
            self.store_healthy = False
            self._recover()

    def _recover(self) -> None:
        """Once the database answers, write what could not be written."""
        if self._probing is None or self._probing.done():
            self._probing = spawn(self._probe(), name="store-probe")

    async def _probe(self) -> None:
        while True:
            try:
                await bounded(self.ticks.now)
            except StoreError as error:
                self.log.warning("store.unavailable", error=str(error))
                await self.clock.sleep(1.0)
                continue
            if not self.store_healthy:
                self.store_healthy = True
                self.log.info("store.available")
            await self.settle()
            if not (self.unfinished or self.unreleased):
                return
            await self.clock.sleep(1.0)  # answered the probe, failed the writes: again

    async def settle(self) -> None:
        """Write the endings and releases that failed when their runs ended: a
        run must not stay ``running``, nor its lease block the sweep's next tick
        until its ttl runs out. One at a time: two would write an ending twice.
        """
        if self._settling is None or self._settling.done():
            self._settling = spawn(self._settle(), name="settle")
        # Shielded: a caller cancelled while it waits does not cut the writes short.
        await asyncio.shield(self._settling)

    async def _settle(self) -> None:
        for ending in list(self.unfinished):
            run_id, name, status, _ = ending
            try:
                await bounded(self.ticks.finish, ending)
            except StoreError as error:
                self.log.warning(
                    "run.record_failed", operation="finish", late=True, error=str(error)
                )
                return  # still down: the next settle tries again
            self.unfinished.remove(ending)
            self.log.info("run.recorded_late", sweep=name, run_id=run_id, status=status)
        if not self.unreleased:
            return
        # Under the same holder and token: a lease that expired and was taken
        # by another replica meanwhile has a new token, and is left alone.
        held = list(self.unreleased.items())
        try:
            freed = await bounded(self.ticks.release, held)
        except StoreError as error:
            self.log.warning("lease.release_failed", late=True, error=str(error))
            return
        for (name, token), released in zip(held, freed, strict=True):
            if self.unreleased.get(name) == token:
                del self.unreleased[name]
            self.log.info("lease.released_late", sweep=name, fencing_token=token, released=released)


# How often a replica renews the leases it holds, all of them in one call: a
# replica sends at most one renewal a second, however many runs it has in
# flight, so a ttl of a few seconds is cheap. A lease whose ttl/3 is shorter
# is renewed that often instead.
RENEW_SECONDS = 1.0


@dataclass
class Held:
    """A lease this replica holds for a run in flight."""

    sweep: SweepDef
    token: int
    lost: threading.Event  # the run's ctx.lease_lost
    log: Any
    renewed: float  # monotonic: when it was last known held (claimed, or renewed)


class Renewals:
    """The leases this replica holds, renewed together while any is held.

    Every beat renews, in one call, the leases whose ttl/3 has come due (to
    within half a beat): a run shorter than that never costs a renewal. A
    lease the renewal no longer finds is lost, taken by another replica or
    expired while this one was paused. One whose renewals have failed for
    two thirds of its ttl, less half a beat, is lost too: by the next beat it
    could expire and be claimed by another replica.
    """

    def __init__(
        self,
        ticks: TickStore,
        clock: Clock,
        *,
        on_lost: Callable[[Held, str], None],
        on_error: Callable[[StoreError, int], None],
    ) -> None:
        self.ticks, self.clock = ticks, clock
        self.on_lost, self.on_error = on_lost, on_error
        self._held: dict[str, Held] = {}
        self._timer: Timer | None = None  # the next beat, set while any lease is held
        self._beating = False

    def hold(self, sweep: SweepDef, token: int, lost: threading.Event, log: Any) -> None:
        self._held[sweep.name] = Held(sweep, token, lost, log, self.clock.monotonic())
        self._schedule()

    def holds(self, name: str) -> bool:
        return name in self._held

    def drop(self, name: str) -> None:
        """The run is over: its lease is released with its row, not renewed."""
        self._held.pop(name, None)
        if not self._held and self._timer is not None:
            self._timer.cancel()  # nothing held: nothing wakes this replica
            self._timer = None

    def _schedule(self) -> None:
        if self._timer is None and not self._beating and self._held:
            self._timer = self.clock.call_later(self._period(), self._fire)

    def _period(self) -> float:
        return min([RENEW_SECONDS, *(_third(h) for h in self._held.values())])

    def _fire(self) -> None:
        self._timer = None
        self._beating = True
        spawn(self._beat_then_schedule(self._period()), name="renewals")

    async def _beat_then_schedule(self, period: float) -> None:
        try:
            await self._beat(period)
        finally:
            self._beating = False
            self._schedule()

    async def _beat(self, period: float) -> None:
        sent = self.clock.monotonic()
        due = [h for h in self._held.values() if sent - h.renewed >= _third(h) - period / 2]
        if not due:
            return
        leases = [(h.sweep.name, h.token, h.sweep.ttl) for h in due]
        try:
            # Bounded well inside the margin: a hung renewal is a failed one.
            renewed = await bounded(self.ticks.renew, leases, timeout=period / 4)
        except StoreError as error:
            self.on_error(error, len(due))
            failed_at = self.clock.monotonic()
            for held in due:
                if failed_at - held.renewed >= 2 * _third(held) - period / 2:
                    self._lose(held, "unreachable")
            return
        for held in due:
            if held.sweep.name in renewed:
                held.renewed = sent
            else:
                self._lose(held, "taken")

    def _lose(self, held: Held, why: str) -> None:
        if self._held.get(held.sweep.name) is not held:
            return  # its run ended while the renewal was out
        del self._held[held.sweep.name]
        held.lost.set()
        self.on_lost(held, why)


def _third(held: Held) -> float:
    return held.sweep.ttl.total_seconds() / 3


# The sync sweeps': the ``concurrency`` slots bound how many run at once, but a
# sweep that ignores ``ctx.cancelled`` keeps its thread past its slot.
SWEEP_THREADS = Threads("sweepd-sweep")


def sweep_threads_busy() -> int:
    """Sync sweeps whose code is still running: after a drain, the ones that
    ignored ``ctx.cancelled`` and were left behind."""
    return SWEEP_THREADS.busy()


def _named(call: Callable[[], Any], name: str) -> Callable[[], Any]:
    """``call``, with its thread named after the sweep while it runs."""

    def named() -> Any:
        threading.current_thread().name = f"sweep-{name}"
        try:
            return call()
        finally:
            threading.current_thread().name = "sweepd-sweep"

    return named


def _reason_text(attempt: Attempt) -> str | None:
    """The row's error for a run stopped from outside; durations as a config writes them."""
    if attempt.reason == "lost":
        return LOST_MESSAGE
    if attempt.reason == "cancelled":
        return DRAIN_MESSAGE
    if attempt.reason != "timeout" or attempt.sweep.timeout is None:
        return None
    return f"timed out after {format_duration(attempt.sweep.timeout)}"
