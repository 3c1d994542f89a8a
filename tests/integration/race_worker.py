"""One racer for test_lease_race.py: claims every tick of a fixed list through LeaseStore.

Run as ``python tests/integration/race_worker.py --url URL --barrier DIR --index N``
(``--first-claims K`` races the very first claim of K new leases instead;
``--batch K`` opens every tick of K sweeps in batches through the daemon's tick store). It
connects, says it is ready (a file in DIR), waits for DIR/go so that all racers start
together, then walks the ticks in order and prints one JSON report on stdout. It never
retries a store error: an error is the finding, so it is recorded and reported.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sweepd.db.engine import make_engine
from sweepd.history import History
from sweepd.lease import LeaseStore, Lost, StoreError, Won, make_holder
from sweepd.model import SweepDef
from sweepd.schedule import Every
from sweepd.store import Ask, Hand, Opened, tick_store

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TTL = timedelta(seconds=30)
NAMESPACE = "race"
NAME = "race-sweep"
GO_WAIT = 60.0  # seconds to wait for the start signal before giving up
RETRY_PAUSE = 0.001  # seconds between claims of a tick whose lease is held
MAX_RETRIES_PER_TICK = 5000  # about 5 s of a held lease before the racer gives the tick up


def tick_at(k: int) -> datetime:
    return T0 + timedelta(seconds=k)


def wait_for_go(barrier: Path, index: int) -> bool:
    """Say ready, then wait for DIR/go, which holds the monotonic instant to start at.

    A shared start instant lines the racers up far closer than each noticing the file.
    CLOCK_MONOTONIC is system-wide and the shim leaves it alone, so all agree on it.
    """
    (barrier / f"ready-{index}").touch()
    deadline = time.monotonic() + GO_WAIT
    go = barrier / "go"
    while not go.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    start_at = float(go.read_text())
    time.sleep(max(0.0, start_at - time.monotonic() - 0.002))
    while time.monotonic() < start_at:
        pass  # spin the last moment: sleep wakes up too late to line the racers up
    return True


def race(store: LeaseStore, holder: str, ticks: int, report: dict[str, Any]) -> None:
    wins: list[dict[str, Any]] = report["wins"]
    losses: dict[str, int] = report["losses"]
    for k in range(ticks):
        tick = tick_at(k)
        retries = 0
        while True:
            started = time.monotonic()
            try:
                outcome = store.claim(NAME, holder, TTL, tick)
            except StoreError as error:
                report["errors"].append(
                    {"tick": k, "transient": error.transient, "error": str(error)}
                )
                break
            returned = time.monotonic()
            if isinstance(outcome, Won):
                # Monotonic times are system-wide: the test orders claims across racers by them.
                wins.append(
                    {
                        "tick": k,
                        "token": outcome.token,
                        "seen_tick": outcome.tick.isoformat() if outcome.tick else None,
                        "holder": outcome.holder,
                        "started": started,
                        "returned": returned,
                    }
                )
                if not store.release(NAME, holder, outcome.token):
                    # Tell a takeover (the row has moved on to a newer token) from a fault.
                    failure: dict[str, Any] = {"tick": k, "token": outcome.token}
                    try:
                        row = store.read(NAME)
                    except StoreError as error:
                        failure["read_error"] = str(error)
                    else:
                        failure["row_token"] = row.fencing_token if row else None
                        failure["row_holder"] = row.holder if row else None
                    report["release_failures"].append(failure)
                break
            assert isinstance(outcome, Lost)
            losses[outcome.reason] = losses.get(outcome.reason, 0) + 1
            if outcome.reason == "already_run":
                # The row's tick must be this one or a later one, or the loss is misreported.
                if outcome.tick is None or outcome.tick < tick:
                    report["bad_losses"].append(
                        {"tick": k, "row_tick": outcome.tick.isoformat() if outcome.tick else None}
                    )
                break
            # lease_held: a holder is between claim and release; the tick may still be ours.
            retries += 1
            report["retries"] += 1
            if retries > MAX_RETRIES_PER_TICK:
                report["gave_up"].append(k)
                break
            time.sleep(RETRY_PAUSE)
        report["max_retries_one_tick"] = max(report["max_retries_one_tick"], retries)


def first_claims(store: LeaseStore, holder: str, names: int, report: dict[str, Any]) -> None:
    """Claim tick T0 of leases that have no row yet, so the racers collide on the INSERT."""
    for n in range(names):
        name = f"first-{n}"
        try:
            outcome = store.claim(name, holder, TTL, T0)
        except StoreError as error:
            report["errors"].append(
                {"name": name, "transient": error.transient, "error": str(error)}
            )
            continue
        if isinstance(outcome, Won):
            report["first_claims"].append({"name": name, "won": True, "token": outcome.token})
            store.release(name, holder, outcome.token)
        else:
            report["first_claims"].append({"name": name, "won": False, "reason": outcome.reason})


def batches(store: LeaseStore, holder: str, ticks: int, names: int, report: dict[str, Any]) -> None:
    """Open each tick of ``names`` sweeps in batches through the daemon's tick store,
    each racer in an order of its own.

    Each call may win at most a quarter of the ticks, like a replica with few
    free slots; what it leaves undecided is asked for again until every sweep
    has an answer for the tick. The winners are closed together (rows finished,
    leases released), racing the others' opens.
    """
    ticks_store = tick_store(store, History(store.engine, NAMESPACE), holder)
    order = [race_sweep(f"batch-{n}") for n in range(names)]
    random.Random(report["index"]).shuffle(order)
    limit = max(1, names // 4)
    for k in range(ticks):
        tick = tick_at(k)
        undecided = list(order)
        won: list[Hand] = []
        while undecided:
            try:
                found = ticks_store.open(
                    [Ask(sweep, tick, "schedule") for sweep in undecided], limit
                )
            except StoreError as error:
                report["errors"].append({"tick": k, "error": str(error)})
                break
            report["calls"] += 1
            left = []
            for sweep, opened in zip(undecided, found, strict=True):
                if opened is None:
                    left.append(sweep)
                elif isinstance(opened, StoreError):
                    report["errors"].append({"tick": k, "name": sweep.name, "error": str(opened)})
                elif isinstance(opened.claim, Won):
                    token = opened.claim.token
                    report["wins"].append({"tick": k, "name": sweep.name, "token": token})
                    assert isinstance(opened.started, int), opened
                    won.append(
                        Hand(sweep.name, token, (opened.started, sweep.name, "success", None))
                    )
                else:
                    reason = opened.claim.reason
                    report["losses"][reason] = report["losses"].get(reason, 0) + 1
            if sum(isinstance(o, Opened) and isinstance(o.claim, Won) for o in found) > limit:
                report["errors"].append({"tick": k, "error": f"won more than {limit} in one call"})
            undecided = left
        for hand, closed in zip(won, ticks_store.close(won) if won else [], strict=True):
            if not closed.released:
                report["release_failures"].append(
                    {"tick": k, "name": hand.name, "token": hand.token}
                )


def race_sweep(name: str) -> SweepDef:
    return SweepDef(
        name=name,
        func=lambda: None,
        target="race_worker:nothing",
        schedule=Every(timedelta(seconds=1)),
        ttl=TTL,
        timeout=None,
        misfire_grace=TTL,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--barrier", required=True, type=Path)
    parser.add_argument("--index", required=True, type=int)
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--first-claims", type=int, default=0, help="race N new leases instead")
    parser.add_argument("--batch", type=int, default=0, help="claim N leases per tick at once")
    args = parser.parse_args(argv)

    holder = f"worker-{args.index}:{make_holder()}"
    report: dict[str, Any] = {
        "index": args.index,
        "holder": holder,
        # Both clocks read together: the test derives this process's wall-clock offset.
        "wall_start": time.time(),
        "monotonic_start": time.monotonic(),
        "wins": [],
        "losses": {},
        "retries": 0,
        "max_retries_one_tick": 0,
        "errors": [],
        "bad_losses": [],
        "gave_up": [],
        "release_failures": [],
        "first_claims": [],
        "calls": 0,
    }
    engine = make_engine(args.url)
    try:
        store = LeaseStore(engine, NAMESPACE)
        # Connect before the start so the race measures claims, not connection set-up.
        store.now()
        if not wait_for_go(args.barrier, args.index):
            print(f"no start signal within {GO_WAIT}s", file=sys.stderr)
            return 2
        began = time.monotonic()
        if args.first_claims:
            first_claims(store, holder, args.first_claims, report)
        elif args.batch:
            batches(store, holder, args.ticks, args.batch, report)
        else:
            race(store, holder, args.ticks, report)
        report["elapsed"] = time.monotonic() - began
    finally:
        engine.dispose()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
